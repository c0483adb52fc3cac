"""Per-method CRI counters through both data planes: the gRPC transport counts in Python,
HAProxy counts pass-through calls in its own stick table, read at scrape time
(runtimeproxy.dataplane.haproxystats). Both give the same /metrics for the same calls."""

from __future__ import annotations

import re
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from criapi import cri_v1_pb2 as cri
from runtimeproxy.dataplane.haproxystats import DataPlaneCounters, parse_table

RT = "/runtime.v1.RuntimeService/"
LIST = RT + "ListContainers"
STATUS = RT + "Status"
NATIVE = "/containerd.services.version.v1.Version/Version"
CALLS = "koord_runtime_proxy_cri_calls_total"
ERRORS = "koord_runtime_proxy_cri_errors_total"


@pytest_asyncio.fixture
async def proxy(fake_runtime: Any, start_proxy: Any, plane: str) -> Any:
    return await start_proxy(fake_runtime, data_plane=plane)


def _samples(body: bytes, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in body.decode().splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
            out[labels] = float(m.group(2))
    return out


async def _calls(proxy: Any, method: str, n: int) -> list[grpc.StatusCode]:
    codes = []
    for _ in range(n):
        try:
            await proxy.call(method)
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
    return codes


@pytest.mark.asyncio
async def test_per_method_counts_and_codes_in_metrics(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    before = set(_samples((await proxy.http_get("/metrics"))[1], CALLS).items())
    assert await _calls(proxy, LIST, 7) == [grpc.StatusCode.OK] * 7
    fake_runtime.answer(STATUS, answer(code=grpc.StatusCode.NOT_FOUND, details="nope"))
    assert await _calls(proxy, STATUS, 3) == [grpc.StatusCode.NOT_FOUND] * 3
    # 20 different unknown methods (containerd answers UNIMPLEMENTED): one label, not 20.
    for i in range(20):
        assert await _calls(proxy, f"{RT}Future{i}", 1) == [grpc.StatusCode.UNIMPLEMENTED]
    assert await _calls(proxy, NATIVE, 2) == [grpc.StatusCode.UNIMPLEMENTED] * 2
    await proxy.call(RT + "RunPodSandbox", cri.RunPodSandboxRequest(
        config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="p", namespace="n", uid="u"))
    ).SerializeToString())

    status, body = await proxy.http_get("/metrics")
    assert status == 200
    calls, errors = _samples(body, CALLS), _samples(body, ERRORS)
    assert calls[(("method", LIST), ("path", "passthrough"))] == 7
    assert calls[(("method", STATUS), ("path", "passthrough"))] == 3
    assert calls[(("method", RT + "*"), ("path", "passthrough"))] == 20
    assert calls[(("method", RT + "RunPodSandbox"), ("path", "intercepted"))] == 1
    assert (("method", RT + "RunPodSandbox"), ("path", "passthrough")) not in calls
    assert not [k for k in calls if any("Future" in v for _, v in k)]
    assert errors[(("code", "NOT_FOUND"), ("method", STATUS))] == 3
    assert errors[(("code", "UNIMPLEMENTED"), ("method", RT + "*"))] == 20
    assert errors[(("code", "UNIMPLEMENTED"), ("method", "*"))] == 2
    assert not [k for k in errors if dict(k)["method"] == LIST]
    # Nothing but the methods called changed or appeared.
    changed = {dict(k)["method"] for k, v in set(calls.items()) - before if v}
    assert changed == {LIST, STATUS, RT + "*", RT + "RunPodSandbox"}
    # Exactly one family per name: HAProxy's samples join Python's, no duplicate HELP/TYPE.
    assert body.count(b"# TYPE koord_runtime_proxy_cri_calls_total counter") == 1
    # ... and one series per label set (Python's zero-valued child and HAProxy's count are one).
    assert body.count(f'{CALLS}{{method="{LIST}",path="passthrough"}}'.encode()) == 1

    # The backend gone: UNAVAILABLE (HAProxy answers 503 itself), counted per method.
    await fake_runtime.stop()
    assert await _calls(proxy, LIST, 1) == [grpc.StatusCode.UNAVAILABLE]
    errors = _samples((await proxy.http_get("/metrics"))[1], ERRORS)
    assert errors[(("code", "UNAVAILABLE"), ("method", LIST))] == 1


def test_counters_stay_monotonic_when_haproxy_restarts() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    calls = Counter("koord_runtime_proxy_cri_calls", "c", ["method", "path"], registry=registry)
    errors = Counter("koord_runtime_proxy_cri_errors", "e", ["method", "code"], registry=registry)
    key = "/runtime.v1.RuntimeService/Version"
    row = [f"0x1: key={key} use=0 exp=0 conn_cur=1 http_req_cnt=5 gpc0=3 gpc5=2 gpc14=0"]  # 1 in flight, 1 HAProxy 503
    registry.unregister(calls)
    registry.unregister(errors)
    registry.register(DataPlaneCounters(calls, errors, lambda: parse_table("# table: x\n" + row[0])))

    def get(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert get(CALLS, method=key, path="passthrough") == 5
    assert get(ERRORS, method=key, code="NOT_FOUND") == 2
    assert get(ERRORS, method=key, code="UNAVAILABLE") == 1
    row[0] = f"0x1: key={key} use=0 exp=0 conn_cur=1 http_req_cnt=5 gpc0=4 gpc5=2 gpc14=0"  # answered, not ended
    assert get(ERRORS, method=key, code="UNAVAILABLE") == 1  # the dip to 0 is not exported
    row[0] = ""  # HAProxy restarted: an empty table
    assert get(CALLS, method=key, path="passthrough") == 5
    assert get(ERRORS, method=key, code="NOT_FOUND") == 2
    row[0] = f"0x2: key={key} use=0 exp=0 conn_cur=0 http_req_cnt=2 gpc0=2 gpc5=1 gpc14=1"
    assert get(CALLS, method=key, path="passthrough") == 7
    assert get(ERRORS, method=key, code="NOT_FOUND") == 3
    assert get(ERRORS, method=key, code="UNAVAILABLE") == 2
