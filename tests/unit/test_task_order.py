"""Tasks declare what they build on as data (``needs`` / ``after``); the core builds them
in that order and hands each what its dependencies provided (``init.needed``), so the
order under ``tasks:`` never matters and nothing is shared through a process-wide map."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.state.store import Store

ORDER_MODULE = '''
BUILT = []
VALIDATED = []


def _run():
    async def run():
        return None
    return run


def producer(init):
    made = {"by": init.name, "n": len(BUILT)}
    init.provide(made)
    BUILT.append((init.name, made))
    return _run()


def _validate_producer(init):
    init.provide("producer settings")


producer.validate = _validate_producer


def consumer(init):
    BUILT.append((init.name, dict(init.needed)))
    return _run()


def _validate_consumer(init):
    VALIDATED.append(dict(init.needed))


consumer.validate = _validate_consumer
consumer.needs = (__name__ + ":producer",)


def optional(init):
    BUILT.append((init.name, dict(init.needed)))
    return _run()


optional.after = (__name__ + ":producer",)


def loop_a(init):
    return _run()


def loop_b(init):
    return _run()


loop_a.needs = (__name__ + ":loop_b",)
loop_b.needs = (__name__ + ":loop_a",)
'''


@pytest.fixture
def mod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    name = f"krp_order_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(ORDER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module(name)


def _build(tasks: dict[str, Any]) -> list[str]:
    settings = config.from_mapping({"tasks": tasks})
    return [name for name, _ in plugins.build_tasks(settings, plugins.task_base(Store().snapshot))]


@pytest.mark.parametrize("consumer_first", [True, False], ids=["consumer-first", "producer-first"])
def test_a_task_gets_what_the_task_it_needs_provided_in_either_order(mod: Any, consumer_first: bool) -> None:
    producer, consumer = f"{mod.__name__}:producer", f"{mod.__name__}:consumer"
    tasks = {consumer: {}, producer: {}} if consumer_first else {producer: {}, consumer: {}}
    assert _build(tasks) == [producer, consumer]  # built after what it needs, whatever the YAML order
    (_, made), (_, needed) = mod.BUILT
    assert needed == {producer: made}
    # validate pass: what the producer's validate provided, not what a build made
    assert mod.VALIDATED == [{producer: "producer settings"}]


def test_each_pass_has_its_own_provided_objects(mod: Any) -> None:
    producer, consumer = f"{mod.__name__}:producer", f"{mod.__name__}:consumer"
    _build({consumer: {}, producer: {}})
    _build({consumer: {}, producer: {}})
    first, second = mod.BUILT[0][1], mod.BUILT[2][1]
    assert first != second
    assert mod.BUILT[3][1] == {producer: second}  # the second build's consumer: the second producer


def test_a_needed_task_that_is_not_enabled_is_a_config_error_naming_the_task(mod: Any) -> None:
    consumer = f"{mod.__name__}:consumer"
    with pytest.raises(config.ConfigError) as err:
        _build({consumer: {}, f"{mod.__name__}:producer": {"enabled": False}})
    assert err.value.key_path == f"tasks.{consumer}"
    assert f"needs the {mod.__name__}:producer task" in str(err.value)


def test_after_orders_without_requiring(mod: Any) -> None:
    optional, producer = f"{mod.__name__}:optional", f"{mod.__name__}:producer"
    assert _build({optional: {}}) == [optional]
    assert mod.BUILT == [(optional, {})]
    mod.BUILT.clear()
    assert _build({optional: {}, producer: {}}) == [producer, optional]
    assert mod.BUILT[1] == (optional, {producer: mod.BUILT[0][1]})


def test_tasks_needing_each_other_are_refused(mod: Any) -> None:
    with pytest.raises(config.ConfigError) as err:
        _build({f"{mod.__name__}:loop_a": {}, f"{mod.__name__}:loop_b": {}})
    assert "cycle" in str(err.value)


QOS_FIRST = {"qos-manager": {"evict_mode": "api"}, "interference": {}, "metrics": {"kube": True}}


def test_check_config_accepts_the_qos_manager_listed_before_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped tasks: the QoS manager and the analyser need the metrics task (its
    validated settings here: evict_mode api needs its kube), listed in any order."""
    from runtimeproxy import cli

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"hookserver_dir": "", "tasks": QOS_FIRST}, sort_keys=False))
    assert cli.main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tasks: qos-manager, interference, metrics" in out.splitlines()  # reported in YAML order


def test_cross_task_rules_still_hold_in_either_order(tmp_path: Path) -> None:
    settings = config.from_mapping({"tasks": {"qos-manager": {"evict_mode": "api"}, "metrics": {}}})
    with pytest.raises(config.ConfigError) as err:
        plugins.validate_tasks(settings)
    assert err.value.key_path == "tasks.qos-manager.evict_mode"  # metrics has no kube
