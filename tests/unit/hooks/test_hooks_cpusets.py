"""CPU list parsing, formatting and checking against the node's online CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks.cpusets import (
    CpuListError,
    check_on_node,
    format_cpu_list,
    parse_cpu_list,
    parse_node_cpu_list,
    read_online_cpus,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("5", {5}),
        ("2-2", {2}),
        ("", set()),
        ("  \n", set()),
        ("0-1\n", {0, 1}),
        ("3,1,2", {1, 2, 3}),
    ],
)
def test_parse(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("3-1", "reversed"),
        ("a", "'a' is not a CPU number"),
        ("1,,2", "empty element"),
        ("1,", "empty element"),
        (",1", "empty element"),
        ("0-99999", "beyond the kernel limit"),
        ("0-7:2/4", "not a CPU number"),
        ("-1", "not a CPU number"),
        ("1 ,2", "not a CPU number"),
        ("0-", "not a CPU number"),
    ],
)
def test_parse_errors_name_the_list(text: str, fragment: str) -> None:
    with pytest.raises(CpuListError, match=fragment) as info:
        parse_cpu_list(text)
    assert repr(text) in str(info.value)


def test_huge_range_is_rejected_without_building_it() -> None:
    with pytest.raises(CpuListError, match="beyond the kernel limit"):
        parse_cpu_list("0-999999999999999")


@pytest.mark.parametrize(
    ("cpus", "text"),
    [({0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"), (set(), ""), ({7}, "7"), ([3, 1, 2, 2], "1-3"), ({0, 2, 4}, "0,2,4")],
)
def test_format(cpus: set[int], text: str) -> None:
    assert format_cpu_list(cpus) == text


def test_round_trip() -> None:
    for text in ("0-3,8,10-11", "1", "0,2-5,7"):
        assert format_cpu_list(parse_cpu_list(text)) == text


def _sys(tmp_path: Path, online: str) -> Path:
    cpu = tmp_path / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(online)
    return tmp_path / "sys"


def test_online_cpus_from_injected_sys_root(tmp_path: Path) -> None:
    assert read_online_cpus(_sys(tmp_path, "0-3,6\n")) == {0, 1, 2, 3, 6}


def test_online_cpus_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(CpuListError, match="cannot read the node's online CPUs"):
        read_online_cpus(tmp_path)


def test_online_cpus_empty_file(tmp_path: Path) -> None:
    with pytest.raises(CpuListError, match="no online CPUs"):
        read_online_cpus(_sys(tmp_path, "\n"))


def test_check_on_node_names_missing_cpus(tmp_path: Path) -> None:
    online = read_online_cpus(_sys(tmp_path, "0-3\n"))
    assert parse_node_cpu_list("1-2", online) == {1, 2}
    with pytest.raises(CpuListError, match=r"names CPUs 4-5 that are not online on this node \(online: 0-3\)"):
        parse_node_cpu_list("2-5", online)
    with pytest.raises(CpuListError, match="not online"):
        check_on_node(frozenset({9}), online, "9")
