"""The change history on disk, so ``explain`` still shows a pod's changes after a restart.

One JSON-lines file (``<state_dir>/changes.jsonl``): a line per recorded change
(``{"uid": ..., "change": {...}}``) or per pod forgotten (``{"uid": ..., "forget": true}``).
Bounded: ``per_pod`` changes for at most ``max_pods`` pods (least recently changed
dropped first), and the file is rewritten from that bounded view whenever it has
grown to twice it. All writing happens on one daemon thread fed by a queue, so the
event loop only enqueues. A missing file starts empty; an unreadable or corrupt one
starts with what could be read and one warning. A write that fails (a full disk, a
state dir that cannot be written) keeps the history in memory with one warning
(``change_history_not_saved``); the writer keeps the bounded view up to date and
rewrites the whole file once it can again (tried at the next change after a back-off
of ``retry_after`` seconds, doubling up to ``RETRY_MAX``; one ``change_history_saved``
line then), like the metrics store's degraded mode. Never a crash.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Final

import structlog

from runtimeproxy.chain.hookchain import Change

log = structlog.get_logger("runtimeproxy.history")

FILE_NAME: Final = "changes.jsonl"
#: Longest value kept per field: the file stays bounded whatever a hook reports.
FIELD_CAP: Final = 4096
_FIELDS: Final = tuple(f.name for f in fields(Change))
_STOP: Final = object()
#: Longest wait between two attempts to write the file again while it cannot be written.
RETRY_MAX: Final = 60.0

_Log = collections.OrderedDict[str, collections.deque[Change]]


def _encode(uid: str, change: Change) -> str:
    # Not dataclasses.asdict: it deep-copies every value (~7x slower) and a Change holds strings.
    data = {k: str(getattr(change, k))[:FIELD_CAP] for k in _FIELDS}
    return json.dumps({"uid": uid, "change": data}, separators=(",", ":")) + "\n"


def _decode(line: str) -> tuple[str, Change | None]:
    """(uid, change) or (uid, None) for a forget line; ValueError for anything else."""
    rec = json.loads(line)
    if not isinstance(rec, dict) or not isinstance(rec.get("uid"), str) or not rec["uid"]:
        raise ValueError("no uid")
    if rec.get("forget") is True:
        return rec["uid"], None
    data = rec.get("change")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in _FIELDS):
        raise ValueError("bad change")
    return rec["uid"], Change(**{k: data[k] for k in _FIELDS})


class ChangeHistory:
    def __init__(self, state_dir: Path, *, per_pod: int, max_pods: int, retry_after: float = 1.0) -> None:
        self.path = state_dir / FILE_NAME
        self._per_pod = per_pod
        self._max_pods = max_pods
        self._retry_after = retry_after
        self._view: _Log = collections.OrderedDict()  # the writer thread's copy of what is kept
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._file: Any = None
        self._lines = 0
        self._not_saved: str | None = None  # set and cleared by the writer thread

    # --- the event loop's side -------------------------------------------------------

    def load(self) -> dict[str, list[Change]]:
        """Read the file (once, at start) and start the writer; what was kept, per pod uid."""
        bad = 0
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            log.warning("change_history_unreadable", path=str(self.path), error=str(exc), kept="nothing")
            text = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                uid, change = _decode(line)
            except (ValueError, TypeError):
                bad += 1
                continue
            self._apply(uid, change)
        if bad:
            log.warning("change_history_corrupt", path=str(self.path), bad_lines=bad, kept_pods=len(self._view))
        loaded = {uid: list(changes) for uid, changes in self._view.items()}
        self._thread = threading.Thread(target=self._run, name="change-history", daemon=True)
        self._thread.start()
        return loaded

    def append(self, uid: str, changes: tuple[Change, ...]) -> None:
        self._queue.put((uid, changes))

    def forget(self, uid: str) -> None:
        self._queue.put((uid, None))

    def not_saved(self) -> str | None:
        """Why the file is not written now (the writer's last error); None while it is."""
        return self._not_saved

    def wait_written(self, timeout: float) -> bool:
        """Whether the writer took everything queued before this call within ``timeout``
        (written, or kept in memory while ``not_saved``)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued and stop the writer (at shutdown)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    # --- the writer thread -----------------------------------------------------------

    def _apply(self, uid: str, change: Change | None) -> None:
        if change is None:
            self._view.pop(uid, None)
            return
        kept = self._view.get(uid)
        if kept is None:
            kept = self._view[uid] = collections.deque(maxlen=self._per_pod)
        kept.append(change)
        self._view.move_to_end(uid)
        while len(self._view) > self._max_pods:
            self._view.popitem(last=False)

    def _retained(self) -> int:
        return sum(len(d) for d in self._view.values())

    def _rewrite(self) -> None:
        """Replace the file by the bounded view (atomically: a crash leaves old or new)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for uid, changes in self._view.items():
                out.writelines(_encode(uid, c) for c in changes)
        os.replace(tmp, self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lines = self._retained()

    def _write(self, item: tuple[str, tuple[Change, ...] | None]) -> None:
        uid, changes = item
        if changes is None:
            if uid not in self._view:
                return
            self._apply(uid, None)
            self._file.write(json.dumps({"uid": uid, "forget": True}) + "\n")
            self._lines += 1
        else:
            for c in changes:
                self._apply(uid, c)
            self._file.writelines(_encode(uid, c) for c in changes)
            self._lines += len(changes)
        self._file.flush()
        if self._lines > 2 * self._retained() + 1024:
            self._rewrite()

    def _run(self) -> None:
        #: The error that stopped the writing (None while the file is written), and when to try again.
        failed: str | None = None
        backoff = self._retry_after
        retry_at = 0.0
        try:
            self._rewrite()  # drops corrupt lines and what the bounds no longer keep
        except OSError as exc:
            failed = self._not_saved = str(exc)
            retry_at = time.monotonic() + backoff
            self._discard()
            log.warning("change_history_not_saved", path=str(self.path), error=failed, kept="in memory only")
        while (item := self._queue.get()) is not _STOP:
            self._not_saved = failed
            if isinstance(item, threading.Event):
                item.set()
                continue
            assert isinstance(item, tuple)
            if failed is None:
                try:
                    self._write(item)
                    continue
                except Exception as exc:  # noqa: BLE001 - a disk error (or a bug) must not kill the writer
                    failed = self._not_saved = str(exc)  # one warning; the in-memory log (explain) is unaffected
                    backoff = self._retry_after
                    retry_at = time.monotonic() + backoff
                    self._discard()
                    log.warning("change_history_not_saved", path=str(self.path), error=failed,
                                kept="in memory only")
                    continue  # _write applied the item to the view before the file refused it
            self._apply_item(item)  # the view stays current: it is what the file is rewritten from
            if time.monotonic() < retry_at:
                continue
            try:
                self._rewrite()
            except OSError:
                self._discard()
                backoff = min(backoff * 2, RETRY_MAX)
                retry_at = time.monotonic() + backoff
                continue
            log.info("change_history_saved", path=str(self.path), after_error=failed, kept_pods=len(self._view))
            failed = self._not_saved = None
        if failed is not None:  # stopping: one more try, whatever the back-off, as the metrics store does
            try:
                self._rewrite()
                log.info("change_history_saved", path=str(self.path), after_error=failed, kept_pods=len(self._view))
            except OSError:
                self._discard()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _apply_item(self, item: tuple[str, tuple[Change, ...] | None]) -> None:
        uid, changes = item
        if changes is None:
            self._apply(uid, None)
        for c in changes or ():
            self._apply(uid, c)

    def _discard(self) -> None:
        """After a failed write: close the file (a later rewrite replaces it whole) and
        remove a partial temporary file, so the space it took is free again."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # its buffered tail could not be written either: the rewrite covers it
            self._file = None
        try:
            self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)
        except OSError:
            pass  # e.g. the state dir is a file: nothing was created
