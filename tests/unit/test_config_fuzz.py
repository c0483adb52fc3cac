"""Property: the config file parser, given arbitrary or mutated documents, yields a
Settings value or the documented ConfigError naming the field, never another exception
(issue 14: every parser of untrusted input). Mutations start from the shipped default
and delete, retype, replace and add keys and values anywhere in the tree; what ``run``
validates beyond the file (each task's own args, through the one task validator) is
included (hooks built, tasks validated). Nothing is written but the test's own files."""

from __future__ import annotations

import ast
import copy
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.config.settings import ConfigError, Settings
from tests import tmpnames

FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["0660", "0777", "1s", "-1s", "500ms", "0", "Fail", "Ignore", "127.0.0.1:9316", "0.0.0.0:1",
                     "unix:///x.sock", "/abs/path", "../up", "PreRunPodSandbox", "true", "", "1e999", "0x10"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=tmpnames.TMP, prefix=tmpnames.PREFIX + "fuzz-") as name:
        yield Path(name)


def _key_named(err: ConfigError, doc: object) -> None:
    """The error is the documented one: it starts with a key path that names the file,
    the root, or a key that is in the document (or one the parser reads by default)."""
    assert err.key_path and str(err).startswith(f"{err.key_path}: ")
    quoted = re.match(r"""^('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""", err.key_path)
    head = ast.literal_eval(quoted[1]) if quoted else re.split(r"[.\[]", err.key_path, maxsplit=1)[0]
    if head in ("--config", "<root>"):
        return
    assert isinstance(doc, dict)
    assert head in doc or head in {"socket_mode", "metrics", "listen"}, (err.key_path, doc)


def _check(doc_text: str, doc: object, workdir: Path) -> None:
    path = workdir / "config.yaml"
    path.write_text(doc_text, encoding="utf-8")
    try:
        parsed = config.load(path, {"hookserver_dir": ""})
        assert isinstance(parsed, Settings)
        plugins.validate(parsed)  # what run validates beyond the file: hooks built, tasks validated
    except ConfigError as err:
        _key_named(err, doc)


TRICKY_YAML = [
    "listen: 2001-13-45\n",  # a timestamp that is no date: ValueError inside PyYAML
    "[" * 3000,  # RecursionError inside PyYAML
    "rules: &x {a: *x}\n",  # a loop through an alias
    "tasks: {metrics: &x {tiers: *x}}\n",
    "hooks: &h [*h]\n",
    "a: !!python/object:os.system x\n",
    "{[1]: 2}\n",
    "socket_mode: .inf\n",
    "shutdown_grace: .inf\n",
    "hooks: [{name: x, plugin: example-cpu-shares, timeout: .nan}]\n",
]


@pytest.mark.parametrize("text", TRICKY_YAML)
def test_tricky_yaml_is_a_config_error(text: str, workdir: Path) -> None:
    path = workdir / "tricky.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert err.value.key_path


@FUZZ
@given(text=st.one_of(st.text(max_size=200), st.sampled_from([t for t in TRICKY_YAML if len(t) < 100])))
def test_arbitrary_text(text: str, workdir: Path) -> None:
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):  # the parser must turn these into ConfigError
        doc = None
    _check(text, doc, workdir)


@FUZZ
@given(doc=st.one_of(VALUES, st.dictionaries(st.sampled_from(sorted(config._TOP_KEYS)), VALUES, max_size=6)))
def test_arbitrary_documents(doc: Any, workdir: Path) -> None:
    _check(yaml.safe_dump(doc), doc, workdir)


def _slots(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) in the tree, to mutate in place."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        out.append((node, key))
        _slots(value, out)
    return out


@st.composite
def mutated_default(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(config.builtin_default())
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        slots = _slots(doc, [])
        if not slots:
            break
        parent, key = draw(st.sampled_from(slots))
        old = parent[key]
        action = draw(st.sampled_from(["delete", "replace", "stringify", "wrap-list", "wrap-dict", "add-key",
                                       "negate", "empty"]))
        if action == "delete":
            del parent[key]
        elif action == "replace":
            parent[key] = draw(VALUES)
        elif action == "stringify":
            parent[key] = str(old)
        elif action == "wrap-list":
            parent[key] = [old]
        elif action == "wrap-dict":
            parent[key] = {"x": old}
        elif action == "add-key" and isinstance(old, dict):
            old[draw(st.text(max_size=10))] = draw(VALUES)
        elif action == "negate" and isinstance(old, int | float) and not isinstance(old, bool):
            parent[key] = -old
        elif action == "empty":
            parent[key] = type(old)() if isinstance(old, str | list | dict) else None
    return doc


@FUZZ
@given(doc=mutated_default())
def test_mutated_shipped_default(doc: dict[str, Any], workdir: Path) -> None:
    _check(yaml.safe_dump(doc), doc, workdir)


def test_the_unmutated_default_is_valid(workdir: Path) -> None:
    _check(config.builtin_default_text(), config.builtin_default(), workdir)
    assert config.load(workdir / "config.yaml").hooks  # the check above wrote the shipped text
