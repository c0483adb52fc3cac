#!/usr/bin/env python3
"""Generate the Python protocol package ``criapi/`` from ``cri-api/criapi/*.proto``.

Usage (from anywhere; paths are resolved relative to the repo root):

    python scripts/gen_proto.py          # (re)generate criapi/*_pb2*.py{,i}
    python scripts/gen_proto.py --check  # exit 1 if committed files are stale

Protos are compiled with ``-I cri-api`` so that the proto path
``criapi/cri_v1.proto`` maps to the Python module ``criapi.cri_v1_pb2``.
Only the generated files are written; ``criapi/__init__.py`` and
``criapi/py.typed`` are maintained by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "cri-api"
PACKAGE = "criapi"
PROTOS = ("criapi/cri_v1.proto", "criapi/hook_v1alpha1.proto", "criapi/containerd_events_v1.proto",
          "criapi/nri_v1alpha1.proto", "criapi/ttrpc.proto")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_files() -> list[str]:
    """Paths (relative to the output root) of every file protoc produces."""
    return [
        proto[: -len(".proto")] + suffix for proto in PROTOS for suffix in SUFFIXES
    ]


def run_protoc(out_dir: Path) -> None:
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / p) for p in PROTOS),
    ]
    (out_dir / PACKAGE).mkdir(parents=True, exist_ok=True)
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def check() -> int:
    stale = []
    with tempfile.TemporaryDirectory(prefix="gen_proto_") as tmp:
        run_protoc(Path(tmp))
        for rel in generated_files():
            fresh = Path(tmp) / rel
            committed = REPO_ROOT / rel
            if not committed.is_file() or not filecmp.cmp(
                fresh, committed, shallow=False
            ):
                stale.append(rel)
    if stale:
        print("stale generated files (run: python scripts/gen_proto.py):")
        for rel in stale:
            print(f"  {rel}")
        return 1
    print("generated protocol code is up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare freshly generated code with the committed files",
    )
    opts = parser.parse_args(argv)
    if opts.check:
        return check()
    run_protoc(REPO_ROOT)
    for rel in generated_files():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
