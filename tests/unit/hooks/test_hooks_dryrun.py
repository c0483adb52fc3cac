"""The one dry-run convention every host-writing hook uses (hooks/dryrun.py): marked for
explain, one ``hook_dry_run`` log line per report, each target reported once per value."""

from __future__ import annotations

from structlog.testing import capture_logs

from hooks.dryrun import DRY_RUN_SUFFIX, DryRunLedger, patch_reason
from runtimeproxy.hookapi import HostWrite


def test_a_plan_is_marked_logged_once_and_again_only_when_its_value_changes() -> None:
    ledger = DryRunLedger("memory-qos")
    plan = [HostWrite("/c/a/memory.min", "0", "512", "why a"), HostWrite("/c/b/memory.low", "", "9", "why b")]
    with capture_logs() as logs:
        first = ledger.report(plan, pod="ns/p")
        assert ledger.report(plan, pod="ns/p") == ()
        changed = ledger.report([HostWrite("/c/a/memory.min", "0", "1024", "why a"), plan[1]], pod="ns/p")
    assert [(w.new, w.reason) for w in first] == [("512" + DRY_RUN_SUFFIX, "dry-run: why a"),
                                                  ("9" + DRY_RUN_SUFFIX, "dry-run: why b")]
    assert [w.new for w in changed] == ["1024" + DRY_RUN_SUFFIX]
    assert [(e["event"], e["hook"], e["pod"]) for e in logs] == [("hook_dry_run", "memory-qos", "ns/p")] * 2
    assert logs[0]["writes"] == ["/c/a/memory.min: 0 -> 512", "/c/b/memory.low: - -> 9"]
    assert patch_reason("why a") == "dry-run: why a"


def test_the_ledger_is_bounded_and_forgets_the_oldest() -> None:
    ledger = DryRunLedger("blkio", max_entries=2)
    for target in ("a", "b", "c"):
        assert ledger.report([HostWrite(target, "", "1", "r")])
    assert ledger.report([HostWrite("c", "", "1", "r")]) == ()
    assert ledger.report([HostWrite("a", "", "1", "r")])  # forgotten: reported again
