"""Protocol tests: generated code is fresh, matches the wire schema, keeps unknown fields."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from tests.reference import reference

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {
    "cri-api-v1-schema.md": "criapi.cri_v1_pb2",
    "koordinator-runtimehook-v1alpha1-schema.md": "criapi.hook_v1alpha1_pb2",
}

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
cri_v1_pb2 = importlib.import_module("criapi.cri_v1_pb2")

SCALAR_TYPES = {
    "double": FieldDescriptor.TYPE_DOUBLE,
    "float": FieldDescriptor.TYPE_FLOAT,
    "int64": FieldDescriptor.TYPE_INT64,
    "uint64": FieldDescriptor.TYPE_UINT64,
    "int32": FieldDescriptor.TYPE_INT32,
    "uint32": FieldDescriptor.TYPE_UINT32,
    "sint32": FieldDescriptor.TYPE_SINT32,
    "sint64": FieldDescriptor.TYPE_SINT64,
    "fixed32": FieldDescriptor.TYPE_FIXED32,
    "fixed64": FieldDescriptor.TYPE_FIXED64,
    "sfixed32": FieldDescriptor.TYPE_SFIXED32,
    "sfixed64": FieldDescriptor.TYPE_SFIXED64,
    "bool": FieldDescriptor.TYPE_BOOL,
    "string": FieldDescriptor.TYPE_STRING,
    "bytes": FieldDescriptor.TYPE_BYTES,
}

SERVICE_RE = re.compile(r"^## service (\w+)")
METHOD_RE = re.compile(r"^- (\w+)\((\w+)\) -> (stream )?(\w+)\s*$")
MESSAGE_RE = re.compile(r"^### message (\w+)")
FIELD_RE = re.compile(r"^- (\d+): (\w+) (.+?)\s*$")
ENUM_RE = re.compile(r"^### enum ([\w.]+): (.*)$")


def parse_schema(text: str) -> dict:
    services: dict[str, list[tuple[str, str, str, bool]]] = {}
    messages: dict[str, list[tuple[int, str, str]]] = {}
    enums: dict[str, dict[str, int]] = {}
    section: tuple[str, str] | None = None
    for line in text.splitlines():
        if m := SERVICE_RE.match(line):
            section = ("service", m.group(1))
            services[m.group(1)] = []
        elif m := MESSAGE_RE.match(line):
            section = ("message", m.group(1))
            messages[m.group(1)] = []
        elif m := ENUM_RE.match(line):
            section = None
            values = (v.strip().split("=") for v in m.group(2).split(","))
            enums[m.group(1)] = {k.strip(): int(n) for k, n in values}
        elif line.startswith("#"):
            section = None
        elif section and section[0] == "service" and (m := METHOD_RE.match(line)):
            name, req, stream, resp = m.groups()
            services[section[1]].append((name, req, resp, bool(stream)))
        elif section and section[0] == "message" and (m := FIELD_RE.match(line)):
            messages[section[1]].append((int(m.group(1)), m.group(2), m.group(3)))
    return {"services": services, "messages": messages, "enums": enums}


def load_schema(md_name: str):
    path = reference(md_name)
    return parse_schema(path.read_text()), importlib.import_module(SCHEMAS[md_name])


def type_matches(fd: FieldDescriptor, type_name: str) -> bool:
    """Compare a non-map, non-repeated schema type name with a field descriptor."""
    if type_name in SCALAR_TYPES:
        return fd.type == SCALAR_TYPES[type_name]
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return fd.message_type.name == type_name
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return fd.enum_type.name == type_name
    return False


def check_field(fd: FieldDescriptor, type_spec: str) -> str | None:
    """Return a mismatch description, or None when the field matches the spec."""
    is_map = (
        fd.type == FieldDescriptor.TYPE_MESSAGE
        and fd.message_type.GetOptions().map_entry
    )
    if m := re.fullmatch(r"map<\s*(\w+)\s*,\s*(\w+)\s*>", type_spec):
        if not is_map:
            return "expected a map field"
        key = fd.message_type.fields_by_name["key"]
        value = fd.message_type.fields_by_name["value"]
        if not (type_matches(key, m.group(1)) and type_matches(value, m.group(2))):
            return "map key/value types differ"
        return None
    if is_map:
        return "unexpected map field"
    repeated = type_spec.startswith("repeated ")
    if repeated != fd.is_repeated:
        return f"repeated={fd.is_repeated}, expected {repeated}"
    base = type_spec.removeprefix("repeated ").strip()
    if not type_matches(fd, base):
        return f"type {fd.type} does not match {base!r}"
    return None


def find_message(module, name: str):
    return module.DESCRIPTOR.message_types_by_name.get(name)


def test_generated_code_is_up_to_date():
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_proto.py"), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("md_name", sorted(SCHEMAS))
def test_services_match_schema(md_name):
    schema, module = load_schema(md_name)
    assert schema["services"], "no services parsed from schema"
    for svc_name, methods in schema["services"].items():
        svc = module.DESCRIPTOR.services_by_name.get(svc_name)
        assert svc is not None, f"service {svc_name} missing"
        pkg = module.DESCRIPTOR.package
        assert [m.name for m in svc.methods] == [m[0] for m in methods]
        for name, req, resp, streaming in methods:
            md = svc.methods_by_name[name]
            assert md.input_type.full_name == f"{pkg}.{req}", name
            assert md.output_type.full_name == f"{pkg}.{resp}", name
            assert md.server_streaming is streaming, name
            assert md.client_streaming is False, name


@pytest.mark.parametrize("md_name", sorted(SCHEMAS))
def test_messages_match_schema(md_name):
    schema, module = load_schema(md_name)
    assert schema["messages"], "no messages parsed from schema"
    problems = []
    for msg_name, fields in schema["messages"].items():
        desc = find_message(module, msg_name)
        if desc is None:
            problems.append(f"message {msg_name} missing")
            continue
        expected_numbers = {num for num, _, _ in fields}
        actual_numbers = {fd.number for fd in desc.fields}
        if expected_numbers != actual_numbers:
            problems.append(
                f"{msg_name}: field numbers {sorted(actual_numbers)}"
                f" != {sorted(expected_numbers)}"
            )
        for num, name, type_spec in fields:
            fd = desc.fields_by_number.get(num)
            if fd is None:
                continue
            if fd.name != name:
                problems.append(f"{msg_name}.{num}: name {fd.name!r} != {name!r}")
            elif err := check_field(fd, type_spec):
                problems.append(f"{msg_name}.{name}: {err}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("md_name", sorted(SCHEMAS))
def test_enums_match_schema(md_name):
    schema, module = load_schema(md_name)
    for enum_name, values in schema["enums"].items():
        if "." in enum_name:
            parent, child = enum_name.split(".", 1)
            desc = find_message(module, parent).enum_types_by_name.get(child)
        else:
            desc = module.DESCRIPTOR.enum_types_by_name.get(enum_name)
        assert desc is not None, f"enum {enum_name} missing"
        assert {v.name: v.number for v in desc.values} == values, enum_name


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _unknown_fields() -> bytes:
    # Field 99 as a varint (wire type 0) and field 100 as length-delimited (wire type 2).
    payload = b"future-knob"
    return (
        _varint(99 << 3 | 0)
        + _varint(12345)
        + _varint(100 << 3 | 2)
        + _varint(len(payload))
        + payload
    )


def test_unknown_fields_survive_roundtrip():
    known = cri_v1_pb2.LinuxContainerResources(cpu_period=100000, cpuset_cpus="0-3")
    unknown = _unknown_fields()
    wire = known.SerializeToString() + unknown

    msg = cri_v1_pb2.LinuxContainerResources()
    msg.ParseFromString(wire)
    assert msg.cpu_period == 100000
    msg.cpu_quota = 50000
    msg.unified["memory.high"] = "1G"
    out = msg.SerializeToString()

    assert unknown in out
    reparsed = cri_v1_pb2.LinuxContainerResources.FromString(out)
    assert reparsed.cpu_quota == 50000
    assert reparsed.cpuset_cpus == "0-3"


def test_unknown_fields_survive_in_nested_message():
    unknown = _unknown_fields()
    inner = cri_v1_pb2.LinuxContainerResources(cpu_shares=512).SerializeToString()
    inner += unknown
    # UpdateContainerResourcesRequest.linux is field 2, length-delimited.
    wire = (
        cri_v1_pb2.UpdateContainerResourcesRequest(container_id="c1").SerializeToString()
        + _varint(2 << 3 | 2)
        + _varint(len(inner))
        + inner
    )
    req = cri_v1_pb2.UpdateContainerResourcesRequest.FromString(wire)
    req.linux.cpu_quota = 20000
    req.annotations["k"] = "v"
    out = cri_v1_pb2.UpdateContainerResourcesRequest.FromString(req.SerializeToString())
    assert unknown in out.linux.SerializeToString()
    assert out.linux.cpu_shares == 512 and out.linux.cpu_quota == 20000
