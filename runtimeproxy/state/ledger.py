"""What the store knew, kept on disk, and which Post stages after a stop or a removal ran.

Stop and removal are level-triggered (``runtimeproxy.lifecycle.owed``): after every
re-sync with containerd, an object this ledger knows that containerd lists as stopped
(a container EXITED, a sandbox NOTREADY) owes its PostStop stage, and one containerd no
longer lists owes PostStop (if not done) and PostRemove. To find what happened while
the process was down, the ledger survives it: one JSON file
(``<state_dir>/objects.json``, mode 0600, written atomically: a temporary file, fsync,
rename) holding every known pod and container with the context its Post stages need
(a removed object cannot be asked about) and its *done* marks.

Exactly once per object and transition: a transition is *claimed* in memory when its
Post stage is queued (so a re-sync that runs meanwhile, or an intercepted call's own
Post stage, does not queue it again) and marked *done* once it ran (if some of its hooks
failed or timed out, it is released instead and owed again, for those hooks, at the next
re-sync: up to ``ATTEMPTS`` runs); the file is
rewritten shortly after (coalesced, ``SAVE_DELAY``). A crash before the stage ran leaves
no done mark: the next start runs it. A crash in the short window between the stage
and the rewrite runs it once more at the next start (hooks' Post stages are idempotent:
removing a group that is gone is a no-op); a graceful stop saves.

An object first seen already stopped (created behind the proxy's back, or known before
this ledger existed) owes nothing for that stop: only transitions the ledger saw happen
are owed. Entries are dropped once their removal is done. Bounded: at most
``max_objects`` entries; beyond, new objects are not tracked (one warning a minute) and
only the host sweep (``sweep_orphans``) cleans up after them. A missing file starts
empty; an unreadable one starts empty with one warning; a state dir that cannot be
written keeps the ledger in memory with one warning. Never a crash.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal

import structlog

from runtimeproxy.errors import StoreError
from runtimeproxy.hookapi import ContainerInfo, ContainerMeta, PodInfo, PodMeta, Resources, frozen_map
from runtimeproxy.ops.logsetup import Throttle

log = structlog.get_logger("runtimeproxy.ledger")

FILE_NAME: Final = "objects.json"
FORMAT_VERSION: Final = 1
#: Default bound on tracked objects (pods + containers): ~1 KiB each on disk.
MAX_OBJECTS: Final = 20000
#: Removed ids remembered after their entry went (a late call about them).
GONE_KEPT: Final = 4096
#: Done marks within this long share one rewrite.
SAVE_DELAY: Final = 0.05
#: Runs of an owed Post stage whose hooks failed or timed out before it is given up (marked done).
ATTEMPTS: Final = 5

Transition = Literal["stop", "remove"]
TRANSITIONS: Final[tuple[Transition, ...]] = ("stop", "remove")


@dataclass(slots=True)
class Entry:
    """One known object. ``pod_id``: the sandbox it belongs to (a pod's own id for a pod)."""

    kind: Literal["pod", "container"]
    pod_id: str
    info: PodInfo | ContainerInfo
    done: set[str] = field(default_factory=set)
    #: ``info`` as JSON, encoded once when it changes (a save only joins these).
    info_json: str = ""

    def __post_init__(self) -> None:
        if not self.info_json:
            self.info_json = json.dumps(encode_info(self.info), separators=(",", ":"))

    def encoded(self, object_id: str) -> str:
        return (f'{json.dumps(object_id)}:{{"kind":"{self.kind}","pod_id":{json.dumps(self.pod_id)},'
                f'"done":{json.dumps(sorted(self.done))},"info":{self.info_json}}}')


class LedgerError(StoreError, ValueError):
    """A file entry that is not what this module writes; the message names the field."""


def _resources(data: object, where: str) -> Resources:
    if not isinstance(data, dict):
        raise LedgerError(f"{where}: not an object")
    values: dict[str, Any] = {}
    for f in fields(Resources):
        value = data.get(f.name)
        if f.name == "unified":
            values[f.name] = frozen_map(_str_map(value, f"{where}.unified"))
        elif isinstance(value, int) and not isinstance(value, bool):
            values[f.name] = value
        elif isinstance(value, str) and f.name.startswith("cpuset"):
            values[f.name] = value
        else:
            raise LedgerError(f"{where}.{f.name}: unexpected value {value!r:.60}")
    return Resources(**values)


def _str_map(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise LedgerError(f"{where}: not a map of strings")
    return value


def _str(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise LedgerError(f"{where}.{key}: not a string: {value!r:.60}")
    return value


def _int(data: Mapping[str, Any], key: str, where: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise LedgerError(f"{where}.{key}: not an integer: {value!r:.60}")
    return value


def _encode_resources(res: Resources) -> dict[str, Any]:
    return {f.name: dict(res.unified) if f.name == "unified" else getattr(res, f.name) for f in fields(Resources)}


def encode_info(info: PodInfo | ContainerInfo) -> dict[str, Any]:
    common = {"id": info.id, "labels": dict(info.labels), "annotations": dict(info.annotations),
              "resources": _encode_resources(info.resources)}
    if isinstance(info, PodInfo):
        meta = info.meta
        return {**common, "name": meta.name, "namespace": meta.namespace, "uid": meta.uid, "attempt": meta.attempt,
                "runtime_handler": info.runtime_handler, "cgroup_parent": info.cgroup_parent,
                "overhead": _encode_resources(info.overhead)}
    return {**common, "name": info.meta.name, "attempt": info.meta.attempt, "envs": dict(info.envs),
            "image": info.image}


def decode_pod(data: Mapping[str, Any], where: str) -> PodInfo:
    return PodInfo(
        meta=PodMeta(_str(data, "name", where), _str(data, "namespace", where), _str(data, "uid", where),
                     _int(data, "attempt", where)),
        id=_str(data, "id", where),
        labels=frozen_map(_str_map(data.get("labels"), f"{where}.labels")),
        annotations=frozen_map(_str_map(data.get("annotations"), f"{where}.annotations")),
        runtime_handler=_str(data, "runtime_handler", where),
        cgroup_parent=_str(data, "cgroup_parent", where),
        resources=_resources(data.get("resources"), f"{where}.resources"),
        overhead=_resources(data.get("overhead"), f"{where}.overhead"),
    )


def decode_container(data: Mapping[str, Any], where: str) -> ContainerInfo:
    return ContainerInfo(
        meta=ContainerMeta(_str(data, "name", where), _int(data, "attempt", where)),
        id=_str(data, "id", where),
        labels=frozen_map(_str_map(data.get("labels"), f"{where}.labels")),
        annotations=frozen_map(_str_map(data.get("annotations"), f"{where}.annotations")),
        resources=_resources(data.get("resources"), f"{where}.resources"),
        envs=frozen_map(_str_map(data.get("envs"), f"{where}.envs")),
        image=_str(data, "image", where),
    )


def _decode_entry(object_id: str, raw: object) -> Entry:
    where = f"objects[{object_id[:80]!r}]"
    if not isinstance(raw, dict):
        raise LedgerError(f"{where}: not an object")
    kind = raw.get("kind")
    done = raw.get("done")
    if not isinstance(done, list) or not all(d in TRANSITIONS for d in done):
        raise LedgerError(f"{where}.done: not a list of {list(TRANSITIONS)}: {done!r:.60}")
    info_raw = raw.get("info")
    if not isinstance(info_raw, dict):
        raise LedgerError(f"{where}.info: not an object")
    info: PodInfo | ContainerInfo
    if kind == "pod":
        info = decode_pod(info_raw, f"{where}.info")
    elif kind == "container":
        info = decode_container(info_raw, f"{where}.info")
    else:
        raise LedgerError(f"{where}.kind: not pod or container: {kind!r:.40}")
    if info.id != object_id:
        raise LedgerError(f"{where}.info.id: {info.id!r:.80} is not the entry's id")
    return Entry(kind, _str(raw, "pod_id", where), info, set(done))


class ObjectLedger:
    """Single-writer (the event loop). ``path`` None: in memory only (no state_dir)."""

    def __init__(self, path: Path | None, *, max_objects: int = MAX_OBJECTS) -> None:
        self.path = path
        self._max = max_objects
        self._entries: dict[str, Entry] = {}
        self._claimed: set[tuple[str, str]] = set()
        #: (id, transition) -> (the hooks that failed or timed out last time, runs so far):
        #: owed again at the next re-sync, for those hooks only. In memory: a restart runs
        #: the whole stage again (as after a crash; Post hooks are idempotent).
        self._retry: dict[tuple[str, str], tuple[frozenset[str], int]] = {}
        #: Pod id -> its containers with an entry (a pod's entry goes after theirs).
        self._containers: collections.Counter[str] = collections.Counter()
        #: Ids whose removal was done lately: a late call's Post stage for them is not run again.
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._save_handle: asyncio.TimerHandle | None = None
        self._throttle = Throttle(60.0)
        self._write_failed = False
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: asyncio.Future[None] | None = None
        #: Rewrites of the file so far (a test and a log line read it).
        self.saves = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, object_id: str) -> bool:
        return object_id in self._entries

    def get(self, object_id: str) -> Entry | None:
        return self._entries.get(object_id)

    def entries(self) -> Iterator[tuple[str, Entry]]:
        return iter(list(self._entries.items()))

    # --- learning -------------------------------------------------------------------

    def learn(self, kind: Literal["pod", "container"], pod_id: str, info: PodInfo | ContainerInfo,
              *, stopped: bool) -> None:
        """An object the store now holds. Known already: its context is refreshed, its
        marks kept. New and already ``stopped``: that stop is not owed (not seen happen)."""
        entry = self._entries.get(info.id)
        if entry is not None:
            if entry.info != info:
                entry.info, entry.info_json = info, ""
                entry.__post_init__()
                self.save_soon()
            if pod_id and pod_id != entry.pod_id:
                self._forget(info.id, entry)
                entry.pod_id = pod_id
                self._add(info.id, entry)
            return
        if len(self._entries) >= self._max:
            held = self._throttle.allow("full")
            if held is not None:
                log.warning("ledger_full", max_objects=self._max, object_id=info.id, repeats_suppressed=held,
                            effect="its Post stages after a stop or removal are not owed; the host sweep still "
                                   "removes what it leaves")
            return
        self._add(info.id, Entry(kind, pod_id, info, {"stop"} if stopped else set()))
        self.save_soon()

    # --- claims and done marks --------------------------------------------------------

    def tracks(self, object_id: str) -> bool:
        """Known now, or its removal was done lately: its Post stages after a stop or a
        removal are this ledger's to run once (an unknown object's are not)."""
        return object_id in self._entries or object_id in self._gone

    def owes(self, object_id: str, transition: Transition) -> bool:
        """Known, and this transition neither done nor queued."""
        entry = self._entries.get(object_id)
        return (entry is not None and transition not in entry.done
                and (object_id, transition) not in self._claimed)

    def claim(self, object_id: str, transition: Transition) -> bool:
        """Queue it once: False if it is not owed (unknown, done or queued already)."""
        if not self.owes(object_id, transition):
            return False
        self._claimed.add((object_id, transition))
        return True

    def retry_hooks(self, object_id: str, transition: Transition) -> frozenset[str] | None:
        """The hooks still owed after a run in which they failed or timed out (None: all)."""
        retry = self._retry.get((object_id, transition))
        return None if retry is None else retry[0]

    def ran(self, object_id: str, transition: Transition, failed: frozenset[str] = frozenset()) -> None:
        """Its Post stage ran. Hooks that ``failed`` (or timed out) make it owed again, for
        them only, at the next re-sync (level-triggered: found again, not lost), up to
        ``ATTEMPTS`` runs; then it is given up (one warning) and marked done."""
        key = (object_id, transition)
        if not failed or object_id not in self._entries:
            self.done(object_id, transition)
            return
        attempts = self._retry.get(key, (failed, 0))[1] + 1
        if attempts >= ATTEMPTS:
            log.warning("owed_post_stage_given_up", object_id=object_id, transition=transition,
                        hooks=sorted(failed), attempts=attempts, effect="marked done; the host sweep may "
                        "still remove what it left")
            self.done(object_id, transition)
            return
        self._claimed.discard(key)
        self._retry[key] = (failed, attempts)
        log.debug("owed_post_stage_failed", object_id=object_id, transition=transition, hooks=sorted(failed),
                 attempt=attempts, effect="owed again at the next re-sync, for these hooks")

    def done(self, object_id: str, transition: Transition) -> None:
        """Its Post stage ran: marked, and saved shortly after. A removed object's entry
        goes (a pod's once none of its containers' entries needs its context)."""
        self._claimed.discard((object_id, transition))
        self._retry.pop((object_id, transition), None)
        entry = self._entries.get(object_id)
        if entry is None:
            return
        entry.done.add(transition)
        self._collect(object_id, entry)
        self.save_soon()

    def _collect(self, object_id: str, entry: Entry) -> None:
        if ("remove" not in entry.done or (object_id, "stop") in self._retry
                or (entry.kind == "pod" and self.has_containers(object_id))):
            return  # its context is still needed: a stop to run again, a container's stages
        self._forget(object_id, entry)
        self._claimed.difference_update({(object_id, t) for t in TRANSITIONS})
        for t in TRANSITIONS:
            self._retry.pop((object_id, t), None)
        self._gone[object_id] = None
        while len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)
        pod = self._entries.get(entry.pod_id) if entry.kind == "container" else None
        if pod is not None and "remove" in pod.done:
            self._collect(entry.pod_id, pod)

    def has_containers(self, pod_id: str) -> bool:
        return self._containers[pod_id] > 0  # counted: a scan per removal is quadratic in a burst

    def _add(self, object_id: str, entry: Entry) -> None:
        self._entries[object_id] = entry
        if entry.kind == "container":
            self._containers[entry.pod_id] += 1

    def _forget(self, object_id: str, entry: Entry) -> None:
        del self._entries[object_id]
        if entry.kind == "container":
            self._containers[entry.pod_id] -= 1
            if self._containers[entry.pod_id] <= 0:
                del self._containers[entry.pod_id]

    # --- the file ---------------------------------------------------------------------

    def load(self) -> int:
        """Read the file (at start, before the store's rebuild); returns entries loaded."""
        if self.path is None:
            return 0
        try:
            raw = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("ledger_unreadable", path=str(self.path), error=str(exc)[:200],
                        effect="started empty: Post stages owed from before this start are not run")
            return 0
        objects = raw.get("objects") if isinstance(raw, dict) and raw.get("version") == FORMAT_VERSION else None
        if not isinstance(objects, dict):
            log.warning("ledger_unreadable", path=str(self.path), error=f"not a version {FORMAT_VERSION} ledger",
                        effect="started empty")
            return 0
        bad: list[str] = []
        for object_id, value in list(objects.items())[: self._max]:
            try:
                self._add(object_id, _decode_entry(object_id, value))
            except LedgerError as exc:
                bad.append(str(exc))
        if bad:
            log.warning("ledger_entries_skipped", path=str(self.path), count=len(bad), first=bad[0][:200])
        return len(self._entries)

    def save_soon(self) -> None:
        """Rewrite the file within ``SAVE_DELAY`` (changes meanwhile share the write). The
        document is assembled on the loop (entries are encoded when they change: a join);
        the write and its fsync happen on this ledger's own writer thread, in order."""
        if self.path is None or self._save_handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.save()
            return
        self._save_handle = loop.call_later(SAVE_DELAY, self._flush, loop)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._save_handle = None
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ledger-writer")
        self._pending = loop.run_in_executor(self._writer, self._write, self._document())

    def save(self) -> None:
        """Write the whole ledger now (a stop; no loop): after any write in flight."""
        if self._save_handle is not None:
            self._save_handle.cancel()
            self._save_handle = None
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self.path is not None:
            self._write(self._document())

    def _document(self) -> bytes:
        objects = ",".join(e.encoded(object_id) for object_id, e in self._entries.items())
        return f'{{"version":{FORMAT_VERSION},"objects":{{{objects}}}}}'.encode()

    def _write(self, data: bytes) -> None:
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                os.fchmod(fd, 0o600)  # an old temporary file of another mode
                out.write(data)
                out.flush()
                os.fsync(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            if not self._write_failed:
                self._write_failed = True
                log.warning("ledger_write_failed", path=str(self.path), error=exc.strerror or str(exc),
                            effect="kept in memory: a restart may run Post stages again or miss owed ones")
            return
        self._write_failed = False
        self.saves += 1
