"""memory-qos: koordlet's memory QoS formulas worked by hand, the pod annotation, kube-QoS
tier sums (arithmetic only: the strategy memory-qos writes the tiers, see
tests/unit/metrics/qos/test_qos_memoryqos.py), leveled writes on fixture v2 and v1-Anolis trees, the "off" path of a v1
kernel without memory.min, dry-run, and bad input failing with a clear error."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.dryrun import DRY_RUN_SUFFIX
from hooks.memoryqos import MemoryQoS, meminfo_total
from hooks.memoryqoscalc import (
    MEMORY_QOS_ANNOTATION,
    MemorySpec,
    PodProtection,
    container_values,
    koordlet_default,
    pod_config,
    pod_values,
    tier_sums,
)
from hooks.qos import KubeQoS, QoSClass
from hooks.rules import MemoryQOS, parse_rules
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    LivePods,
    PodInfo,
    PodMeta,
    Resources,
    Stage,
    frozen_map,
)

GiB = 1 << 30
UID = "5f0c2b1a-1111-4222-8333-944455556666"
OTHER = "5f0c2b1a-1111-4222-8333-000000000007"
CID = "c0ffee0000000000000000000000000000000000000000000000000000000001"
CID2 = "c0ffee0000000000000000000000000000000000000000000000000000000002"
LS_PARENT = f"/kubepods/burstable/pod{UID}"
FILES = ("memory.min", "memory.low", "memory.high")
ANOLIS = (*FILES, "memory.wmark_ratio", "memory.wmark_scale_factor", "memory.wmark_min_adj", "memory.priority",
                  "memory.use_priority_oom", "memory.oom.group")
DEFAULTS = {"memory.min": "0", "memory.low": "0", "memory.high": "max", "memory.wmark_ratio": "0",
            "memory.wmark_scale_factor": "50", "memory.wmark_min_adj": "0", "memory.priority": "0",
            "memory.use_priority_oom": "0", "memory.oom.group": "0"}
LS_ON = {"resourceQOSStrategy": {"lsClass": {"memoryQOS": {
    "enable": True, "minLimitPercent": 50, "lowLimitPercent": 80, "throttlingPercent": 80}}}}


# --- formulas, by hand -------------------------------------------------------------


def test_container_formula_worked_by_hand() -> None:
    cfg = MemoryQOS(enable=True, min_limit_percent=50, low_limit_percent=80, throttling_percent=80)
    got = container_values(MemorySpec(1 * GiB, 2 * GiB), cfg, 64 * GiB)
    # min = 1073741824 * 50 / 100 = 536870912
    assert got.min == 536_870_912
    # low = floor(1073741824 * 80 / 100) = 858993459 (the kernel keeps pages: 209715 * 4096 = 858992640)
    assert got.low == 858_993_459
    # high = floor((1073741824 + (2147483648 - 1073741824) * 80 / 100) / 4096) * 4096
    #      = floor(1932735283 / 4096) * 4096 = 471859 * 4096 = 1932734464
    assert got.high == 1_932_734_464


def test_unlimited_container_throttles_against_allocatable() -> None:
    cfg = MemoryQOS(enable=True, throttling_percent=50)
    # high = floor((0 + (8 GiB - 0) * 50 / 100) / 4096) * 4096 = 4 GiB
    assert container_values(MemorySpec(0, -1), cfg, 8 * GiB).high == 4 * GiB


def test_koordlet_defaults_protect_nothing_and_set_the_watermarks() -> None:
    # reference §3: LS memoryQOS min/low/throttling 0,0,0, wmarkRatio 95, wmarkScalePermill 20, wmarkMinAdj -25
    got = container_values(MemorySpec(1 * GiB, 2 * GiB), parse_rules(LS_DEFAULT_ON).for_class(QoSClass.LS).memory_qos,
                           64 * GiB)
    assert (got.min, got.low, got.high) == (0, 0, -1)  # throttling 0 => memory.high = max
    assert {r.name: v for r, v in got.extras} == {
        "memory.wmark_ratio": 95, "memory.wmark_scale_factor": 20, "memory.wmark_min_adj": -25,
        "memory.priority": 0, "memory.use_priority_oom": 0, "memory.oom.group": 0}
    be = koordlet_default(QoSClass.BE)
    assert (be.wmark_ratio, be.wmark_scale_permill, be.wmark_min_adj) == (95, 20, 50)


LS_DEFAULT_ON = {"resourceQOSStrategy": {"lsClass": {"memoryQOS": {"enable": True}}}}


def test_low_is_never_below_min_and_pod_sums_requests() -> None:
    cfg = MemoryQOS(enable=True, min_limit_percent=60, low_limit_percent=10)
    # min = 1 GiB * 60% = 644245094; low = max(1 GiB * 10% = 107374182, min) = 644245094
    one = container_values(MemorySpec(1 * GiB, -1), cfg, 0)
    assert one.low == one.min == 644_245_094 and one.high == -1
    # pod: (1 GiB + 2 GiB) * 60 / 100 = 1932735283
    assert pod_values([MemorySpec(1 * GiB, -1), MemorySpec(2 * GiB, -1)], cfg).min == 1_932_735_283


def test_tier_sums() -> None:
    root = PurePosixPath("kubepods")
    pods = [PodProtection(root / "burstable/podA", KubeQoS.BURSTABLE, 100, 200),
            PodProtection(root / "burstable/podB", KubeQoS.BURSTABLE, 10, 20),
            PodProtection(root / "besteffort/podC", KubeQoS.BESTEFFORT, 1, 2),
            PodProtection(root / "podD", KubeQoS.GUARANTEED, 1000, 2000)]
    assert tier_sums(pods) == {root / "burstable": (110, 220), root / "besteffort": (1, 2),
                               root: (1111, 2222)}


def test_annotation_policies() -> None:
    off = MemoryQOS()
    cfg, why = pod_config(off, QoSClass.LS, json.dumps({"policy": "auto", "minLimitPercent": 40}))
    assert cfg.enable and cfg.min_limit_percent == 40 and cfg.wmark_ratio == 95 and "auto" in why
    on = MemoryQOS(enable=True, min_limit_percent=30)
    assert not pod_config(on, QoSClass.LS, '{"policy": "none"}')[0].enable
    assert pod_config(on, QoSClass.LS, '{"lowLimitPercent": 70}')[0].low_limit_percent == 70
    assert not pod_config(off, QoSClass.LS, '{"lowLimitPercent": 70}')[0].enable  # default policy: class must enable


@pytest.mark.parametrize(("raw", "message"), [
    ('{"policy": "always"}', "policy: must be one of default, auto, none, got 'always'"),
    ('{"minLimitPercent": 150}', "minLimitPercent: must be in [0, 100], got 150"),
    ('{"enable": true}', "enable: not a pod-level field"),
    ('{"mystery": 1}', "mystery: unknown key"),
    ("[1]", "expected"),
])
def test_bad_annotation_is_a_clear_error(raw: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        pod_config(MemoryQOS(enable=True), QoSClass.LS, raw)
    assert message in str(exc.value)


# --- the hook on fixture trees -----------------------------------------------------------


def _tree(root: Path, version: int, files: tuple[str, ...], parents: tuple[str, ...]) -> None:
    if version == 2:
        root.mkdir(parents=True)
        (root / "cgroup.controllers").write_text("cpu memory io\n")
        base = root
    else:
        base = root / "memory"
        (root / "cpu").mkdir(parents=True)
    for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort", *parents):
        d = base / rel.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes" if version == 1 else d / "memory.max").write_text(
            "9223372036854771712\n" if version == 1 else "max\n")
        for name in files:
            (d / name).write_text(DEFAULTS[name] + "\n")


def _mem(root: Path, version: int, rel: str, name: str) -> str:
    return ((root / "memory" if version == 1 else root) / rel.lstrip("/") / name).read_text().strip()


def make(tmp_path: Path, rules: dict[str, Any] | None = None, **args: Any) -> MemoryQoS:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=proc)
    return MemoryQoS(HookInit("memory-qos", args, "hooks[5].args", host, LS_ON if rules is None else rules))


def cctx(stage: Stage = Stage.RECONCILE_CONTAINER, *, uid: str = UID, cid: str = CID, name: str = "app",
         limit: int = 2 * GiB, unified: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
         parent: str = LS_PARENT) -> ContainerContext:
    pod = PodInfo(PodMeta("web", "prod", uid), id="sb", cgroup_parent=parent,
                  annotations=frozen_map(annotations or {}))
    res = Resources(memory_limit_in_bytes=limit, unified=frozen_map(unified or {}))
    return ContainerContext(stage, pod, ContainerInfo(ContainerMeta(name), id=cid, resources=res))


VERSIONS = [(2, FILES), (1, ANOLIS), (2, ANOLIS)]


@pytest.mark.parametrize(("version", "files"), VERSIONS)
def test_writes_container_and_pod_not_tiers(tmp_path: Path, version: int, files: tuple[str, ...]) -> None:
    _tree(tmp_path / "cgroup", version, files, (LS_PARENT, f"{LS_PARENT}/{CID}"))
    hook = make(tmp_path)
    patch = hook.post_start_container(cctx(unified={"memory.min": str(1 * GiB)}))
    assert patch is not None and patch.writes
    root = tmp_path / "cgroup"
    # request 1 GiB (kubelet's unified memory.min), limit 2 GiB (CRI): by hand above
    assert _mem(root, version, f"{LS_PARENT}/{CID}", "memory.min") == "536870912"
    assert _mem(root, version, f"{LS_PARENT}/{CID}", "memory.low") == "858992640"
    assert _mem(root, version, f"{LS_PARENT}/{CID}", "memory.high") == "1932734464"
    assert _mem(root, version, LS_PARENT, "memory.min") == "536870912"
    assert _mem(root, version, LS_PARENT, "memory.high") == "max"  # pods get no memory.high
    # the kube-QoS tiers are the strategy memory-qos (metrics.qos.memoryqos): the hook leaves them
    assert _mem(root, version, "kubepods/burstable", "memory.min") == "0"
    assert _mem(root, version, "kubepods", "memory.low") == "0"
    if "memory.wmark_ratio" in files:
        assert _mem(root, version, f"{LS_PARENT}/{CID}", "memory.wmark_ratio") == "95"
        assert _mem(root, version, LS_PARENT, "memory.wmark_min_adj") == "-25"
    reasons = " ".join(w.reason for w in patch.writes)
    assert "request 1073741824, limit 2147483648" in reasons and "minLimitPercent=50" in reasons
    assert hook.reconcile_container(cctx(unified={"memory.min": str(1 * GiB)})) is None


def test_leveled_order_raise_top_down_lower_bottom_up(tmp_path: Path) -> None:
    _tree(tmp_path / "cgroup", 2, FILES, (LS_PARENT, f"{LS_PARENT}/{CID}"))
    hook = make(tmp_path)
    up = hook.reconcile_container(cctx(unified={"memory.min": str(1 * GiB)}))
    assert up is not None
    mins = [Path(w.target).parent.name for w in up.writes if w.target.endswith("memory.min")]
    assert mins[:2] == [f"pod{UID}", CID]  # raised: the pod first
    down = hook.reconcile_container(cctx(unified={"memory.min": str(GiB // 2)}))
    assert down is not None
    mins = [Path(w.target).parent.name for w in down.writes if w.target.endswith("memory.min")]
    assert mins == [CID, f"pod{UID}"]  # lowered: the container first


def test_guaranteed_request_is_limit_and_be_uses_batch_memory(tmp_path: Path) -> None:
    g_parent, be_parent = f"/kubepods/pod{UID}", f"/kubepods/besteffort/pod{OTHER}"
    _tree(tmp_path / "cgroup", 2, FILES, (g_parent, f"{g_parent}/{CID}", be_parent, f"{be_parent}/{CID2}"))
    rules = {"resourceQOSStrategy": {c: {"memoryQOS": {"enable": True, "minLimitPercent": 100}}
                                     for c in ("lsrClass", "beClass")}}
    hook = make(tmp_path, rules)
    hook.reconcile_container(cctx(parent=g_parent, limit=GiB))
    root = tmp_path / "cgroup"
    assert _mem(root, 2, f"{g_parent}/{CID}", "memory.min") == str(GiB)  # Guaranteed: request = limit
    spec = {"containers": {"app": {"requests": {"kubernetes.io/batch-memory": "256Mi"},
                                   "limits": {"kubernetes.io/batch-memory": "512Mi"}}}}
    hook.reconcile_container(cctx(uid=OTHER, cid=CID2, parent=be_parent, limit=0, annotations={
        "koordinator.sh/qosClass": "BE", "node.koordinator.sh/extended-resource-spec": json.dumps(spec)}))
    assert _mem(root, 2, f"{be_parent}/{CID2}", "memory.min") == str(256 << 20)
    assert _mem(root, 2, be_parent, "memory.min") == str(256 << 20)


def test_nothing_written_without_rule_or_annotation(tmp_path: Path) -> None:
    _tree(tmp_path / "cgroup", 2, FILES, (LS_PARENT, f"{LS_PARENT}/{CID}"))
    before = {p: p.read_text() for p in (tmp_path / "cgroup").rglob("memory.*")}
    hook = make(tmp_path, {})
    assert hook.post_start_container(cctx(unified={"memory.min": str(GiB)})) is None
    assert {p: p.read_text() for p in (tmp_path / "cgroup").rglob("memory.*")} == before
    # the annotation alone turns it on for that pod (policy auto: koordlet's class defaults)
    patch = hook.reconcile_container(cctx(annotations={MEMORY_QOS_ANNOTATION: '{"policy":"auto","minLimitPercent":10}'},
                                          unified={"memory.min": str(GiB)}))
    assert patch is not None
    assert _mem(tmp_path / "cgroup", 2, f"{LS_PARENT}/{CID}", "memory.min") == str(GiB // 10 // 4096 * 4096)


def test_v1_without_memory_min_is_off_with_one_line(tmp_path: Path) -> None:
    _tree(tmp_path / "cgroup", 1, (), (LS_PARENT, f"{LS_PARENT}/{CID}"))
    before = {p: p.read_text() for p in (tmp_path / "cgroup").rglob("*") if p.is_file()}
    hook = make(tmp_path)
    with capture_logs() as logs:
        assert hook.post_start_container(cctx()) is None
        assert hook.reconcile_container(cctx()) is None
    assert [e["event"] for e in logs] == ["memory_qos_detected"]
    assert logs[0]["enabled"] is False and "without memory.min" in logs[0]["detail"]
    assert {p: p.read_text() for p in (tmp_path / "cgroup").rglob("*") if p.is_file()} == before


def test_dry_run_writes_nothing_and_logs_the_plan_once(tmp_path: Path) -> None:
    _tree(tmp_path / "cgroup", 2, FILES, (LS_PARENT, f"{LS_PARENT}/{CID}"))
    before = {p: p.read_text() for p in (tmp_path / "cgroup").rglob("memory.*")}
    hook = make(tmp_path, dry_run=True)
    with capture_logs() as logs:
        patch = hook.post_start_container(cctx(unified={"memory.min": str(GiB)}))
        assert hook.reconcile_container(cctx(unified={"memory.min": str(GiB)})) is None
    assert patch is not None and patch.reason.startswith("dry-run")
    shown = {Path(w.target).relative_to((tmp_path / "cgroup").resolve()).as_posix(): w.new for w in patch.writes}
    assert shown[f"kubepods/burstable/pod{UID}/{CID}/memory.min"] == "536870912" + DRY_RUN_SUFFIX
    assert all(w.reason.startswith("dry-run: ") for w in patch.writes)
    assert "kubepods/memory.min" not in shown  # tiers: the strategy
    plans = [e for e in logs if e["event"] == "hook_dry_run"]
    assert len(plans) == 1 and plans[0]["hook"] == "memory-qos"
    assert any(w.endswith(f"kubepods/burstable/pod{UID}/{CID}/memory.min: 0 -> 536870912") for w in plans[0]["writes"])
    assert {p: p.read_text() for p in (tmp_path / "cgroup").rglob("memory.*")} == before


def test_bad_annotation_fails_the_call_and_writes_nothing(tmp_path: Path) -> None:
    _tree(tmp_path / "cgroup", 2, FILES, (LS_PARENT, f"{LS_PARENT}/{CID}"))
    before = {p: p.read_text() for p in (tmp_path / "cgroup").rglob("memory.*")}
    hook = make(tmp_path)
    with pytest.raises(HookError, match=r"prod/web: annotation koordinator.sh/memoryQOS=.*throttlingPercent: "
                                        r"must be in \[0, 100\], got -3"):
        hook.post_start_container(cctx(annotations={MEMORY_QOS_ANNOTATION: '{"throttlingPercent": -3}'}))
    assert {p: p.read_text() for p in (tmp_path / "cgroup").rglob("memory.*")} == before


@pytest.mark.parametrize(("args", "key"), [({"dry_run": "yes"}, "dry_run"),
                                           ({"node_allocatable_memory": -1}, "node_allocatable_memory"),
                                           ({"nope": 1}, "nope")])
def test_bad_args(tmp_path: Path, args: dict[str, Any], key: str) -> None:
    _tree(tmp_path / "cgroup", 2, FILES, ())
    with pytest.raises(HookConfigError) as exc:
        make(tmp_path, **args)
    assert exc.value.key_path == f"hooks[5].args.{key}"


def test_meminfo_total() -> None:
    assert meminfo_total("MemTotal:       16384000 kB\n") == 16_384_000 * 1024
    assert meminfo_total("garbage") == 0


def test_systemd_layout(tmp_path: Path) -> None:
    slice_ = f"kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    pod_rel = f"kubepods.slice/kubepods-burstable.slice/{slice_}"
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    for rel in ("kubepods.slice", "kubepods.slice/kubepods-burstable.slice", pod_rel,
                f"{pod_rel}/cri-containerd-{CID}.scope"):
        (root / rel).mkdir(parents=True, exist_ok=True)
        for name in FILES:
            (root / rel / name).write_text(DEFAULTS[name] + "\n")
    hook = make(tmp_path, cgroup_driver="systemd")
    hook.reconcile_container(cctx(parent=slice_, unified={"memory.min": str(GiB)}))
    assert (root / pod_rel / "memory.min").read_text() == "536870912"
    assert (root / "kubepods.slice/memory.min").read_text() == "0\n"  # tiers: the strategy
    assert (root / pod_rel / f"cri-containerd-{CID}.scope/memory.high").read_text() == "1932734464"


def test_sweep_drops_the_records_of_gone_pods(tmp_path: Path) -> None:
    _tree(tmp_path / "cgroup", 2, FILES, (LS_PARENT, f"{LS_PARENT}/{CID}"))
    hook = make(tmp_path)
    assert hook.post_start_container(cctx(unified={"memory.min": str(1 * GiB)})) is not None
    assert hook.sweep_orphans(LivePods(frozenset({UID}))) == []
    removed = hook.sweep_orphans(LivePods(frozenset()))
    assert removed == [f"memory-qos record of pod {UID} dropped (pod no longer exists)"]
    assert hook.sweep_orphans(LivePods(frozenset())) == []
