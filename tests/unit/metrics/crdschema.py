"""Validate documents against the CRD schemas Koordinator v1.8 ships (the reference copy
beside the repository: ``../shared/reference/crds``), with a JSON-schema validator."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jsonschema
import yaml

from tests.reference import reference

NRT_CRD = "topology.node.k8s.io_noderesourcetopologies.yaml"


@functools.cache
def schema(crd: str, version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` in the CRD file ``crd`` (missing: a skip, a failure under CI)."""
    doc = yaml.safe_load(reference("crds", crd).read_text())
    for entry in doc["spec"]["versions"]:
        if entry["name"] == version:
            found: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
            return found
    raise KeyError(f"{crd}: no version {version}")


def validate_nrt(doc: Mapping[str, Any]) -> None:
    """Raises ``jsonschema.ValidationError`` when ``doc`` is not a valid v1alpha1 NodeResourceTopology."""
    jsonschema.validate(doc, schema(NRT_CRD, "v1alpha1"), cls=jsonschema.Draft7Validator)
