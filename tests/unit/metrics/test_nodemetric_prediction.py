"""NodeMetric ``hostApplicationMetric``, ``prodReclaimableMetric`` and ``prodPeakMetric``:
built from a real store and the predictor, validated against the shipped CRD schema
(Koordinator v1.8, ../shared/reference/crds) with ``jsonschema``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hooks.qos import QoSClass
from metrics.analysis.prediction import SYSTEM, Model, PodDemand, PredictionSettings, prod_reclaimable
from metrics.model import (
    HOST_APP_CPU_USAGE,
    HOST_APP_MEMORY_USED,
    NODE_CPU_USAGE,
    NODE_MEMORY_USED,
    POD_CPU_USAGE,
    POD_MEMORY_USED,
    POD_UID,
    SYSTEM_CPU_USAGE,
    SYSTEM_MEMORY_USED,
    PodView,
    Sample,
    labels,
)
from metrics.report.nodemetric import CollectPolicy, build_status
from metrics.store.tsdb import TSDB
from tests.reference import reference

NOW = 1_700_000_000.0
GIB = 2**30


def crd_status_schema(name: str) -> dict[str, Any]:
    path = reference("crds", name)
    crd = yaml.safe_load(path.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return schema


def validate(status: dict[str, Any]) -> None:
    schema = crd_status_schema("slo.koordinator.sh_nodemetrics.yaml")
    jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER).validate(status)


WEB = PodView(uid="web", namespace="ns", name="web", sandbox_id="sb", qos=QoSClass.LS, priority=9500,
              priority_class="koord-prod", cgroup_dir="kubepods/podweb")
NGINX = labels(host_app_name="nginx", priority_class="koord-prod", qos="LS")
AGENT = labels(host_app_name="agent", priority_class="", qos="")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    samples: list[Sample] = []
    for k in range(300):
        ts = NOW - 0.5 - k
        samples += [Sample(NODE_CPU_USAGE, 3.0, (), ts), Sample(NODE_MEMORY_USED, 6 * GIB, (), ts),
                    Sample(SYSTEM_CPU_USAGE, 0.25, (), ts), Sample(SYSTEM_MEMORY_USED, GIB, (), ts),
                    Sample(POD_CPU_USAGE, 2.0, labels(**{POD_UID: "web"}), ts),
                    Sample(POD_MEMORY_USED, 2 * GIB, labels(**{POD_UID: "web"}), ts),
                    Sample(HOST_APP_CPU_USAGE, 0.5, NGINX, ts), Sample(HOST_APP_MEMORY_USED, 3 * GIB, NGINX, ts),
                    Sample(HOST_APP_CPU_USAGE, 0.25, AGENT, ts)]
    db.write(samples)
    db.flush()
    yield db
    db.close()


def reclaimable() -> Any:
    models = {SYSTEM: Model.new(NOW - 3 * 86400), "pod/web": Model.new(NOW - 3 * 86400)}
    models[SYSTEM].add(0.25, GIB, NOW - 60)
    models["pod/web"].add(2.0, 2 * GIB, NOW - 60)

    def predict(key: str) -> dict[str, tuple[float, float]] | None:
        return models[key].percentiles() if key in models else None

    return prod_reclaimable(predict, lambda k: None, [PodDemand("web", "koord-prod", 4.0, 8 * GIB, NOW - 2 * 86400)],
                            (8.0, 32 * GIB), NOW, PredictionSettings())


def test_status_with_host_applications_and_prediction_validates(store: TSDB) -> None:
    result = reclaimable()
    status = build_status(store, [WEB], CollectPolicy(), NOW, result)
    validate(status)
    assert status["hostApplicationMetric"] == [
        {"name": "agent", "usage": {"resources": {"cpu": "250m"}}},
        {"name": "nginx", "usage": {"resources": {"cpu": "500m", "memory": str(3 * GIB)}}, "priority": "koord-prod",
         "qos": "LS"},
    ]
    cpu, memory = result.reclaimable
    assert status["prodReclaimableMetric"] == {
        "resource": {"resources": {"cpu": f"{round(cpu * 1000)}m", "memory": str(round(memory))}}}
    peak_cpu, peak_memory = result.peak
    assert status["prodPeakMetric"] == {
        "resource": {"resources": {"cpu": f"{round(peak_cpu * 1000)}m", "memory": str(round(peak_memory))}}}
    assert 0 < cpu < 4 and 0 < memory < 8 * GIB


def test_without_a_prediction_or_host_applications_the_fields_are_left_out(tmp_path: Path) -> None:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    db.write([Sample(NODE_CPU_USAGE, 1.0, (), NOW - 1), Sample(NODE_MEMORY_USED, GIB, (), NOW - 1)])
    db.flush()
    status = build_status(db, [], CollectPolicy(), NOW, None)
    db.close()
    validate(status)
    assert not {"hostApplicationMetric", "prodReclaimableMetric", "prodPeakMetric"} & status.keys()


def test_the_schema_check_catches_a_wrong_shape(store: TSDB) -> None:
    """The validator is live: a quantity that is not one fails."""
    status = build_status(store, [WEB], CollectPolicy(), NOW, reclaimable())
    status["prodPeakMetric"]["resource"]["resources"]["cpu"] = "lots"
    with pytest.raises(jsonschema.ValidationError):
        validate(status)
