"""core-sched through an injected prctl boundary (a fake kernel that records calls and
keeps one cookie per thread, relative to the calling thread as the kernel does), on
fixture cgroup v1/v2 trees: koordlet's enablement and group rules, cookies shared per
group (CREATE on one process, SHARE_FROM / SHARE_TO for the others), new processes
and group changes fixed at the next pass, clearing, unsupported kernels, dry-run and
the kube-QoS tier's cpu.idle."""

from __future__ import annotations

import errno
import itertools
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from hooks.coresched import EXPELLER_SUFFIX, GROUP_LABEL, POLICY_LABEL, CoreSched, pod_group, tier_idle
from hooks.coreschedsys import CookieOps, Scope, detect
from hooks.dryrun import DRY_RUN_SUFFIX
from hooks.rules import LiveRules, parse_rules, rules_from_nodeslo
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookError,
    HookInit,
    HostRoots,
    LivePods,
    PodContext,
    PodInfo,
    PodMeta,
    RulesProvider,
    Stage,
    frozen_map,
)

UID = "5d1c0b2a-3e4f-4a5b-9c8d-7e6f5a4b3c2d"
UID2 = "6e2d1c3b-4f5a-4b6c-8d9e-8f7a6b5c4d3e"
QOS = "koordinator.sh/qosClass"


def rules(policy: str = "coreSched", **classes: dict[str, Any]) -> dict[str, Any]:
    strategy = {name: {"cpuQOS": {"enable": True, **cfg}} for name, cfg in classes.items()}
    return {"policies": {"cpuPolicy": policy}, "resourceQOSStrategy": strategy}


ON = rules(lsrClass={}, lsClass={}, beClass={})


class FakeKernel:
    """prctl(PR_SCHED_CORE) semantics on a table of threads; records every call."""

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail
        self.cookies: dict[int, int] = {}  # tid -> cookie
        self.tgid: dict[int, int] = {}  # tid -> its thread group
        self.calls: list[tuple[str, int, int]] = []  # (op, pid, calling thread)
        self._next = itertools.count(0x1000)
        self._lock = threading.Lock()

    def spawn(self, pid: int, threads: int = 1, cookie: int = 0) -> None:
        for tid in range(pid, pid + threads):
            self.tgid[tid] = pid
            self.cookies[tid] = cookie

    def kill(self, pid: int) -> None:
        for tid in [t for t, g in self.tgid.items() if g == pid]:
            del self.tgid[tid], self.cookies[tid]

    def _me(self) -> int:
        return threading.get_native_id()

    def _targets(self, pid: int, scope: Scope) -> list[int]:
        if pid not in self.tgid:
            raise OSError(errno.ESRCH, "no such process")
        if scope is Scope.THREAD:
            return [pid]
        return [t for t, g in self.tgid.items() if g == self.tgid[pid]]

    def _enter(self, op: str, pid: int) -> None:
        self.calls.append((op, pid, self._me()))
        if self.fail is not None:
            raise OSError(self.fail, "prctl refused")

    def get(self, pid: int) -> int:
        with self._lock:
            self._enter("get", pid)
            if pid == 0:
                return self.cookies.get(self._me(), 0)
            return self.cookies[self._targets(pid, Scope.THREAD)[0]]

    def create(self, pid: int, scope: Scope) -> None:
        with self._lock:
            self._enter("create", pid)
            cookie = next(self._next)
            for tid in self._targets(pid, scope):
                self.cookies[tid] = cookie

    def share_to(self, pid: int, scope: Scope) -> None:
        with self._lock:
            self._enter("share_to", pid)
            mine = self.cookies.get(self._me(), 0)
            for tid in self._targets(pid, scope):
                self.cookies[tid] = mine

    def share_from(self, pid: int) -> None:
        with self._lock:
            self._enter("share_from", pid)
            self.cookies[self._me()] = self.cookies[self._targets(pid, Scope.THREAD)[0]]

    def changing(self) -> list[tuple[str, int, int]]:
        return [c for c in self.calls if c[0] != "get"]


class Node:
    """Fixture cgroup tree (v1 or v2) plus a fake kernel and the hook under test."""

    def __init__(self, tmp_path: Path, version: int = 2, rules_doc: Mapping[str, Any] = ON,
                 kernel: FakeKernel | None = None, **args: Any) -> None:
        self.root = tmp_path / "cgroup"
        self.version = version
        self.root.mkdir()
        if version == 2:
            (self.root / "cgroup.controllers").write_text("cpu memory\n")
        else:
            (self.root / "memory").mkdir()
        self.kernel = kernel or FakeKernel()
        self.rules: Mapping[str, Any] = rules_doc
        init = HookInit(name="core-sched", args=args, key_path="hooks[0].args", host=HostRoots(cgroup=self.root),
                        rules=rules_doc, current_rules=lambda: self.rules)
        self.hook = CoreSched(init, sys=self.kernel)

    def _base(self) -> Path:
        return self.root / "cpu" if self.version == 1 else self.root

    def pod(self, uid: str = UID, *, tier: str = "burstable", labels: Mapping[str, str] | None = None,
            sandbox: str = "") -> PodInfo:
        parent = f"/kubepods/{tier}/pod{uid}" if tier else f"/kubepods/pod{uid}"
        tier_dir = self._base() / "kubepods" / tier if tier else self._base() / "kubepods"
        tier_dir.mkdir(parents=True, exist_ok=True)
        if self.version == 2 and not (tier_dir / "cpu.idle").exists():
            (tier_dir / "cpu.idle").write_text("0\n")
        (self._base() / parent.lstrip("/")).mkdir(parents=True, exist_ok=True)
        return PodInfo(PodMeta(f"p-{uid[:4]}", "ns", uid), id=sandbox, cgroup_parent=parent,
                       labels=frozen_map(labels or {}))

    def container(self, pod: PodInfo, cid: str, pids: list[int]) -> ContainerContext:
        directory = self._base() / pod.cgroup_parent.lstrip("/") / cid
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        for pid in pids:
            if pid not in self.kernel.tgid:
                self.kernel.spawn(pid)
        return ContainerContext(Stage.RECONCILE_CONTAINER, pod, ContainerInfo(ContainerMeta(cid[:3]), id=cid))

    def cookie(self, pid: int) -> int:
        return self.kernel.cookies[pid]


def cid(n: int) -> str:
    return f"{n:02d}" + "ab" * 31


# --- rules ---------------------------------------------------------------------------------


def _pod(labels: Mapping[str, str], parent: str = f"/kubepods/burstable/pod{UID}") -> PodInfo:
    return PodInfo(PodMeta("web", "ns", UID), cgroup_parent=parent, labels=frozen_map(labels))


@pytest.mark.parametrize(("doc", "labels", "parent", "want"), [
    (ON, {}, None, (True, "-expeller")),  # LS by kube QoS; LS's coreExpeller defaults to true
    (ON, {QOS: "BE"}, None, (True, "")),
    (ON, {QOS: "BE", GROUP_LABEL: "g1"}, None, (True, "g1")),
    (ON, {QOS: "LS", GROUP_LABEL: "g1"}, None, (True, "g1" + EXPELLER_SUFFIX)),
    (ON, {QOS: "BE", POLICY_LABEL: "exclusive", GROUP_LABEL: "g1"}, None, (True, UID)),
    (ON, {QOS: "BE", POLICY_LABEL: "none"}, None, (False, "")),
    (ON, {QOS: "SYSTEM"}, None, None),
    (rules("groupIdentity", lsrClass={}, lsClass={}, beClass={}), {QOS: "BE"}, None, (False, "")),
    (rules(beClass={}), {QOS: "LS"}, None, (False, "")),  # class disabled: the None config
    (rules(beClass={}), {}, f"/kubepods/besteffort/pod{UID}", (True, "")),
    (rules(lsClass={"coreExpeller": False}), {}, f"/kubepods/pod{UID}", (True, "")),  # Guaranteed -> LS
    (rules(lsrClass={"coreExpeller": False}, lsClass={}), {}, f"/kubepods/pod{UID}", (True, "")),  # -> LSR
    ({}, {QOS: "BE"}, None, (False, "")),  # no rules: nothing
])
def test_pod_group_follows_koordlet(doc: Mapping[str, Any], labels: dict[str, str], parent: str | None,
                                    want: tuple[bool, str] | None) -> None:
    pod = _pod(labels, parent or f"/kubepods/burstable/pod{UID}")
    assert pod_group(parse_rules(doc), pod) == want


@pytest.mark.parametrize(("labels", "key"), [({POLICY_LABEL: "shared"}, POLICY_LABEL), ({QOS: "GOLD"}, QOS)])
def test_bad_labels_name_label_and_value(labels: dict[str, str], key: str) -> None:
    with pytest.raises(HookError) as err:
        pod_group(parse_rules(ON), _pod(labels))
    assert f"{key}={labels[key]!r}" in str(err.value) and "ns/web" in str(err.value)


@pytest.mark.parametrize(("doc", "parent", "want"), [
    (rules(beClass={"schedIdle": 1}), f"/kubepods/besteffort/pod{UID}", 1),
    (rules(beClass={"schedIdle": 1}), f"/kubepods/burstable/pod{UID}", 0),
    (rules(beClass={"schedIdle": 1}, lsClass={"schedIdle": 1}), f"/kubepods/pod{UID}", 1),  # G -> LS
    (rules("groupIdentity", beClass={"schedIdle": 1}), f"/kubepods/besteffort/pod{UID}", 0),
    (rules(beClass={"enable": False, "schedIdle": 1}), f"/kubepods/besteffort/pod{UID}", 0),
])
def test_tier_idle(doc: Mapping[str, Any], parent: str, want: int) -> None:
    assert tier_idle(parse_rules(doc), _pod({}, parent)) == want


# --- cookies -------------------------------------------------------------------------------


def test_a_group_shares_one_cookie_created_once(tmp_path: Path) -> None:
    node = Node(tmp_path)
    a, b = node.pod(UID, labels={GROUP_LABEL: "g"}), node.pod(UID2, labels={GROUP_LABEL: "g"})
    first = node.hook.reconcile_container(node.container(a, cid(1), [100, 101]))
    assert first is not None and "group 'g-expeller'" in first.writes[0].new and "2 process(es)" in first.writes[0].new
    assert f"coreExpeller True, labels {QOS}='' {GROUP_LABEL}='g' {POLICY_LABEL}=''" in first.writes[0].reason
    cookie = node.cookie(100)
    assert cookie != 0 and node.cookie(101) == cookie
    me = threading.get_native_id()
    ops = node.kernel.changing()
    assert [(op, pid) for op, pid, _ in ops] == [("create", 100), ("share_from", 100), ("share_to", 101)]
    assert ops[0][2] == me and ops[1][2] != me and ops[1][2] == ops[2][2]  # sharing runs in its own thread
    assert node.kernel.cookies.get(me, 0) == 0  # the calling thread never carries a pod's cookie

    node.kernel.calls.clear()
    second = node.hook.reconcile_container(node.container(b, cid(2), [200]))
    assert second is not None and node.cookie(200) == cookie
    assert [(op, pid) for op, pid, _ in node.kernel.changing()] == [("share_from", 100), ("share_to", 200)]

    node.kernel.calls.clear()  # a pass finding everything true: only reads
    assert node.hook.reconcile_container(node.container(a, cid(1), [100, 101])) is None
    assert node.kernel.changing() == []


def test_groups_and_exclusive_pods_get_their_own_cookies(tmp_path: Path) -> None:
    node = Node(tmp_path)
    g1 = node.pod(UID, labels={QOS: "BE", GROUP_LABEL: "g1"})
    g2 = node.pod(UID2, labels={QOS: "BE", POLICY_LABEL: "exclusive", GROUP_LABEL: "g1"})
    node.hook.reconcile_container(node.container(g1, cid(1), [100]))
    node.hook.reconcile_container(node.container(g2, cid(2), [200]))
    assert len({node.cookie(100), node.cookie(200), 0}) == 3


def test_a_later_process_and_a_group_change_are_fixed_at_the_next_pass(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.pod(labels={QOS: "BE", GROUP_LABEL: "g1"})
    node.hook.reconcile_container(node.container(pod, cid(1), [100]))
    old = node.cookie(100)
    patch = node.hook.reconcile_container(node.container(pod, cid(1), [100, 150]))  # exec'd in later
    assert patch is not None and node.cookie(150) == old
    moved = node.pod(labels={QOS: "BE", GROUP_LABEL: "g2"})
    patch = node.hook.reconcile_container(node.container(moved, cid(1), [100, 150]))
    assert patch is not None and "'g2'" in patch.writes[0].new
    assert node.cookie(100) == node.cookie(150) not in (0, old)


def test_a_group_whose_cookie_holders_died_gets_a_new_cookie(tmp_path: Path) -> None:
    node = Node(tmp_path)
    a, b = node.pod(UID, labels={QOS: "BE"}), node.pod(UID2, labels={QOS: "BE"})
    node.hook.reconcile_container(node.container(a, cid(1), [100]))
    old = node.cookie(100)
    node.kernel.kill(100)
    node.hook.reconcile_container(node.container(b, cid(2), [200]))
    assert node.cookie(200) not in (0, old)
    assert ("create", 200) in [(op, pid) for op, pid, _ in node.kernel.changing()]


def test_a_pod_no_longer_enabled_has_its_cookies_cleared(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.pod(labels={QOS: "BE"})
    node.hook.reconcile_container(node.container(pod, cid(1), [100, 101]))
    assert node.cookie(100) != 0
    node.rules = rules("groupIdentity", beClass={})  # the NodeSLO turns core scheduling off
    patch = node.hook.reconcile_container(node.container(pod, cid(1), [100, 101]))
    assert patch is not None and patch.writes[0].new == "default cookie on 2 process(es)"
    assert node.cookie(100) == node.cookie(101) == 0
    node.kernel.calls.clear()
    assert node.hook.reconcile_container(node.container(pod, cid(1), [100, 101])) is None
    assert node.kernel.calls == []  # forgotten: not even read again


def test_cookies_it_never_set_are_left_alone(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.kernel.spawn(100, cookie=0xBEEF)  # the workload's own core scheduling
    pod = node.pod(labels={QOS: "BE", POLICY_LABEL: "none"})
    assert node.hook.reconcile_container(node.container(pod, cid(1), [100])) is None
    system = node.pod(UID2, labels={QOS: "SYSTEM"})
    assert node.hook.reconcile_container(node.container(system, cid(2), [200])) is None
    assert node.cookie(100) == 0xBEEF and node.kernel.calls == []


def test_no_rules_no_prctl_at_all(tmp_path: Path) -> None:
    node = Node(tmp_path, rules_doc={})
    pod = node.pod(labels={QOS: "BE"}, sandbox="sb" * 16)
    assert node.hook.reconcile_container(node.container(pod, cid(1), [100])) is None
    assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
    assert node.kernel.calls == [] and node.hook._support is None


def test_sandbox_container_gets_the_cookie_at_the_pod_pass(tmp_path: Path) -> None:
    node = Node(tmp_path)
    sandbox = "5b" * 32
    pod = node.pod(labels={QOS: "BE"}, sandbox=sandbox)
    node.container(pod, sandbox, [90])
    patch = node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert patch is not None and node.cookie(90) != 0 and "sandbox" in patch.writes[-1].target


def test_unsupported_kernel_is_detected_once_and_nothing_is_done(tmp_path: Path) -> None:
    node = Node(tmp_path, kernel=FakeKernel(fail=errno.EINVAL))
    a, b = node.pod(UID, labels={QOS: "BE"}), node.pod(UID2, labels={QOS: "BE"})
    with structlog.testing.capture_logs() as logs:
        patch = node.hook.reconcile_container(node.container(a, cid(1), [100]))
        again = node.hook.reconcile_container(node.container(a, cid(1), [100]))
        other = node.hook.reconcile_container(node.container(b, cid(2), [200]))
    assert patch is not None and patch.writes[0].new == "not applied"
    assert "EINVAL" in patch.writes[0].reason and "no core scheduling" in patch.writes[0].reason
    assert again is None and other is not None  # once per pod in explain
    detected = [e for e in logs if e["event"] == "core_sched_detected"]
    assert len(detected) == 1 and detected[0]["supported"] is False
    assert [op for op, *_ in node.kernel.calls] == ["get"]  # the one detection call, nothing else


@pytest.mark.parametrize(("code", "text"), [(errno.EINVAL, "EINVAL"), (errno.ENODEV, "SMT is off")])
def test_detect_names_the_cause(code: int, text: str) -> None:
    support = detect(FakeKernel(fail=code))
    assert not support.supported and text in support.detail


def test_dry_run_plans_without_prctl_changes(tmp_path: Path) -> None:
    node = Node(tmp_path, dry_run=True)
    pod = node.pod(labels={QOS: "BE", GROUP_LABEL: "g"})
    patch = node.hook.reconcile_container(node.container(pod, cid(1), [100, 101]))
    assert patch is not None and patch.writes[0].new.endswith(DRY_RUN_SUFFIX) and "new cookie" in patch.writes[0].new
    assert node.kernel.changing() == [] and node.cookie(100) == 0
    assert node.hook.reconcile_container(node.container(pod, cid(1), [100, 101])) is None  # reported once


def test_clear_refuses_from_a_thread_with_a_cookie() -> None:
    """A thread inherits its creator's cookie: clearing from one that has a cookie would spread it."""
    kernel = FakeKernel()
    kernel.spawn(100, cookie=7)
    original: Callable[[int], int] = kernel.get
    kernel.get = lambda pid: 9 if pid == 0 else original(pid)  # type: ignore[method-assign]
    with pytest.raises(OSError, match="not the default"):
        CookieOps(kernel).clear([100])
    assert kernel.cookies[100] == 7 and kernel.changing() == []


# --- cpu.idle of the tier ----------------------------------------------------------------------


def test_be_tier_gets_cpu_idle_on_v2_and_is_reset_when_the_policy_goes(tmp_path: Path) -> None:
    node = Node(tmp_path, rules_doc=rules(beClass={"schedIdle": 1}))
    pod = node.pod(tier="besteffort")
    idle = node.root / "kubepods" / "besteffort" / "cpu.idle"
    patch = node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert patch is not None and idle.read_text().strip() == "1" and "schedIdle" in patch.reason
    assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
    node.rules = rules("groupIdentity", beClass={"schedIdle": 1})
    patch = node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert patch is not None and idle.read_text().strip() == "0" and "reset" in patch.reason


def test_a_tier_in_place_costs_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: every pod of a tier checks the tier's cpu.idle at every reconcile pass."""
    node = Node(tmp_path, rules_doc=rules(beClass={"schedIdle": 1}))
    pod = node.pod(tier="besteffort")
    assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is not None
    calls: list[str] = []
    executor = node.hook.executor
    for name in ("read", "path", "apply"):
        real = getattr(executor, name)
        monkeypatch.setattr(executor, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
    assert calls == ["read", "path"]  # one read (resolving its path): no stat, no update
    (node.root / "kubepods" / "besteffort" / "cpu.idle").write_text("0\n")  # changed behind our back
    patch = node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert patch is not None and (node.root / "kubepods" / "besteffort" / "cpu.idle").read_text().strip() == "1"


def test_no_cpu_idle_on_v1_is_said_once_and_nothing_written(tmp_path: Path) -> None:
    node = Node(tmp_path, version=1, rules_doc=rules(beClass={"schedIdle": 1}))
    pod = node.pod(tier="besteffort")
    before = sorted(p.name for p in (node.root / "cpu" / "kubepods" / "besteffort").iterdir())
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
    assert [e["event"] for e in logs].count("core_sched_cpu_idle_absent") == 1
    assert sorted(p.name for p in (node.root / "cpu" / "kubepods" / "besteffort").iterdir()) == before


def test_cpu_idle_dry_run(tmp_path: Path) -> None:
    node = Node(tmp_path, rules_doc=rules(beClass={"schedIdle": 1}), dry_run=True)
    pod = node.pod(tier="besteffort")
    patch = node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert patch is not None and patch.writes[0].new == "1" + DRY_RUN_SUFFIX
    assert (node.root / "kubepods" / "besteffort" / "cpu.idle").read_text().strip() == "0"


def test_a_tier_left_idle_is_reset_by_a_fresh_hook_and_an_unset_one_not_written(tmp_path: Path) -> None:
    """As koordlet: the tier's value follows the rules (0 without coreSched); a reload builds a new hook."""
    node = Node(tmp_path, rules_doc=rules("groupIdentity", lsrClass={}, lsClass={}, beClass={}))
    pod = node.pod(tier="besteffort")
    idle = node.root / "kubepods" / "besteffort" / "cpu.idle"
    assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None  # 0 already
    idle.write_text("1\n")
    patch = node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert patch is not None and idle.read_text().strip() == "0"


def test_no_cpu_idle_is_not_worth_a_warning_without_core_sched(tmp_path: Path) -> None:
    node = Node(tmp_path, version=1, rules_doc={})
    pod = node.pod(tier="besteffort")
    with structlog.testing.capture_logs() as logs:
        assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
        node.rules = rules(beClass={"schedIdle": 1})  # the NodeSLO asks for it now
        assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
        assert node.hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None
    assert [e["event"] for e in logs] == ["core_sched_cpu_idle_absent"]


def test_a_nodeslo_turns_it_on_through_the_rules_provider(tmp_path: Path) -> None:
    """The NodeSLO's resourceQOSStrategy.policies.cpuPolicy reaches the hook as the metrics task merges it."""
    provider = RulesProvider({})
    node = Node(tmp_path, rules_doc={})
    node.hook._rules = LiveRules(base={}, current=provider.current, owner="core-sched")
    pod = node.pod(labels={QOS: "BE"})
    assert node.hook.reconcile_container(node.container(pod, cid(1), [100])) is None
    spec = {"resourceQOSStrategy": {"policies": {"cpuPolicy": "coreSched"},
                                    "beClass": {"cpuQOS": {"enable": True, "schedIdle": 1}}}}
    provider.set_overlay("nodeslo", rules_from_nodeslo(spec))
    assert node.hook.reconcile_container(node.container(pod, cid(1), [100])) is not None
    assert node.cookie(100) != 0


def test_a_source_exiting_during_the_share_starts_the_group_over(tmp_path: Path) -> None:
    node = Node(tmp_path)
    a, b = node.pod(UID, labels={QOS: "BE"}), node.pod(UID2, labels={QOS: "BE"})
    node.hook.reconcile_container(node.container(a, cid(1), [100]))
    old = node.cookie(100)
    ctx = node.container(b, cid(2), [200])
    share_from = node.kernel.share_from

    def exits_first(pid: int) -> None:
        node.kernel.kill(100)  # between the hook's GET and the SHARE_FROM
        share_from(pid)

    node.kernel.share_from = exits_first  # type: ignore[method-assign]
    patch = node.hook.reconcile_container(ctx)
    assert patch is not None and node.cookie(200) not in (0, old)


def test_sweep_forgets_the_cookies_of_gone_pods_so_their_group_starts_over(tmp_path: Path) -> None:
    """``sweep_orphans``: the containers and groups remembered for pods that no longer
    exist are forgotten; a live pod's stay."""
    node = Node(tmp_path)
    a, b = node.pod(UID, labels={GROUP_LABEL: "g"}), node.pod(UID2, labels={GROUP_LABEL: "h"})
    node.hook.reconcile_container(node.container(a, cid(1), [100]))
    node.hook.reconcile_container(node.container(b, cid(2), [200]))
    assert set(node.hook._groups) == {"g-expeller", "h-expeller"}

    removed = node.hook.sweep_orphans(LivePods(frozenset({UID2})))

    assert len(removed) == 2 and f"{UID}/{cid(1)}" in removed[0] and "'g-expeller'" in removed[1]
    assert set(node.hook._groups) == {"h-expeller"} and list(node.hook._containers) == [f"{UID2}/{cid(2)}"]
    assert node.hook.sweep_orphans(LivePods(frozenset({UID2}))) == []
