"""`forensics demo` end to end: the default scenario trains, is captured, replayed and reported in plain words."""

from __future__ import annotations

import json

import pytest

import forensics.demo
from forensics.demo.run import DEFAULT_SCENARIO, SCENARIOS, UnknownScenarioError, run_demo
from forensics.recipes import is_builtin


def test_default_demo_end_to_end(tmp_path):
    (expected_id,) = SCENARIOS[DEFAULT_SCENARIO].capture(tmp_path / "reference").expected.samples
    lines: list[str] = []
    report, report_dir = run_demo(DEFAULT_SCENARIO, tmp_path / "demo", "cpu", echo=lines.append)

    assert DEFAULT_SCENARIO == "bad_sample"
    assert report["verdict"]["kind"] == "bad_sample"
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [expected_id]
    assert report["culprit"]["module"] == "transformer.h.0.ln_1"
    assert report["reproduced"] and report["fidelity"]["bitwise_equal"]
    for name in ("report.json", "report.md", "report.html", "blocklist.jsonl"):
        assert (report_dir / name).is_file(), name
    on_disk = json.loads((report_dir / "report.json").read_text(encoding="utf-8"))
    assert on_disk["verdict"]["kind"] == "bad_sample"
    assert [json.loads(line) for line in (report_dir / "blocklist.jsonl").read_text().splitlines()] == [expected_id]
    assert expected_id in (report_dir / "report.md").read_text(encoding="utf-8")
    assert_the_verdict_box_says_each_thing_once(report, report_dir)

    text = "\n".join(lines)
    assert "step  5" in text  # training progress before the fault
    assert "dump written to" in text  # what the Guard said
    assert "bisecting 8 samples" in text  # replay progress
    assert "Verdict: bad sample" in text and expected_id in text
    dump_dirs = list((tmp_path / "demo" / "dumps").glob("*/step-*/rank-*"))
    assert len(dump_dirs) == 1 and dump_dirs[0].name == "rank-00000"


def test_second_demo_into_the_same_folder_gets_its_own_dump(tmp_path):
    scenario = SCENARIOS["log_zero"]
    first = scenario.capture(tmp_path)
    second = scenario.capture(tmp_path)
    assert first.dump_path != second.dump_path
    assert first.dump_path.name == second.dump_path.name == "rank-00000"


def test_unknown_scenario_names_the_valid_ones(tmp_path):
    with pytest.raises(UnknownScenarioError, match="bad_sample"):
        run_demo("no_such_scenario", tmp_path, "cpu", echo=lambda _line: None)


def test_catalogue_has_one_line_descriptions():
    assert set(SCENARIOS) == {
        "bad_sample",
        "log_zero",
        "fp16_overflow",
        "adam_eps_zero",
        "pair",
        "sdc",
        "dropout_mask",
        "spike",
    }
    for name, scenario in SCENARIOS.items():
        assert scenario.name == name
        assert scenario.description and "\n" not in scenario.description and len(scenario.description) < 100


def test_the_cli_knows_every_scenario_by_name():
    from forensics.demo import SCENARIO_NAMES

    assert SCENARIO_NAMES == tuple(SCENARIOS)


def test_the_static_allow_list_names_exactly_the_demo_recipes():
    from forensics.recipes import BUILTIN_RECIPES, DEMO_MODELS

    assert forensics.demo.models.RECIPES
    assert {p for p in BUILTIN_RECIPES if p.startswith(DEMO_MODELS + ":")} == set(forensics.demo.models.RECIPES)
    for path in forensics.demo.models.RECIPES:
        assert is_builtin(path) and callable(getattr(forensics.demo.models, path.split(":")[1]))
    assert not is_builtin("forensics.demo.scenarios:train")
    assert not is_builtin("forensics.demo.models:torch")


def assert_the_verdict_box_says_each_thing_once(report, report_dir):
    """Issue 42 item 8: report.html's verdict box (and report.md's) gives each fact once: the bullets with their
    numbers, then only what the verdict's explanation adds (nothing twice, word for word or on the same topic)."""
    import html
    import re

    page = (report_dir / "report.html").read_text(encoding="utf-8")
    box = page.split('<section id="verdict"', 1)[1].split("</section>", 1)[0]
    text = html.unescape(re.sub(r"<[^>]+>", " ", box))
    sentences = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if s.strip()]
    repeated = {s for s in sentences if sentences.count(s) > 1}
    assert not repeated, repeated
    for topic in ("The learning rate was", "clipping: not recorded", "Reproduced", "Culprit", "fails from"):
        assert text.count(topic) <= 1, topic
    assert "Culprit" in text and "Reproduced" in text and report["verdict"]["headline"].split(" ")[0] in text
    facts = text.split("Suggested next steps")[0]  # the evidence paragraph keeps only what the bullets do not say
    assert facts.count("the other samples' largest") == 1, facts
