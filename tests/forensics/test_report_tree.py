"""The report as a dataclass tree (forensics/report/tree.py) and the typed trigger after the dump: one parser that
never raises, a serialisation that gives back the same JSON byte for byte, and `Dump.trigger` as a Trigger."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from forensics.core.kinds import TriggerKind, VerdictKind
from forensics.report import to_json_safe
from forensics.report.tree import Report, TriggerBlock, parse_report
from forensics.report.write import report_json_text
from forensics.core.trigger import Trigger

sys.path.insert(0, str(Path(__file__).parent))
from report_factory import make_report


def _text(d: dict) -> str:
    return json.dumps(d, ensure_ascii=False)


@pytest.mark.parametrize("kind", list(VerdictKind))
def test_every_kind_of_report_reads_into_the_tree_and_writes_back_the_same_json(kind):
    report = to_json_safe(make_report(kind.value))
    tree = parse_report(report)
    assert isinstance(tree, Report) and tree.verdict.kind == kind and tree.dump.step == 41217
    assert _text(tree.as_dict()) == _text(report)
    assert report_json_text(tree) == report_json_text(report)


def test_keys_it_does_not_know_and_sections_of_the_wrong_type_are_kept_as_they_came():
    report = to_json_safe(make_report("bad_sample"))
    report["from_a_newer_writer"] = {"x": [1, 2]}
    report["culprit"]["samples"].insert(0, "not an object")
    report["culprit"]["stats"] = "odd"
    report["precision"] = None
    report["verdict"] = {"suggestions": ["a"], "headline": "h", "kind": "bad_sample", "new": 1}  # another order
    tree = parse_report(report)
    assert _text(tree.as_dict()) == _text(report)
    assert [s.sample_id for s in tree.culprit.samples] == ["shard-0192/rec-55415"]  # only the objects are read
    assert tree.culprit.stats.inputs_absmax is None and tree.precision is None and tree.verdict.extra == {"new": 1}


def test_a_field_set_in_code_is_written_and_an_absent_key_stays_absent():
    report = to_json_safe(make_report("not_reproduced"))
    del report["timings"]
    tree = parse_report(report)
    assert "timings" not in tree.as_dict() and tree.timings is None
    tree.verdict.suggestions.append("one more")
    tree.history.signals = ["grew"]
    out = tree.as_dict()
    assert out["verdict"]["suggestions"][-1] == "one more" and out["history"]["signals"] == ["grew"]


def test_parsing_never_raises_on_junk():
    rng = random.Random(0)
    junk = [None, 3, "x", [], [None, 1], {"a": 1}, math.nan, True]
    base = to_json_safe(make_report("bad_sample"))
    for _ in range(200):
        report = json.loads(json.dumps(base))
        section = rng.choice(list(report))
        if isinstance(report[section], dict) and report[section] and rng.random() < 0.5:
            report[section][rng.choice(list(report[section]))] = rng.choice(junk)
        else:
            report[section] = rng.choice(junk)
        tree = parse_report(report)
        assert _text(tree.as_dict()) == _text(report)
    assert parse_report("not a report").as_dict() == {}


def test_the_trigger_block_has_one_builder_and_the_trigger_reads_junk_as_missing():
    trigger = Trigger(TriggerKind.LOSS_SPIKE, 87234.5, 20.0, 0, "loss of micro-batch 0 is 8.7e4", local=False)
    assert TriggerBlock.of(trigger).as_dict() == {
        "kind": "loss_spike",
        "value": 87234.5,
        "threshold": 20.0,
        "micro_batch": 0,
        "detail": "loss of micro-batch 0 is 8.7e4",
    }
    assert trigger.message == "loss of micro-batch 1 is 8.7e4"
    odd = Trigger.from_dict(
        {
            "kind": "nonfinite_grad",
            "value": "1e999x",
            "threshold": [1],
            "micro_batch": True,
            "detail": None,
            "local": "no",
            "update_change": 10**400,
        }
    )
    assert odd == Trigger(TriggerKind.NONFINITE_GRAD, None, None, None, "", True, None)
    assert Trigger.from_dict(["not", "a", "mapping"]).kind is TriggerKind.NONFINITE_LOSS
    with pytest.raises(ValueError, match="unknown TriggerKind"):
        Trigger.from_dict({"kind": "bogus"})


def test_dump_trigger_is_typed_and_dict_reads_still_work_deprecated(helpers, tmp_path):
    from forensics.format import open_dump

    dump = open_dump(helpers.write_synthetic_dump(tmp_path))
    assert isinstance(dump.trigger, Trigger) and dump.trigger.kind in TriggerKind
    with pytest.warns(
        DeprecationWarning, match=r"Dump\.trigger is a forensics\.core\.trigger\.Trigger: read trigger\.kind"
    ):
        assert dump.trigger["kind"] == dump.trigger.kind
    with pytest.warns(
        DeprecationWarning, match=r"Dump\.trigger is a forensics\.core\.trigger\.Trigger: read its attributes"
    ):
        assert dump.trigger.get("local") is dump.trigger.local
