"""The NodeSLO preview's document handling (``metrics.qos.preview``): the wire encoding,
a NodeSLO object or a bare spec, and refusals naming the field as the agent's watch does."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrics.qos import preview


def test_encoding_round_trips_and_fits_a_typical_nodeslo_in_the_request_head() -> None:
    doc = {"apiVersion": "slo.koordinator.sh/v1alpha1", "kind": "NodeSLO", "metadata": {"name": "n"},
           "spec": {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 65}}}
    text = preview.encode(doc)
    assert preview.decode(text) == doc
    assert len(text) < 1024


@pytest.mark.parametrize(("doc", "message"), [
    ({"kind": "Node", "spec": {}}, "kind: not a NodeSLO (got 'Node')"),
    ({"kind": "NodeSLO", "spec": []}, "spec: must be a mapping"),
])
def test_spec_of_refuses_what_is_not_a_nodeslo(doc: dict[str, object], message: str) -> None:
    with pytest.raises(preview.PreviewError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preview.spec_of(doc)


def test_a_bare_spec_is_taken_as_is() -> None:
    assert preview.spec_of({"cpuBurstStrategy": {"policy": "none"}}) == {"cpuBurstStrategy": {"policy": "none"}}


def test_garbage_is_refused() -> None:
    with pytest.raises(preview.PreviewError, match="not an encoded JSON document"):
        preview.decode("!!!")


def test_candidate_rules_merge_over_the_yaml_and_refuse_with_the_field() -> None:
    yaml_rules = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 65}}
    overlay, rules = preview.candidate_rules({"cpuBurstStrategy": {"policy": "cpuBurstOnly"}}, yaml_rules)
    assert overlay == {"cpuBurstStrategy": {"policy": "cpuBurstOnly"}}
    assert rules.cpu_burst_strategy.policy == "cpuBurstOnly"
    assert rules.resource_used_threshold_with_be.cpu_suppress_threshold_percent == 65
    with pytest.raises(preview.PreviewError) as err:
        preview.candidate_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 50,
                                                                 "cpuSuppressMinPercent": 60}}, {})
    assert str(err.value).startswith("nodeslo.spec.resourceUsedThresholdWithBE.cpuSuppressMinPercent: ")


def test_plan_command_exit_codes_without_an_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """1: nothing answers at the endpoint; 2: the file is not a NodeSLO document."""
    from runtimeproxy import cli

    doc = tmp_path / "nodeslo.yaml"
    doc.write_text("spec: {}\n")
    assert cli.main(["plan", "--nodeslo", str(doc), "--endpoint", "127.0.0.1:1"]) == 1
    assert "cannot reach the agent at http://127.0.0.1:1/debug/plan" in capsys.readouterr().err
    doc.write_text("- a list\n")
    assert cli.main(["plan", "--nodeslo", str(doc), "--endpoint", "127.0.0.1:1"]) == 2
    assert "not a mapping" in capsys.readouterr().err
