"""The ``ingress``/``nri`` settings (one validator for run, check-config and reload) and
the NRI conversions: only what the chain changed is claimed in an adjustment."""

from __future__ import annotations

from dataclasses import replace

import pytest

from criapi import cri_v1_pb2 as cri
from criapi import nri_v1alpha1_pb2 as nri
from runtimeproxy.chain.hookchain import HookChain
from runtimeproxy.config.ingress import NriSettings
from runtimeproxy.config.settings import ConfigError, from_mapping
from runtimeproxy.hookapi import Resources, frozen_map
from runtimeproxy.lifecycle.posthooks import PostQueue
from runtimeproxy.nri import convert, wire
from runtimeproxy.nri.plugin import NriPlugin, PluginInit
from runtimeproxy.state.store import Store


def test_defaults_keep_the_proxy() -> None:
    s = from_mapping({})
    assert s.ingress == "cri-proxy" and s.nri.socket == "/var/run/nri/nri.sock" and s.nri.plugin_index == "50"


@pytest.mark.parametrize(("doc", "key", "value"), [
    ({"ingress": "kubelet"}, "ingress", "kubelet"),
    ({"nri": {"socket": "nri.sock"}}, "nri.socket", "nri.sock"),
    ({"nri": {"socket": "/" + "x" * 120}}, "nri.socket", "/" + "x" * 120),
    ({"nri": {"plugin_index": "5"}}, "nri.plugin_index", "5"),
    ({"nri": {"plugin_index": 100}}, "nri.plugin_index", 100),
    ({"nri": {"plugin_name": ""}}, "nri.plugin_name", ""),
    ({"nri": {"plugin_name": "a b"}}, "nri.plugin_name", "a b"),
    ({"nri": {"chain_deadline": "2s"}}, "nri.chain_deadline", "2s"),
    ({"nri": {"timeout": "2s"}}, "nri.timeout", "2s"),
])
def test_bad_values_name_the_key(doc: dict[str, object], key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(doc)
    assert err.value.key_path == key and err.value.value == value


def test_index_as_a_number_is_two_digits() -> None:
    assert from_mapping({"nri": {"plugin_index": 7}}).nri.plugin_index == "07"


def _container(**res: object) -> nri.Container:
    c = nri.Container(id="c1", pod_sandbox_id="p1", name="app", env=["PATH=/bin", "A=1"],
                      labels={"io.cri-containerd.kind": "container", "app": "x"},
                      annotations={"io.kubernetes.cri.image-name": "img:1", "io.kubernetes.container.restartCount": "2",
                                   "team": "a"})
    c.linux.resources.cpu.shares.value = 512
    c.linux.resources.cpu.quota.SetInParent()  # present but 0, as containerd sends it
    c.linux.oom_score_adj.value = -997
    return c


def test_container_info_drops_containerds_own_keys() -> None:
    info = convert.container_info(_container())
    assert dict(info.labels) == {"app": "x"} and dict(info.annotations) == {
        "io.kubernetes.container.restartCount": "2", "team": "a"}
    assert info.image == "img:1" and info.meta.attempt == 2 and dict(info.envs) == {"PATH": "/bin", "A": "1"}
    assert info.resources.cpu_shares == 512 and info.resources.cpu_quota == 0 and info.resources.oom_score_adj == -997


def test_adjustment_claims_only_changed_fields() -> None:
    old = convert.container_info(_container())
    new = replace(old, annotations=frozen_map({**old.annotations, "x/y": "z"}),
                  envs=frozen_map({**old.envs, "B": "2"}),
                  resources=replace(old.resources, cpu_quota=-1, cpuset_cpus="1", oom_score_adj=500,
                                    unified=frozen_map({"cpu.idle": "1"})))
    adjust = nri.ContainerAdjustment()
    cannot = convert.adjustment(old, new, adjust)
    assert cannot == ["oom_score_adj"]
    assert dict(adjust.annotations) == {"x/y": "z"} and [(kv.key, kv.value) for kv in adjust.env] == [("B", "2")]
    cpu = adjust.linux.resources.cpu
    assert cpu.quota.value == -1 and cpu.cpus == "1" and not cpu.HasField("shares") and not cpu.HasField("period")
    assert not adjust.linux.resources.HasField("memory") and dict(adjust.linux.resources.unified) == {"cpu.idle": "1"}


def test_update_is_none_when_nothing_nri_can_carry_changed() -> None:
    res = Resources(cpu_shares=2)
    assert convert.update("c1", res, res) == (None, [])
    upd, cannot = convert.update("c1", res, replace(res, memory_swap_limit_in_bytes=1 << 30))
    assert upd is None and cannot == ["memory_swap_limit_in_bytes"]
    upd, _ = convert.update("c1", res, replace(res, cpu_shares=700))
    assert upd is not None and upd.container_id == "c1" and upd.linux.resources.cpu.shares.value == 700


def _plugin(store: Store) -> NriPlugin:
    return NriPlugin(PluginInit(settings=NriSettings, store=store, chain=lambda: HookChain([]),
                                skipped=lambda pod: False, posts=PostQueue()))


@pytest.mark.asyncio
async def test_synchronize_replaces_the_store_with_containerds_view() -> None:
    store = Store()
    store.put_pod(convert.pod_info(nri.PodSandbox(id="gone", name="old", uid="u0", namespace="ns")), cri.SANDBOX_READY)
    plugin = _plugin(store)
    req = nri.SynchronizeRequest(
        pods=[nri.PodSandbox(id="p1", name="a", uid="u1", namespace="ns", pid=42),
              nri.PodSandbox(id="p2", name="b", uid="u2", namespace="ns", pid=0)],
        containers=[nri.Container(id="c1", pod_sandbox_id="p1", name="app", state=nri.CONTAINER_RUNNING, pid=43)])
    assert await plugin._handle("Synchronize", req.SerializeToString(), 2.0) == b""
    assert store.pod("gone") is None
    assert store.pod_state("p1") == cri.SANDBOX_READY and store.pod_state("p2") == cri.SANDBOX_NOTREADY
    rec = store.container("c1")
    assert rec is not None and rec.pod_id == "p1" and store.container_state("c1") == cri.CONTAINER_RUNNING


@pytest.mark.asyncio
async def test_configure_subscribes_what_the_store_needs_and_unknown_methods_are_unimplemented() -> None:
    plugin = _plugin(Store())
    reply = nri.ConfigureResponse.FromString(
        await plugin._handle("Configure", nri.ConfigureRequest(runtime_name="containerd").SerializeToString(), 2.0))
    assert reply.events == 0x74F  # no hooks: only the store's events, never 0 (which means all)
    with pytest.raises(wire.RpcError) as err:
        await plugin._handle("Frobnicate", b"", 2.0)
    assert err.value.code == wire.UNIMPLEMENTED
