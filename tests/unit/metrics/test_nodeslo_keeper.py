"""The last good NodeSLO (issue 28 item 6): a bad update keeps it, it is persisted in
state_dir (0600) and restored at start, a deletion forgets it."""

from __future__ import annotations

import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metrics.informer.nodeslo import FILE_NAME, NodeSLOKeeper
from runtimeproxy.hookapi import HookConfigError

GOOD = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": False}}}}
BAD = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": False, "groupIdentity": 7}}}}
YAML = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "groupIdentity": -1}}}}


class Sink:
    def __init__(self) -> None:
        self.applied: list[Mapping[str, Any] | None] = []
        self.rejected: list[tuple[str, str]] = []

    def apply(self, spec: Mapping[str, Any] | None, overlay: Mapping[str, Any] | None) -> None:
        self.applied.append(overlay)

    def reject(self, exc: HookConfigError, applied: str) -> None:
        self.rejected.append((exc.key_path, applied))


def test_a_bad_update_keeps_the_last_good_one_across_a_restart(tmp_path: Path) -> None:
    sink = Sink()
    keeper = NodeSLOKeeper(YAML, tmp_path / "state", sink.apply, sink.reject)
    assert not keeper.restore()
    keeper.update(GOOD)
    saved = tmp_path / "state" / FILE_NAME
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    keeper.update(BAD)
    assert sink.applied == [GOOD]  # nothing applied for the bad one: the good one stays
    assert sink.rejected == [("nodeslo.spec.resourceQOSStrategy.beClass.cpuQOS.groupIdentity", "last good NodeSLO")]
    assert keeper.explain()["rejected"]["key"].endswith("groupIdentity")
    # A restart while the cluster's NodeSLO is still bad: the last good one from the start.
    again = Sink()
    restarted = NodeSLOKeeper(YAML, tmp_path / "state", again.apply, again.reject)
    assert restarted.restore() and again.applied == [GOOD]
    restarted.update(BAD)
    assert again.applied == [GOOD] and again.rejected[0][1] == "last good NodeSLO"
    restarted.update(None)  # deleted in the cluster: forgotten, the YAML applies
    assert again.applied[-1] is None and not saved.exists()


def test_a_first_bad_nodeslo_leaves_the_yaml_and_a_garbled_file_is_ignored(tmp_path: Path) -> None:
    sink = Sink()
    (tmp_path / FILE_NAME).write_text("{not json")
    keeper = NodeSLOKeeper(YAML, tmp_path, sink.apply, sink.reject)
    assert not keeper.restore() and sink.applied == []
    keeper.update(BAD)
    assert sink.rejected[0][1] == "yaml rules" and sink.applied == []
