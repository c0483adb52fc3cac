"""Memory probe for ``bench_soak.py --probe`` (bench only; never shipped).

Python imports ``sitecustomize`` at start-up when it is on ``PYTHONPATH``; the soak puts
this directory there for the proxy it starts, with ``KRP_SOAK_PROBE=<file>``. A daemon
thread then appends one JSON line to that file every ``KRP_SOAK_PROBE_EVERY`` seconds
(default 10) telling where the process's memory is:

- ``rss``: VmRSS; ``anon``: RssAnon (the heap; the rest is mapped files);
- ``heap_used`` / ``heap_free``: glibc's ``mallinfo2``: bytes in use (arenas + mmapped
  blocks) and bytes free inside the arenas (kept mapped unless trimmed);
- ``sqlite``: ``sqlite3_memory_used()`` (page caches, schema, statements of every
  connection), ``sqlite_hi`` its high-water mark;
- ``py_blocks``: ``sys.getallocatedblocks()`` (live Python objects' allocations);
- ``big`` (once a minute): every gc-tracked Python container (made after the
  proxy's ``gc.freeze()``; a dict of atoms only is untracked, so missed) holding
  more than 128 KiB by itself: type, bytes, length and one key or item, to name it;
- the metric store's in-memory indexes (the ``TSDB`` made after start-up, hooked at import):
  ``keys`` (label sets -> series key), ``key_labels``, ``latest``, ``ids``, and
  ``readers`` (open read connections).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "Threads"):
            out[key] = int(rest.split()[0]) * (1024 if key != "Threads" else 1)
    return out


#: Stores made since the probe hooked ``TSDB.__init__`` (the proxy calls ``gc.freeze()``
#: at start, which hides older objects from ``gc.get_objects()``).
_STORES: weakref.WeakSet[Any] = weakref.WeakSet()


def _hook_tsdb(deadline: float) -> None:
    """Wrap ``TSDB.__init__`` as soon as the module is imported (polled every 5 ms)."""
    while time.monotonic() < deadline:
        mod = sys.modules.get("metrics.store.tsdb")
        cls = getattr(mod, "TSDB", None)
        if cls is not None:
            init = cls.__init__

            def hooked(self: object, *args: object, init: Any = init, **kwargs: object) -> None:
                init(self, *args, **kwargs)
                _STORES.add(self)

            cls.__init__ = hooked
            return
        time.sleep(0.005)


def _tsdb() -> Any:
    for obj in list(_STORES):
        if not obj.readonly and not obj._closed:
            return obj
    return None


def _big(limit: int = 128 << 10) -> list[list[object]]:
    out: list[list[object]] = []
    for obj in gc.get_objects():
        try:
            size = sys.getsizeof(obj)
        except TypeError:
            continue
        if size > limit:
            sample = next(iter(obj), None) if isinstance(obj, dict | set | frozenset | list | tuple) else None
            out.append([type(obj).__name__, size, len(obj) if hasattr(obj, "__len__") else -1, repr(sample)[:80]])
    return sorted(out, key=lambda row: -int(row[1]))  # type: ignore[call-overload]


def _run(path: Path, every: float) -> None:
    libc = ctypes.CDLL(None)
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
    sqlite = None
    import sqlite3  # noqa: F401  (loads libsqlite3 into the process: the same copy the store uses)

    name = ctypes.util.find_library("sqlite3")
    if name:
        sqlite = ctypes.CDLL(name)
        sqlite.sqlite3_memory_used.restype = ctypes.c_int64
        sqlite.sqlite3_memory_highwater.restype = ctypes.c_int64
    started = time.monotonic()
    _hook_tsdb(started + 60)
    big_at = 0.0
    while True:
        time.sleep(every)
        row: dict[str, object] = {"t": round(time.monotonic() - started, 1)}
        st = _status()
        row |= {"rss": st.get("VmRSS"), "anon": st.get("RssAnon"), "threads": st.get("Threads")}
        if mallinfo2 is not None:
            mi = mallinfo2()
            row |= {"heap_used": mi.uordblks + mi.hblkhd, "heap_free": mi.fordblks, "heap_arena": mi.arena}
        if sqlite is not None:
            row |= {"sqlite": sqlite.sqlite3_memory_used(), "sqlite_hi": sqlite.sqlite3_memory_highwater(0)}
        row["py_blocks"] = sys.getallocatedblocks()
        if time.monotonic() - started >= big_at:
            big_at += 60
            row["big"] = _big()
        db = _tsdb()
        if db is not None:
            row |= {"keys": sum(len(v) for v in db._keys.values()), "key_labels": len(db._key_labels),
                    "latest": len(db._latest), "ids": len(db._ids),
                    "readers": len(db._readers._open)}
        with path.open("a") as out:
            out.write(json.dumps(row) + "\n")


if os.environ.get("KRP_SOAK_PROBE"):
    threading.Thread(target=_run, name="soakprobe", daemon=True,
                     args=(Path(os.environ["KRP_SOAK_PROBE"]), float(os.environ.get("KRP_SOAK_PROBE_EVERY", "10")))
                     ).start()
