"""explain's change history survives a restart, stays bounded, and a bad file never
stops the proxy."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from criapi import cri_v1_pb2 as cri
from runtimeproxy.chain.hookchain import Change
from runtimeproxy.state.history import FILE_NAME, ChangeHistory
from tests.tmpfs import fill, small_tmpfs

RT = "/runtime.v1.RuntimeService/"


def _pod(name: str, uid: str) -> cri.PodSandboxConfig:
    cfg = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name=name, namespace="prod", uid=uid))
    cfg.linux.cgroup_parent = f"/kubepods/burstable/pod{uid}"
    return cfg


def _change(i: int) -> Change:
    return Change("h", "PreCreateContainer", "container.resources.cpu_shares", str(i), str(i + 1), "test")


@pytest.mark.asyncio
async def test_explain_shows_changes_recorded_before_a_restart(fake_runtime, start_proxy, hook_module,
                                                               answer) -> None:
    hooks = [{"name": "tuner", "plugin": hook_module.plugin("Patcher"),
              "args": {"cpu_shares": 2, "annotations": {"qos": "BE"}, "reason": "best effort"}}]
    fake_runtime.answer(RT + "RunPodSandbox", lambda req: answer(payload=cri.RunPodSandboxResponse(
        pod_sandbox_id="sb-" + cri.RunPodSandboxRequest.FromString(req).config.metadata.uid).SerializeToString()))
    first = await start_proxy(fake_runtime, hooks=hooks)
    for name, uid in (("web-0", "u1"), ("gone-0", "u2")):
        await first.call(RT + "RunPodSandbox", cri.RunPodSandboxRequest(config=_pod(name, uid)).SerializeToString())
    _, body = await first.http_get("/debug/explain?pod=prod/web-0")
    before = json.loads(body)["changes"]
    assert [c["target"] for c in before] == ["pod.annotations[qos]"]
    first.app.request_stop()
    assert await first.task == 0

    # Restart: containerd still has web-0; gone-0 was removed while the proxy was down.
    fake_runtime.answer(RT + "ListPodSandbox", answer(payload=cri.ListPodSandboxResponse(
        items=[cri.PodSandbox(id="sb-u1")]).SerializeToString()))
    status = cri.PodSandboxStatus(id="sb-u1", metadata=_pod("web-0", "u1").metadata)
    fake_runtime.answer(RT + "PodSandboxStatus", answer(
        payload=cri.PodSandboxStatusResponse(status=status).SerializeToString()))
    second = await start_proxy(fake_runtime, hooks=hooks)
    code, body = await second.http_get("/debug/explain?pod=prod/web-0")
    assert code == 200 and json.loads(body)["changes"] == before
    assert second.app.store.changes("u2") == [], "a pod gone while the proxy was down: pruned"
    second.app.request_stop()
    assert await second.task == 0
    kept = ChangeHistory(Path(second.app.settings.state_dir), per_pod=8, max_pods=8)
    assert list(kept.load()) == ["u1"], "pruned on disk too"
    kept.close()


def test_history_is_bounded_per_pod_and_in_pods(tmp_path: Path) -> None:
    history = ChangeHistory(tmp_path, per_pod=3, max_pods=2)
    assert history.load() == {}
    history.append("a", tuple(_change(i) for i in range(5)))
    history.append("b", (_change(10),))
    history.append("c", (_change(20),))  # a is the least recently changed: dropped
    for i in range(3000):  # the file is compacted as it grows
        history.append("b", (_change(100 + i),))
    history.close()
    assert len((tmp_path / FILE_NAME).read_text().splitlines()) <= 2 * 4 + 1024 + 1

    again = ChangeHistory(tmp_path, per_pod=3, max_pods=2)
    loaded = again.load()
    again.close()
    assert sorted(loaded) == ["b", "c"]
    assert [c.old for c in loaded["b"]] == ["3097", "3098", "3099"]
    assert [c.old for c in loaded["c"]] == ["20"]


def test_forgotten_pods_leave_the_file(tmp_path: Path) -> None:
    history = ChangeHistory(tmp_path, per_pod=8, max_pods=8)
    history.load()
    history.append("a", (_change(1),))
    history.append("b", (_change(2),))
    history.forget("a")
    history.close()
    reloaded = ChangeHistory(tmp_path, per_pod=8, max_pods=8)
    assert list(reloaded.load()) == ["b"]
    reloaded.close()


def test_corrupt_file_keeps_what_it_can_with_one_warning(tmp_path: Path) -> None:
    good = {"uid": "u1", "change": {"hook": "h", "stage": "s", "target": "t", "old": "1", "new": "2", "reason": "r"}}
    (tmp_path / FILE_NAME).write_bytes(b"\n".join([
        b"{not json", json.dumps(good).encode(), b"\xff\xfe\x00garbage", b"[1, 2]", b'{"uid": 5}',
        json.dumps({"uid": "u2", "change": {"hook": 1}}).encode(), b'{"uid": "u1", "change": {"hook": "h"',
    ]))
    history = ChangeHistory(tmp_path, per_pod=8, max_pods=8)
    with capture_logs() as logs:
        loaded = history.load()
    history.close()
    assert {uid: [(c.old, c.new) for c in cs] for uid, cs in loaded.items()} == {"u1": [("1", "2")]}
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["change_history_corrupt"] and warnings[0]["bad_lines"] == 6
    # Rewritten clean at start: the next start reads it without a warning.
    with capture_logs() as logs:
        ChangeHistory(tmp_path, per_pod=8, max_pods=8).load()
    assert not [e for e in logs if e["log_level"] == "warning"]


@pytest.mark.parametrize("kind", ["file-is-a-directory", "state-dir-is-a-file"])
def test_unusable_state_dir_means_memory_only_never_a_crash(tmp_path: Path, kind: str) -> None:
    if kind == "file-is-a-directory":
        state = tmp_path
        (tmp_path / FILE_NAME).mkdir()
    else:
        state = tmp_path / "state"
        state.write_text("not a dir")
    history = ChangeHistory(state, per_pod=8, max_pods=8)
    with capture_logs() as logs:
        assert history.load() == {}
        history.append("a", (_change(1),))
        history.close()
    events = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert "change_history_not_saved" in events and len(events) <= 2, events


@pytest.fixture
def small_fs() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with small_tmpfs("256k", "history-fs-") as point:
        yield point


def _big(i: int) -> Change:
    """A change of ~4 KiB on disk: a few of them need new pages of a full filesystem."""
    return Change("h", "PreCreateContainer", "t", str(i), "x" * 4000, "test")


def test_a_full_disk_keeps_the_history_in_memory_and_the_file_catches_up_once_space_returns(
        small_fs: Path) -> None:
    state = small_fs / "state"
    history = ChangeHistory(state, per_pod=64, max_pods=8, retry_after=0.0)
    history.load()
    history.append("before", (_change(1),))
    assert history.wait_written(10) and history.not_saved() is None
    filler = fill(small_fs)
    try:
        with capture_logs() as logs:
            for i in range(8):  # the file's last page fills up: ENOSPC
                history.append("full", (_big(i),))
            assert history.wait_written(10) and "No space" in str(history.not_saved())
            for i in range(8, 12):  # still full: kept in memory, no second warning
                history.append("full", (_big(i),))
            assert history.wait_written(10) and history.not_saved() is not None
            filler.unlink()  # space is back: the next change brings the file up to date, while running
            history.append("after", (_change(2),))
            assert history.wait_written(10) and history.not_saved() is None
            text = (state / FILE_NAME).read_text()
    finally:
        history.close()
    events = [e["event"] for e in logs if e["event"].startswith("change_history")]
    assert events == ["change_history_not_saved", "change_history_saved"], events
    assert '"uid":"after"' in text and text.count('"uid":"full"') == 12 and '"uid":"before"' in text
    assert not (state / (FILE_NAME + ".tmp")).exists()
    again = ChangeHistory(state, per_pod=64, max_pods=8)
    loaded = again.load()
    again.close()
    assert sorted(loaded) == ["after", "before", "full"], "everything recorded while full is on disk now"
    assert [c.old for c in loaded["full"]] == [str(i) for i in range(12)]


def test_a_history_still_unsaved_at_stop_is_written_then(small_fs: Path) -> None:
    state = small_fs / "state"
    history = ChangeHistory(state, per_pod=64, max_pods=8, retry_after=3600.0)  # no retry while running
    history.load()
    filler = fill(small_fs)
    for i in range(8):
        history.append("full", (_big(i),))
    assert history.wait_written(10) and history.not_saved() is not None
    filler.unlink()
    history.append("after", (_change(2),))
    assert history.wait_written(10) and history.not_saved() is not None, "back-off: not tried yet"
    history.close()
    text = (state / FILE_NAME).read_text()
    assert '"uid":"after"' in text and text.count('"uid":"full"') == 8
