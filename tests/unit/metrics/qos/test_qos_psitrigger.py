"""PSI triggers: spec checks, the real /proc/pressure/cpu answer, report-once, wake-up plumbing."""

from __future__ import annotations

import asyncio
import errno
import socket
from pathlib import Path

import pytest

from metrics.qos.psitrigger import PsiTrigger, PsiTriggers, TriggerSpec, TriggerSpecError, open_trigger

PROC_CPU = Path("/proc/pressure/cpu")


def test_spec_parse_line_and_limits() -> None:
    spec = TriggerSpec.parse("some 150000 1000000")
    assert spec == TriggerSpec("some", 150_000, 1_000_000)
    assert spec.line() == b"some 150000 1000000\0"  # the kernel overwrites the last byte written
    for bad in ("some 150000", "half 1 1000000", "some 0 1000000", "some 2000000 1000000", "some 1 400000",
                "full 1 20000000", "some x 1000000"):
        with pytest.raises(TriggerSpecError):
            TriggerSpec.parse(bad)


@pytest.mark.parametrize(
    ("spec", "widened"),
    [(TriggerSpec("some", 150_000, 1_000_000), TriggerSpec("some", 300_000, 2_000_000)),
     (TriggerSpec("full", 100_000, 2_500_000), TriggerSpec("full", 160_000, 4_000_000)),
     (TriggerSpec("some", 150_000, 2_000_000), None),
     (TriggerSpec("some", 100_000, 9_500_000), TriggerSpec("some", 105_263, 10_000_000))],
)
def test_widened_keeps_the_stall_ratio_on_a_2s_multiple(spec: TriggerSpec, widened: TriggerSpec | None) -> None:
    assert spec.widened() == widened


@pytest.mark.skipif(not PROC_CPU.exists(), reason="no PSI on this kernel")
def test_real_proc_pressure_refuses_a_1s_window_here() -> None:
    trigger = open_trigger(PROC_CPU, TriggerSpec(), widen_unprivileged=False)
    if trigger.enabled:
        assert trigger.fd is not None
        import os

        os.close(trigger.fd)
        pytest.skip("this host accepts 1 s windows (CAP_SYS_RESOURCE)")
    assert trigger.errno == errno.EINVAL
    assert trigger.reason.startswith("EINVAL")
    assert trigger.fd is None


@pytest.mark.skipif(not PROC_CPU.exists(), reason="no PSI on this kernel")
def test_real_proc_pressure_accepts_the_widened_window() -> None:
    triggers = PsiTriggers()
    try:
        trigger = triggers.register(PROC_CPU)
        refused = open_trigger(PROC_CPU, TriggerSpec(), widen_unprivileged=False)
        if refused.enabled:
            pytest.skip("privileged host: no widening needed")
        assert trigger.enabled and trigger.spec == TriggerSpec("some", 300_000, 2_000_000)
        assert "widened" in trigger.reason
    finally:
        triggers.close()


def test_unavailable_path_is_reported_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    triggers = PsiTriggers()
    missing = tmp_path / "cpu.pressure"
    first, second = triggers.register(missing), triggers.register(missing)
    assert not first.enabled and first.errno == errno.ENOENT and second == first
    assert capsys.readouterr().out.count("psi_trigger_unavailable") == 1
    loop = asyncio.new_event_loop()
    try:
        assert not triggers.start(loop, lambda: None)  # nothing to watch
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_a_priority_event_wakes_the_callback() -> None:
    # A unix socket's out-of-band byte raises POLLPRI, as a firing PSI trigger does.
    writer, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    triggers = PsiTriggers()
    triggers.triggers.append(PsiTrigger(Path("fixture"), TriggerSpec(), reader.detach()))
    fired = asyncio.Event()
    assert triggers.start(asyncio.get_running_loop(), fired.set)
    try:
        await asyncio.sleep(0.05)
        assert not fired.is_set()
        writer.send(b"!", socket.MSG_OOB)
        await asyncio.wait_for(fired.wait(), 5)
        assert triggers.fired >= 1  # OOB data stays pending (PSI events reset on poll)
    finally:
        triggers.close()
        writer.close()
