"""``check-config`` prints the whole plan run would build (issue 30 item 4): every
collector and QoS strategy with its interval, on/off/idle and why, as text and as JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtimeproxy import cli

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, resctrl: Path) -> Path:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "runtimeproxy" / "default-config.yaml").read_text())
    doc["hookserver_dir"] = ""
    doc["host"] = {"resctrl_root": str(resctrl)}
    doc["rules"] = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 60}}
    metrics = doc["tasks"]["metrics"]
    metrics["db"] = str(tmp_path / "m.db")
    metrics["cpi"] = False
    metrics["collectors"]["psi"] = {"enabled": False}
    metrics["collectors"]["memlat"] = {"interval": "3s"}
    doc["tasks"]["qos-manager"]["strategies"] = [
        "cpu-suppress", {"name": "cpu-burst", "enabled": False}, "cpu-evict", "resctrl"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _plan(capsys: pytest.CaptureFixture[str], config: Path) -> dict[str, Any]:
    assert cli.main(["check-config", "--config", str(config), "--output", "json"]) == 0
    out = capsys.readouterr().out
    plan: dict[str, Any] = json.loads(out)  # the whole stdout is one JSON document: no log line in it
    return plan


def _by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in items}


def test_json_plan_has_each_collector_and_strategy_with_state_interval_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(capsys, _config(tmp_path, tmp_path / "no-resctrl"))
    assert [h["name"] for h in plan["hooks"]][:2] == ["batch-resource", "cpuset"]
    assert list(plan["tasks"]) == ["metrics", "interference", "qos-manager"]

    collectors = _by_name(plan["tasks"]["metrics"]["collectors"])
    assert set(collectors) >= {"node", "hostapps", "pods", "topology", "psi", "schedlat", "cpi", "memlat",
                               "resctrl-monitor"}
    assert collectors["node"]["state"] == "on" and collectors["node"]["required"]
    assert collectors["node"]["interval"] == 1.0 and collectors["topology"]["interval"] == 60.0
    assert collectors["memlat"]["interval"] == 3.0
    assert collectors["psi"] == {**collectors["psi"], "state": "off",
                                 "reason": "tasks.metrics.collectors.psi.enabled: false"}
    assert collectors["cpi"]["state"] == "off" and collectors["cpi"]["reason"] == "tasks.metrics.cpi: false"
    assert collectors["resctrl-monitor"]["state"] == "off"
    assert f"{tmp_path / 'no-resctrl'}/info/L3_MON" in collectors["resctrl-monitor"]["reason"]

    qos = plan["tasks"]["qos-manager"]
    assert qos["interval"] == 1.0 and qos["fast_path"] == {"on": True, "interval": 0.08, "idle_interval": 1.0}
    strategies = _by_name(qos["strategies"])
    assert list(strategies) == ["cpu-suppress", "cpu-evict", "cpu-burst", "resctrl"]  # on/idle, off, absent
    assert strategies["cpu-suppress"]["state"] == "on"
    assert strategies["cpu-evict"]["state"] == "idle"
    assert "cpuEvictThresholdPercent is not set" in strategies["cpu-evict"]["reason"]
    assert strategies["cpu-burst"]["state"] == "off" and "enabled: false" in strategies["cpu-burst"]["reason"]
    assert strategies["resctrl"] == {"name": "resctrl", "state": "off",
                                     "reason": f"qos_strategy_unavailable: no resctrl at {tmp_path / 'no-resctrl'}"}


def test_a_host_with_resctrl_monitoring_turns_its_collector_and_strategy_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resctrl = tmp_path / "resctrl"
    (resctrl / "info" / "L3_MON").mkdir(parents=True)
    (resctrl / "schemata").write_text("L3:0=fff\n")
    plan = _plan(capsys, _config(tmp_path, resctrl))
    assert _by_name(plan["tasks"]["metrics"]["collectors"])["resctrl-monitor"]["state"] == "on"
    assert _by_name(plan["tasks"]["qos-manager"]["strategies"])["resctrl"]["state"] == "on"
    assert sorted(p.name for p in resctrl.iterdir()) == ["info", "schemata"], "the plan wrote nothing"


def test_text_plan_shows_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", "--config", str(_config(tmp_path, tmp_path / "none"))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("config ok: listen=")
    assert "tasks: metrics, interference, qos-manager" in out
    assert "    psi  off  every 10s  (tasks.metrics.collectors.psi.enabled: false)" in out
    assert "    node  on  every 1s  required" in out
    assert any(line.startswith("    cpu-evict  idle  (resourceUsedThresholdWithBE.cpuEvictThresholdPercent")
               for line in out), out


def test_a_bad_value_still_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, tmp_path / "none")
    doc = yaml.safe_load(config.read_text())
    doc["tasks"]["metrics"]["collectors"]["memlat"] = {"interval": "-1s"}
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert cli.main(["check-config", "--config", str(config), "--output", "json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "tasks.metrics.collectors.memlat.interval" in captured.err


def test_dry_run_hook_builds_only_hooks_that_take_dry_run() -> None:
    """The hooks' preview never calls a hook that could write: one without dry_run is refused."""
    from runtimeproxy.chain import plugins
    from runtimeproxy.config import settings as config

    settings = config.load(ROOT / "runtimeproxy" / "default-config.yaml", {"hookserver_dir": ""})
    built = {h.name: plugins.dry_run_hook(h, settings, lambda: {}) for h in settings.hooks}
    previewable = sorted(name for name, b in built.items() if not isinstance(b, str))
    assert previewable == sorted(built)  # every shipped hook has a dry run
    assert all(b.impl.dry_run is True for b in built.values() if not isinstance(b, str))
    remote = dataclasses.replace(settings.hooks[0], plugin="", remote="/run/x.sock")
    assert plugins.dry_run_hook(remote, settings, lambda: {}) == "a remote hook has no dry run"
    ignoring = dataclasses.replace(settings.hooks[0], plugin="tests.unit.test_check_plan:NoDryRun", args={})
    assert plugins.dry_run_hook(ignoring, settings, lambda: {}) == "no dry run (the hook does not report dry_run)"


class NoDryRun:
    """A hook that takes any args and so would ignore ``dry_run``: never called by a preview."""

    def __init__(self, init: object) -> None:
        self.init = init

    def reconcile_pod_sandbox(self, ctx: object) -> None:
        raise AssertionError("a preview must not call a hook without a dry run")


def test_each_hook_says_whether_this_host_has_what_it_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cgroup v2 host whose kubepods root has cpu.idle, memory.min and io.max, and a
    resctrl mount: group-identity, memory-qos, blkio and resctrl are on; without a
    kubepods root the per-pod detections are unknown until the first pod."""
    cg, resctrl = tmp_path / "cg", tmp_path / "resctrl"
    (cg / "kubepods").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpu memory io\n")
    for name in ("cpu.idle", "memory.min", "memory.low", "memory.high", "io.max", "io.weight"):
        (cg / "kubepods" / name).write_text("0\n")
    (resctrl / "info" / "L3").mkdir(parents=True)
    (resctrl / "info" / "L3" / "cbm_mask").write_text("fff\n")
    config = _config(tmp_path, resctrl)
    doc = yaml.safe_load(config.read_text())
    doc["host"]["cgroup_root"] = str(cg)
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    hooks = {h["name"]: h["host"] for h in _plan(capsys, config)["hooks"]}
    for name in ("group-identity", "memory-qos", "blkio", "resctrl"):
        assert hooks[name]["state"] == "on", (name, hooks[name])
    assert "cpu.idle fallback" in hooks["group-identity"]["reason"]
    assert hooks["cpuset"] == {"state": "on", "reason": ""}  # no probe: nothing host-specific to say

    (cg / "kubepods" / "cpu.idle").unlink()
    (cg / "kubepods" / "memory.min").unlink()
    hooks = {h["name"]: h["host"] for h in _plan(capsys, config)["hooks"]}
    assert hooks["group-identity"]["state"] == "off" and "neither" in hooks["group-identity"]["reason"]
    assert hooks["memory-qos"]["state"] == "off" and "without memory.min" in hooks["memory-qos"]["reason"]

    doc["host"]["resctrl_root"] = str(tmp_path / "none")
    (cg / "kubepods").rename(cg / "elsewhere")
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    hooks = {h["name"]: h["host"] for h in _plan(capsys, config)["hooks"]}
    assert hooks["resctrl"]["state"] == "off"
    assert hooks["blkio"]["state"] == "unknown" and "detected at the first pod" in hooks["blkio"]["reason"]
