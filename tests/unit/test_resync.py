"""The store's re-sync with the backend: what containerd dropped goes, what it has is
learnt, states follow; cheap (verbose status only for new objects); and a re-sync
runs by itself when the backend connection comes back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.backend import CallError, Code, Reply
from runtimeproxy.hookapi import ContainerInfo, ContainerMeta, PodInfo, PodMeta
from runtimeproxy.state.store import Store, resync

RT = "/runtime.v1.RuntimeService/"


class Containerd:
    """What containerd has (ids, states), answered as CRI List/Status; records calls."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, int] = {}
        self.containers: dict[str, tuple[str, int]] = {}
        self.calls: list[str] = []
        self.before_list_containers: Any = None

    async def unary(self, method: str, payload: bytes, *, timeout: float | None = None,
                    metadata: Any = ()) -> Reply:
        name = method.removeprefix(RT)
        self.calls.append(name)
        if name == "ListPodSandbox":
            items = [cri.PodSandbox(id=i, state=s, metadata=cri.PodSandboxMetadata(name=i, namespace="ns", uid=i))
                     for i, s in self.sandboxes.items()]
            return Reply(cri.ListPodSandboxResponse(items=items).SerializeToString())
        if name == "ListContainers":
            if self.before_list_containers is not None:
                self.before_list_containers()
            cs = [cri.Container(id=i, pod_sandbox_id=p, state=s) for i, (p, s) in self.containers.items()]
            return Reply(cri.ListContainersResponse(containers=cs).SerializeToString())
        if name == "PodSandboxStatus":
            sid = cri.PodSandboxStatusRequest.FromString(payload).pod_sandbox_id
            if sid not in self.sandboxes:
                raise CallError(Code.NOT_FOUND, sid)
            status = cri.PodSandboxStatus(id=sid, metadata=cri.PodSandboxMetadata(name=sid, namespace="ns", uid=sid))
            return Reply(cri.PodSandboxStatusResponse(status=status).SerializeToString())
        if name == "ContainerStatus":
            cid = cri.ContainerStatusRequest.FromString(payload).container_id
            if cid not in self.containers:
                raise CallError(Code.NOT_FOUND, cid)
            status = cri.ContainerStatus(id=cid, metadata=cri.ContainerMetadata(name=cid))
            info = {"info": json.dumps({"sandboxID": self.containers[cid][0]})}
            return Reply(cri.ContainerStatusResponse(status=status, info=info).SerializeToString())
        raise CallError(Code.UNIMPLEMENTED, name)


def _pod(sid: str) -> PodInfo:
    return PodInfo(meta=PodMeta(name=sid, namespace="ns", uid=sid), id=sid)


def _container(cid: str) -> ContainerInfo:
    return ContainerInfo(meta=ContainerMeta(name=cid), id=cid)


@pytest.mark.asyncio
async def test_resync_drops_learns_and_takes_states() -> None:
    ctrd = Containerd()
    store = Store()
    for sid in ("kept", "gone"):
        store.put_pod(_pod(sid), cri.SANDBOX_READY)
        store.put_container(sid, _container(f"{sid}-c"), cri.CONTAINER_RUNNING)
    ctrd.sandboxes = {"kept": cri.SANDBOX_NOTREADY, "new": cri.SANDBOX_READY}
    ctrd.containers = {"kept-c": ("kept", cri.CONTAINER_EXITED), "new-c": ("new", cri.CONTAINER_CREATED)}

    result = await resync(store, ctrd)  # type: ignore[arg-type]

    assert store.pod("gone") is None and store.container("gone-c") is None
    assert store.pod("new") is not None and store.container("new-c") is not None
    assert store.container("new-c").pod_id == "new"  # type: ignore[union-attr]
    assert store.pod_state("kept") == cri.SANDBOX_NOTREADY and not store.active_pod("kept")
    assert store.container_state("kept-c") == cri.CONTAINER_EXITED and not store.active_container("kept-c")
    assert store.container_state("new-c") == cri.CONTAINER_CREATED
    assert (result.pods_added, result.pods_dropped, result.containers_added, result.containers_dropped) == (1, 1, 1, 1)
    assert result.states_changed == 2
    # Cheap: two List calls and verbose status only for the two new objects.
    assert sorted(ctrd.calls) == ["ContainerStatus", "ListContainers", "ListPodSandbox", "PodSandboxStatus"]

    ctrd.calls.clear()
    again = await resync(store, ctrd)  # type: ignore[arg-type]
    assert not again.changed and again.states_changed == 0
    assert ctrd.calls == ["ListPodSandbox", "ListContainers"]


@pytest.mark.asyncio
async def test_what_the_proxy_writes_during_a_resync_is_not_undone() -> None:
    """A pod created (or removed) through the proxy after the List calls began is not
    dropped (or brought back) by that resync's stale lists."""
    ctrd = Containerd()
    store = Store()
    store.put_pod(_pod("removing"))
    ctrd.sandboxes = {"removing": cri.SANDBOX_READY}

    def meanwhile() -> None:  # between the two List calls: RunPodSandbox and RemovePodSandbox finish
        store.put_pod(_pod("fresh"), cri.SANDBOX_READY)
        store.remove_pod("removing")

    ctrd.before_list_containers = meanwhile
    await resync(store, ctrd)  # type: ignore[arg-type]
    assert store.pod("fresh") is not None, "created after the List: not containerd's to drop yet"
    assert store.pod("removing") is None, "removed after the List: not brought back"


@pytest.mark.asyncio
async def test_a_backend_reconnect_triggers_a_resync(fake_runtime, start_proxy, answer, wait_until) -> None:
    proxy = await start_proxy(fake_runtime, resync_interval="1h")
    path = fake_runtime.path
    assert path is not None and proxy.app.store.pod("sb-late") is None
    await fake_runtime.stop()
    await asyncio.sleep(0.5)  # the proxy answers UNAVAILABLE now; meanwhile containerd made a sandbox
    fake_runtime.answer(RT + "ListPodSandbox", answer(payload=cri.ListPodSandboxResponse(
        items=[cri.PodSandbox(id="sb-late")]).SerializeToString()))
    status = cri.PodSandboxStatus(id="sb-late", metadata=cri.PodSandboxMetadata(name="late", namespace="ns", uid="u"))
    fake_runtime.answer(RT + "PodSandboxStatus", answer(
        payload=cri.PodSandboxStatusResponse(status=status).SerializeToString()))
    await fake_runtime.start(Path(path))
    # No call through the proxy: the reconnect alone must bring the sandbox in.
    await wait_until(lambda: proxy.app.store.pod("sb-late") is not None, 10.0, "a resync after the reconnect")
