"""resctrl on a fixture tree with info/: masks, MBA, schemata, groups, tasks, absence."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks.resctrlfs import (
    ResctrlError,
    ResctrlFS,
    ResctrlNotSupported,
    format_schemata,
    is_contiguous,
    parse_schemata,
)


def make_resctrl(root: Path, cbm: str = "fff", mb: bool = True, caches: str = "0,1") -> ResctrlFS:
    (root / "info" / "L3").mkdir(parents=True)
    (root / "info" / "L3" / "cbm_mask").write_text(cbm + "\n")
    (root / "info" / "L3" / "min_cbm_bits").write_text("1\n")
    ids = caches.split(",")
    lines = ["    L3:" + ";".join(f"{i}={cbm}" for i in ids)]
    if mb:
        (root / "info" / "MB").mkdir()
        (root / "info" / "MB" / "bandwidth_gran").write_text("10\n")
        (root / "info" / "MB" / "min_bandwidth").write_text("10\n")
        lines.append("    MB:" + ";".join(f"{i}=100" for i in ids))
    (root / "schemata").write_text("\n".join(lines) + "\n")
    (root / "tasks").write_text("1\n2\n")
    return ResctrlFS(root)


def test_absent_is_reported_not_crashing(tmp_path: Path) -> None:
    fs = ResctrlFS(tmp_path / "resctrl")
    assert not fs.present
    with pytest.raises(ResctrlNotSupported, match="resctrl is not available"):
        fs.build_schemata(0, 30, 100)
    with pytest.raises(ResctrlNotSupported):
        fs.ensure_group("BE")
    assert issubclass(ResctrlNotSupported, ResctrlError)


def test_contiguity() -> None:
    assert is_contiguous(0b1) and is_contiguous(0xFC0) and is_contiguous(0xFFF)
    assert not is_contiguous(0) and not is_contiguous(0xF0F) and not is_contiguous(0b101)


@pytest.mark.parametrize(
    ("start", "end", "mask"),
    [(0, 100, 0xFFF), (0, 30, 0xF), (50, 100, 0xFC0), (10, 50, 0x3C)],
)
def test_l3_mask_like_koordinator(tmp_path: Path, start: int, end: int, mask: int) -> None:
    # ways = 12; startWay = ceil(12*start/100), endWay = ceil(12*end/100)
    assert make_resctrl(tmp_path).l3_mask(start, end) == mask


@pytest.mark.parametrize(("start", "end"), [(30, 30), (50, 10), (-1, 10), (0, 101)])
def test_l3_mask_bad_range(tmp_path: Path, start: int, end: int) -> None:
    with pytest.raises(ResctrlError, match="need 0 <= start < end <= 100"):
        make_resctrl(tmp_path).l3_mask(start, end)


def test_bad_cbm_mask_file(tmp_path: Path) -> None:
    with pytest.raises(ResctrlError, match="not a hex mask"):
        make_resctrl(tmp_path, cbm="zz").cbm_mask()


def test_build_schemata_uses_cache_ids_of_root_schemata(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path, caches="0,2")
    assert fs.cache_ids() == (0, 2)
    assert fs.build_schemata(0, 30, 35) == "L3:0=f;2=f\nMB:0=40;2=40\n"
    assert fs.mb_value(5) == 10 and fs.mb_value(100) == 100


def test_build_schemata_without_mba(tmp_path: Path) -> None:
    assert make_resctrl(tmp_path, mb=False).build_schemata(0, 100, 50) == "L3:0=fff;1=fff\n"


def test_parse_and_format_schemata() -> None:
    parsed = parse_schemata("L3:0=ff;1=f0\n\nMB:0=100;1=50\n")
    assert parsed == {"L3": {0: "ff", 1: "f0"}, "MB": {0: "100", 1: "50"}}
    assert format_schemata(parsed) == "L3:0=ff;1=f0\nMB:0=100;1=50\n"
    with pytest.raises(ResctrlError, match="not '<resource>:"):
        parse_schemata("garbage")
    with pytest.raises(ResctrlError, match="not '<cache id>=<value>'"):
        parse_schemata("L3:x=ff")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("L3:0=f0f", "not contiguous"),
        ("L3:0=0", "empty or not contiguous"),
        ("L3:0=1000", "outside cbm_mask"),
        ("L3:0=zz", "not hex"),
        ("L3:5=f", "cache id 5 does not exist"),
        ("MB:0=0", "must be 1..100"),
        ("MB:0=abc", "must be 1..100"),
        ("L2:0=f", "not supported"),
    ],
)
def test_validate_schemata(tmp_path: Path, text: str, fragment: str) -> None:
    fs = make_resctrl(tmp_path)
    with pytest.raises(ResctrlError, match=fragment) as info:
        fs.validate_schemata(text, "annotation node.koordinator.sh/resctrl of pod a/b")
    assert "pod a/b" in str(info.value)


def test_groups_schemata_and_tasks(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path)
    assert fs.ensure_group("BE") is True
    assert fs.ensure_group("BE") is False
    schemata = fs.build_schemata(0, 30, 100)
    first = fs.write_schemata("BE", schemata, "beClass resctrlQOS")
    assert first.changed and (tmp_path / "BE" / "schemata").read_text() == schemata
    assert first.target_path == (tmp_path / "BE" / "schemata").resolve()
    # the kernel shows the full schemata; our entries already hold -> no rewrite
    (tmp_path / "BE" / "schemata").write_text("    L3:0=00f;1=00f\n    MB:0=100;1=100\n")
    second = fs.write_schemata("BE", schemata, "again")
    assert not second.changed
    tasks = fs.add_tasks("BE", [10, 11, 10], "new pids")
    assert tasks.changed and tasks.new == "10 11"
    assert (tmp_path / "BE" / "tasks").read_text() == "10\n11\n"
    again = fs.add_tasks("BE", [11], "again")
    assert not again.changed and again.new == ""
    with pytest.raises(ResctrlError, match="invalid pid"):
        fs.add_tasks("BE", [12, 0], "bad")
    assert (tmp_path / "BE" / "tasks").read_text() == "10\n11\n"  # checked before any write


def test_remove_group(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path)
    fs.ensure_group("koordlet-pod1")
    assert fs.remove_group("koordlet-pod1") is True
    assert fs.remove_group("koordlet-pod1") is False


def test_schemata_invalid_writes_nothing(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path)
    fs.ensure_group("LS")
    with pytest.raises(ResctrlError, match="not contiguous"):
        fs.write_schemata("LS", "L3:0=f0f;1=f\n", "annotation")
    assert not (tmp_path / "LS" / "schemata").exists()


def test_write_to_missing_group(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path)
    with pytest.raises(ResctrlError, match="does not exist"):
        fs.write_schemata("LSR", "L3:0=f", "r")


@pytest.mark.parametrize("name", ["../x", "info", "mon_groups", "a/b", "", ".hidden", "a..b"])
def test_group_names_confined(tmp_path: Path, name: str) -> None:
    fs = make_resctrl(tmp_path / "resctrl")
    with pytest.raises(ResctrlError, match="not allowed"):
        fs.ensure_group(name)
    assert not (tmp_path / "x").exists()


def test_group_symlink_escape(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path / "resctrl")
    (tmp_path / "outside").mkdir()
    (tmp_path / "resctrl" / "evil").symlink_to(tmp_path / "outside")
    with pytest.raises(ResctrlError, match="outside the root"):
        fs.write_schemata("evil", "L3:0=f", "r")
    assert list((tmp_path / "outside").iterdir()) == []
