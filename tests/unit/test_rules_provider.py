"""One source of rules (issue 14, item 10): the NodeSLO merged over the YAML feeds every
hook, a change is re-applied to running pods by the reconciler, and without a cluster
the YAML applies.

The App in front of a fake runtime, the shipped group-identity hook on a fixture cgroup
v1 tree (a kernel with ``cpu.idle`` only, so BE pods get ``cpu.idle = 1``), and the
NodeSLO registered from a thread exactly as the metrics task's informer does (its own
path, from a fake API server's watch, is tested in tests/unit/metrics/test_nodeslo_rules.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from hooks.rules import rules_from_nodeslo
from runtimeproxy.hookapi import RulesProvider, merge_rules

RUN = "/runtime.v1.RuntimeService/RunPodSandbox"
LIST = "/runtime.v1.RuntimeService/ListPodSandbox"
YAML_RULES = {"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enable": True, "groupIdentity": 2}},
                                      "beClass": {"cpuQOS": {"enable": True, "groupIdentity": -1}}}}
#: A NodeSLO as slo-controller writes it: also keys this agent does not model.
NODESLO_BE_OFF: dict[str, Any] = {
    "resourceQOSStrategy": {
        "policies": {"cpuPolicy": "groupIdentity"},
        "beClass": {"cpuQOS": {"enable": False, "groupIdentity": -1}, "blkioQOS": {"enable": False},
                    "networkQOS": {"enable": False}},
    },
    "systemStrategy": {"minFreeKbytesFactor": 100},
    "extensions": {},
}


def be_pod(uid: str) -> bytes:
    cfg = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name=f"batch-{uid}", namespace="jobs", uid=uid),
                               labels={"koordinator.sh/qosClass": "BE"})
    cfg.linux.cgroup_parent = f"/kubepods/besteffort/pod{uid}"
    return cri.RunPodSandboxRequest(config=cfg).SerializeToString()


async def run_pod(proxy: Any, uid: str) -> None:
    # The fake answers one sandbox id by default: give each pod its own, so the store keeps both.
    answer = type(proxy.fake.answers[RUN])
    proxy.fake.answer(RUN, answer(cri.RunPodSandboxResponse(pod_sandbox_id=f"sb-{uid}").SerializeToString()))
    await proxy.call(RUN, be_pod(uid))
    # The reconciler re-syncs the store with the runtime first: the fake lists what it ran.
    listed = cri.ListPodSandboxResponse.FromString(proxy.fake.answers[LIST].payload)
    if all(item.id != f"sb-{uid}" for item in listed.items):
        listed.items.add(id=f"sb-{uid}", state=cri.SANDBOX_READY)
    proxy.fake.answer(LIST, answer(listed.SerializeToString()))


def idle_file(root: Path, uid: str) -> Path:
    pod = root / "cpu" / "kubepods" / "besteffort" / f"pod{uid}"
    return pod / "cpu.idle"


def make_tree(root: Path, uids: tuple[str, ...]) -> None:
    (root / "memory").mkdir(parents=True)
    for rel in ("kubepods", "kubepods/besteffort", *(f"kubepods/besteffort/pod{u}" for u in uids)):
        d = root / "cpu" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.idle").write_text("0\n")
        (d / "cpu.shares").write_text("1024\n")


@pytest.mark.asyncio
async def test_nodeslo_turns_be_cpu_qos_off_for_new_and_running_pods(
    fake_runtime: Any, start_proxy: Any, tmp_path: Path, wait_until: Any
) -> None:
    root = tmp_path / "cgroup"
    make_tree(root, ("a", "b"))
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "gi", "plugin": "group-identity"}],
                              host={"cgroup_root": str(root)}, rules=YAML_RULES, reconcile_interval="1h")
    # No cluster: the YAML rules apply.
    await run_pod(proxy, "a")
    assert idle_file(root, "a").read_text().strip() == "1"

    # The NodeSLO arrives (from a watch thread): the running pod is reconciled at once
    # (the reconcile interval is an hour), the next BE pod does not get cpu.idle = 1.
    overlay = rules_from_nodeslo(NODESLO_BE_OFF)
    await asyncio.to_thread(proxy.app.rules.set_overlay, "nodeslo", overlay)
    await wait_until(lambda: idle_file(root, "a").read_text().strip() == "0", 5.0, "pod a reconciled")
    await run_pod(proxy, "b")
    assert idle_file(root, "b").read_text().strip() == "0"

    # The NodeSLO is deleted: the YAML applies again, to both running pods.
    await asyncio.to_thread(proxy.app.rules.set_overlay, "nodeslo", None)
    await wait_until(lambda: all(idle_file(root, u).read_text().strip() == "1" for u in "ab"), 5.0,
                     "the YAML rules re-applied")


@pytest.mark.asyncio
async def test_a_reload_keeps_the_nodeslo_over_the_new_yaml(
    fake_runtime: Any, start_proxy: Any, tmp_path: Path, wait_until: Any
) -> None:
    root = tmp_path / "cgroup"
    make_tree(root, ("a",))
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "gi", "plugin": "group-identity"}],
                              host={"cgroup_root": str(root)}, rules=YAML_RULES, reconcile_interval="1h",
                              config_file=True)
    proxy.app.rules.set_overlay("nodeslo", rules_from_nodeslo(NODESLO_BE_OFF))
    await run_pod(proxy, "a")
    assert idle_file(root, "a").read_text().strip() == "0"
    assert await proxy.app.reload("test")  # same YAML, new chain: the NodeSLO still wins
    await run_pod(proxy, "a")
    assert idle_file(root, "a").read_text().strip() == "0"
    assert proxy.app.rules.sources() == ["yaml", "nodeslo"]


def test_provider_merges_overlays_over_the_base_and_notifies_once_per_change() -> None:
    calls: list[int] = []
    provider = RulesProvider(YAML_RULES)
    provider.subscribe(lambda: calls.append(1))
    assert provider.current() is YAML_RULES  # no overlay: the YAML object itself
    overlay = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": False}}}}
    provider.set_overlay("nodeslo", overlay)
    merged = provider.current()
    assert merged["resourceQOSStrategy"]["beClass"]["cpuQOS"] == {"enable": False, "groupIdentity": -1}
    assert merged["resourceQOSStrategy"]["lsClass"] == YAML_RULES["resourceQOSStrategy"]["lsClass"]
    provider.set_overlay("nodeslo", dict(overlay))  # equal again: no change, same object, no call
    assert provider.current() is merged and calls == [1]
    provider.set_base({})  # a reload: the overlay stays over the new base
    assert provider.current() == overlay and calls == [1, 1]
    provider.set_overlay("nodeslo", None)
    assert provider.current() == {} and calls == [1, 1, 1]


def test_merge_replaces_non_mappings() -> None:
    assert merge_rules({"a": {"b": 1, "c": [1]}, "d": 1}, {"a": {"c": [2]}, "d": {"e": 1}}) == {
        "a": {"b": 1, "c": [2]}, "d": {"e": 1}}


@pytest.mark.asyncio
async def test_a_nodeslo_turning_group_identity_off_resets_running_pods(
    fake_runtime: Any, start_proxy: Any, tmp_path: Path, wait_until: Any
) -> None:
    """slo-controller's default NodeSLO disables cpuQOS for every class: a pod set while
    it was on is reset to 0 (a fresh node that never had it on is left alone)."""
    root = tmp_path / "cgroup"
    make_tree(root, ("a",))
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "gi", "plugin": "group-identity"}],
                              host={"cgroup_root": str(root)}, rules=YAML_RULES, reconcile_interval="1h")
    await run_pod(proxy, "a")
    assert idle_file(root, "a").read_text().strip() == "1"
    all_off = {"resourceQOSStrategy": {c: {"cpuQOS": {"enable": False}} for c in ("lsrClass", "lsClass", "beClass")}}
    await asyncio.to_thread(proxy.app.rules.set_overlay, "nodeslo", rules_from_nodeslo(all_off))
    await wait_until(lambda: idle_file(root, "a").read_text().strip() == "0", 5.0, "pod a reset")
