"""``koord-runtime-proxy top``: CPU and memory of the node and its pods, from the store.

It reads the metrics store file read-only, so it works while the proxy runs and after
it stopped. The window ends at the newest node/pod sample in the file, not at the wall
clock: after a stop it shows the last minute the proxy saw, and the header says how
old that is. Pod CPU is the average of ``POD_CPU_USAGE`` over the window; pod memory
is the last ``POD_MEMORY_USED`` in it. Namespaces, names and QoS come from the
``KV_POD_META`` record (``PodMetaRecord`` below). A pod that has samples but no record
is shown by uid.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypedDict

from metrics import model as m
from metrics.store.tsdb import TSDB, TSDBError

DEFAULT_DB: Final = Path("/var/lib/koord-runtime-proxy/metrics.db")
_MIB: Final = 2**20
_UNKNOWN: Final = "-"


class PodMeta(TypedDict):
    """One pod in the ``KV_POD_META`` record."""

    namespace: str
    name: str
    #: Koordinator QoS class value (``QoSClass.value``): LSE, LSR, LS, BE, SYSTEM or "".
    qos: str
    #: Kubernetes priority value.
    priority: int


#: The ``KV_POD_META`` record: pod uid -> PodMeta. The agent replaces it whole when its
#: pod set changes (``put_kv(KV_POD_META, pod_meta_record(pods))``).
PodMetaRecord = dict[str, PodMeta]


def pod_meta_record(pods: Iterable[m.PodView]) -> PodMetaRecord:
    """The ``KV_POD_META`` record for the agent's current pods."""
    return {
        p.uid: PodMeta(namespace=p.namespace, name=p.name, qos=p.qos.value, priority=p.priority)
        for p in pods
    }


@dataclass(frozen=True, slots=True)
class NodeUsage:
    cpu_used: float | None
    cpu_capacity: float | None
    memory_used: float | None
    memory_total: float | None


@dataclass(frozen=True, slots=True)
class PodUsage:
    uid: str
    namespace: str
    name: str
    qos: str
    cpu: float | None
    memory: float | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    end: float
    window: float
    node: NodeUsage
    pods: tuple[PodUsage, ...]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``top`` to the CLI (entry point group ``koord_runtime_proxy.commands``)."""
    p = subparsers.add_parser("top", help="CPU and memory of the node and its pods, from the metrics store")
    p.add_argument("--db", type=Path, default=DEFAULT_DB, help=f"metrics store (default {DEFAULT_DB})")
    p.add_argument("--window", type=_positive_float, default=60.0, help="seconds averaged (default 60)")
    p.add_argument("--sort", choices=("cpu", "memory"), default="cpu", help="column sorted on, descending")
    p.add_argument("--namespace", default=None, help="only pods of this namespace")
    p.add_argument("-n", dest="limit", type=_positive_int, default=None, help="show at most N pods")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    db_path: Path = args.db
    if not db_path.is_file():
        print(f"koord-runtime-proxy top: no metrics store at {db_path} "
              "(is the proxy's metrics store enabled? see --db)", file=sys.stderr)
        return 1
    try:
        with TSDB.open_readonly(db_path) as db:
            snap = snapshot(db, args.window)
    except TSDBError as exc:
        print(f"koord-runtime-proxy top: {exc}", file=sys.stderr)
        return 1
    pods = select(snap.pods, sort=args.sort, namespace=args.namespace, limit=args.limit)
    print("\n".join(render(snap, pods, now=time.time())))
    return 0


def snapshot(db: TSDB, window: float) -> Snapshot:
    """Node and pod usage over the ``window`` seconds before the newest sample."""
    newest = [ts for metric in (m.NODE_CPU_USAGE, m.POD_CPU_USAGE, m.POD_MEMORY_USED)
              if (ts := db.latest_ts(metric)) is not None]
    end = max(newest) if newest else time.time()
    start = end - window
    return Snapshot(end, window, node_usage(db, start, end), pod_usage(db, start, end, pod_meta(db)))


def node_usage(db: TSDB, start: float, end: float) -> NodeUsage:
    def agg(metric: str, how: str) -> float | None:
        a = db.aggregate(metric, m.NO_LABELS, start, end)
        return None if a is None else a.value(how)

    return NodeUsage(
        cpu_used=agg(m.NODE_CPU_USAGE, "avg"),
        cpu_capacity=agg(m.NODE_CPU_CAPACITY, "last"),
        memory_used=agg(m.NODE_MEMORY_USED, "last"),
        memory_total=agg(m.NODE_MEMORY_TOTAL, "last"),
    )


def pod_meta(db: TSDB) -> PodMetaRecord:
    """The ``KV_POD_META`` record; entries of the wrong shape are left out (shown by uid)."""
    raw = db.get_kv(m.KV_POD_META)
    if not isinstance(raw, dict):
        return {}
    out: PodMetaRecord = {}
    for uid, entry in raw.items():
        if isinstance(entry, dict) and isinstance(entry.get("namespace"), str) and isinstance(entry.get("name"), str):
            qos = entry.get("qos")
            priority = entry.get("priority")
            out[str(uid)] = PodMeta(
                namespace=entry["namespace"], name=entry["name"],
                qos=qos if isinstance(qos, str) else "",
                priority=priority if isinstance(priority, int) else 0,
            )
    return out


def _pod_uid(labels: m.Labels) -> str | None:
    return dict(labels).get(m.POD_UID)


def pod_usage(db: TSDB, start: float, end: float, meta: Mapping[str, PodMeta]) -> tuple[PodUsage, ...]:
    cpu_all = {uid: a for lb, a in db.aggregate_all(m.POD_CPU_USAGE, start, end).items()
               if (uid := _pod_uid(lb)) is not None}
    memory_all = {uid: a for lb, a in db.aggregate_all(m.POD_MEMORY_USED, start, end).items()
                  if (uid := _pod_uid(lb)) is not None}
    cpu = {uid: a.avg for uid, a in cpu_all.items()}
    memory = {uid: a.last for uid, a in memory_all.items()}
    # The agent's record names the pods running now. A pod missing from it that was not
    # sampled in the newest tick either has gone since: not listed (its samples stay in
    # the store). One missing from the record but in the newest tick is new: by uid.
    newest = max((a.last_ts for a in (*cpu_all.values(), *memory_all.values())), default=0.0)
    gone = {uid for uid in cpu.keys() | memory.keys() if uid not in meta
            and max(a.last_ts for a in (cpu_all.get(uid), memory_all.get(uid)) if a is not None) < newest}
    rows: list[PodUsage] = []
    for uid in (cpu.keys() | memory.keys()) - gone:
        info = meta.get(uid)
        rows.append(PodUsage(
            uid=uid,
            namespace=info["namespace"] if info else _UNKNOWN,
            name=info["name"] if info else uid,
            qos=(info["qos"] or _UNKNOWN) if info else _UNKNOWN,
            cpu=cpu.get(uid),
            memory=memory.get(uid),
        ))
    return tuple(rows)


def select(pods: tuple[PodUsage, ...], *, sort: str, namespace: str | None, limit: int | None) -> list[PodUsage]:
    """Filter by namespace, sort descending on ``cpu`` or ``memory`` (pods without a
    value last, ties by namespace/name), keep the first ``limit``."""
    chosen = [p for p in pods if namespace is None or p.namespace == namespace]

    def key(p: PodUsage) -> tuple[bool, float, str, str]:
        value = p.cpu if sort == "cpu" else p.memory
        return (value is None, -(value or 0.0), p.namespace, p.name)

    chosen.sort(key=key)
    return chosen[:limit] if limit is not None else chosen


def _fmt(value: float | None, scale: float, digits: int) -> str:
    return _UNKNOWN if value is None else f"{value / scale:.{digits}f}"


def _percent(used: float | None, total: float | None) -> str:
    return _UNKNOWN if used is None or not total else f"{100 * used / total:.1f}%"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def render(snap: Snapshot, pods: list[PodUsage], *, now: float) -> list[str]:
    """The header, the node line, then the pod table (one string per line)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap.end))
    age = _age(max(now - snap.end, 0.0))
    n = snap.node
    lines = [
        f"as of {stamp} ({age} ago), window {snap.window:g}s",
        f"NODE  cpu {_fmt(n.cpu_used, 1, 2)}/{_fmt(n.cpu_capacity, 1, 2)} cores"
        f" ({_percent(n.cpu_used, n.cpu_capacity)})"
        f"  memory {_fmt(n.memory_used, _MIB, 0)}/{_fmt(n.memory_total, _MIB, 0)} MiB"
        f" ({_percent(n.memory_used, n.memory_total)})",
        "",
    ]
    table = [("NAMESPACE", "NAME", "QOS", "CPU(cores)", "MEMORY(MiB)")]
    table += [(p.namespace, p.name, p.qos, _fmt(p.cpu, 1, 3), _fmt(p.memory, _MIB, 1)) for p in pods]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        left = "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths[:3], strict=True))
        right = "  ".join(cell.rjust(w) for cell, w in zip(row[3:], widths[3:], strict=True))
        lines.append(f"{left}  {right}")
    if not pods:
        lines.append("(no pods with samples in the window)")
    return lines
