"""The hooks' sections that checked unknown keys by hand (blkioQOS, the NodeSLO rules'
sections, the example hook's args) refuse them with the one toolkit's
``configvalues.reject_unknown``: the key path and the value named, the known keys listed."""

from __future__ import annotations

from typing import Any

import pytest

from hooks.blkiorules import BlkioQOS, parse_blkio_qos
from hooks.example import ExampleCpuShares
from hooks.rules import parse_rules
from runtimeproxy.config import configvalues
from runtimeproxy.config.configvalues import ConfigError
from runtimeproxy.hookapi import HookInit


@pytest.mark.parametrize(("parse", "key_path", "value"), [
    (lambda: parse_blkio_qos({"enable": True, "blockz": []}, "rules.blkioQOS", BlkioQOS()),
     "rules.blkioQOS.blockz", []),
    (lambda: parse_blkio_qos({"blocks": [{"name": "sda", "ioCfg": {"readIops": 5}}]}, "rules.blkioQOS", BlkioQOS()),
     "rules.blkioQOS.blocks[0].ioCfg.readIops", 5),
    (lambda: parse_rules({"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enabel": True}}}}),
     "rules.resourceQOSStrategy.lsClass.cpuQOS.enabel", True),
    (lambda: ExampleCpuShares(HookInit(name="example", args={"cpu_share": 512}, key_path="hooks[0].args")),
     "hooks[0].args.cpu_share", 512),
])
def test_hook_sections_refuse_unknown_keys_with_the_toolkit(parse: Any, key_path: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse()
    assert (info.value.key_path, info.value.value) == (key_path, value)
    assert info.value.message.startswith("unknown key (known: ")
    assert info.traceback[-1].frame.code.raw is configvalues.reject_unknown.__code__
