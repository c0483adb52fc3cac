"""Per-method CRI counters of the HAProxy data plane, read from HAProxy at scrape time.

With ``data_plane: haproxy`` pass-through calls never reach Python, so Python cannot count
them. HAProxy counts them itself, in C, in a stick table keyed on the method path
(``runtimeproxy.dataplane.haproxy`` generates it): ``http_req_cnt`` is the number of calls,
``gpc0`` the number the backend answered, ``gpc1`` .. ``gpc16`` the trailers-only errors
by ``grpc-status`` code (containerd, like every grpc-go server, sends an error that
comes before any reply message as trailers-only), ``conn_cur`` the calls in flight. A
call HAProxy answered itself because the backend was unreachable (HTTP 503: the client
sees UNAVAILABLE) is one that was neither answered nor is in flight:
``http_req_cnt - gpc0 - conn_cur``. That difference never over-counts (a call answered
but not yet finished lowers it for a moment); the exported value is the highest seen.

The keys are bounded: only method names of our protos, ``<service>/*`` for any other
method of the two CRI services, ``*`` for any other path (answered UNIMPLEMENTED by
HAProxy, as the gRPC transport counts it). The lifecycle methods are not tracked: Python
serves them and counts them (path="intercepted").

Nothing is done per call in Python: ``collect`` reads ``show table`` over HAProxy's
private stats socket (a few KB, well under a millisecond). HAProxy's table starts empty
when HAProxy is restarted or reloaded; the counters here stay monotonic (a drop is a
reset: what was counted before is kept as a base).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Final

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = structlog.get_logger("runtimeproxy.haproxystats")

#: The stick table's name (a backend section in the generated configuration).
TABLE: Final = "cri_calls"
#: The not-CRI key: every call under it was answered UNIMPLEMENTED by HAProxy.
NOT_CRI_KEY: Final = "*"
#: gRPC status codes by number (1..16; 0 is OK and not an error).
CODE_NAMES: Final = {c.value[0]: c.name for c in grpc.StatusCode if c.value[0] != 0}
_ENTRY: Final = re.compile(r"^0x[0-9a-f]+: key=(\S+) (.*)$")
_TIMEOUT: Final = 0.5


def command(stats_socket: Path, line: str) -> str:
    """One command over HAProxy's runtime API (the stats socket); its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT)
        sock.connect(str(stats_socket))
        sock.sendall(f"{line}\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def read_table(stats_socket: Path, table: str = TABLE) -> dict[str, dict[str, int]]:
    """``show table <table>`` over HAProxy's runtime API: key -> {field: value}."""
    return parse_table(command(stats_socket, f"show table {table}"))


def parse_table(text: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        m = _ENTRY.match(line)
        if m is None:
            continue
        fields: dict[str, int] = {}
        for item in m.group(2).split():
            name, _, value = item.partition("=")
            if value.isdigit():
                fields[name] = int(value)
        out[m.group(1)] = fields
    return out


def _add(family: Metric, labels: dict[str, str], value: int) -> None:
    """Add HAProxy's count to the family: to Python's sample of the same labels if there is
    one (the gRPC handler creates its children up front; one series per label set)."""
    name = family.name + "_total"
    for i, sample in enumerate(family.samples):
        if sample.name == name and sample.labels == labels:
            family.samples[i] = sample._replace(value=sample.value + value)
            return
    family.add_sample(name, labels, value)


class DataPlaneCounters(Collector):
    """``cri_calls`` and ``cri_errors`` as one family each: Python's samples (intercepted
    calls) plus HAProxy's (pass-through), read at scrape time."""

    def __init__(self, calls: Counter, errors: Counter, read: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._calls, self._errors, self._read = calls, errors, read
        self._seen: dict[tuple[str, str], int] = {}
        self._base: dict[tuple[str, str], int] = {}
        self._failed = False
        #: The table ``refresh`` read (off the loop) for the next ``collect``; None: read there.
        self._fresh: dict[str, dict[str, int]] | None = None

    def refresh(self) -> None:
        """Read HAProxy's table now (blocking: the stats socket), for the next collect."""
        self._fresh = self._snapshot()

    def _reset(self, key: str) -> None:
        """The table started again from 0 (HAProxy restarted or reloaded): what was counted
        so far becomes the base of every series of ``key``."""
        for series, last in self._seen.items():
            if series[0] == key:
                self._base[series] = self._base.get(series, 0) + last
                self._seen[series] = 0

    def _counter(self, series: tuple[str, str], raw: int) -> int:
        # Never lower (UNAVAILABLE is partly a difference that may dip while calls finish).
        self._seen[series] = max(raw, self._seen.get(series, 0))
        return self._base.get(series, 0) + self._seen[series]

    def _snapshot(self) -> dict[str, dict[str, int]]:
        try:
            table = self._read()
        except OSError as exc:
            if not self._failed:
                log.warning("data_plane_stats_unreadable", error=str(exc))
            self._failed = True
            return {}
        self._failed = False
        return table

    def describe(self) -> Iterable[Metric]:
        return [*self._calls.describe(), *self._errors.describe()]

    def collect(self) -> Iterator[Metric]:
        [calls] = self._calls.collect()
        [errors] = self._errors.collect()
        table, self._fresh = (self._fresh, None) if self._fresh is not None else (self._snapshot(), None)
        for key in sorted(set(table) | {k for k, _ in self._seen}):
            fields = table.get(key, {})
            first = (key, "UNIMPLEMENTED") if key == NOT_CRI_KEY else (key, "calls")
            if fields.get("http_req_cnt", 0) < self._seen.get(first, 0):
                self._reset(key)
            if key == NOT_CRI_KEY:
                count = self._counter((key, "UNIMPLEMENTED"), fields.get("http_req_cnt", 0))
                _add(errors, {"method": key, "code": "UNIMPLEMENTED"}, count)
                continue
            count = self._counter((key, "calls"), fields.get("http_req_cnt", 0))
            _add(calls, {"method": key, "path": "passthrough"}, count)
            generated = fields.get("http_req_cnt", 0) - fields.get("gpc0", 0) - fields.get("conn_cur", 0)
            by_code = {name: fields.get(f"gpc{number}", 0) for number, name in CODE_NAMES.items()}
            by_code["UNAVAILABLE"] += max(generated, 0)
            for code, raw in by_code.items():
                if raw or (key, code) in self._seen:
                    _add(errors, {"method": key, "code": code}, self._counter((key, code), raw))
        yield calls
        yield errors


def install(registry: CollectorRegistry, calls: Counter, errors: Counter, stats_socket: Path) -> DataPlaneCounters:
    """Replace the registered ``calls``/``errors`` counters by one collector that exports
    them together with HAProxy's counters (one family per name: no duplicate)."""
    registry.unregister(calls)
    registry.unregister(errors)
    collector = DataPlaneCounters(calls, errors, lambda: read_table(stats_socket))
    registry.register(collector)
    return collector
