"""Hostile values in a dump's JSON files, sizes a dump asks the replay to build, and the smaller faults of the fifth
attack round (issue 43, items 3 to 7): each must end in a normal report or a one-line exit 2, never a traceback
(exit 1), never more than a GiB or a minute. tests/forensics/test_hostile.py holds the earlier rounds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from forensics_test_helpers import edit_manifest, resign

from forensics.cli import main
from forensics.demo.scenarios import SCENARIOS
from forensics.format import spec
from forensics.core.kinds import ExitCode

REPLAY = ["--device", "cpu", "--no-bisect", "--no-rng-check"]


def run(args: list):
    """`forensics ARGS` in-process; returns the click Result (never raises)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def assert_exit(result, code: int) -> None:
    assert result.exit_code == code, (
        result.exit_code,
        result.stdout[-2000:],
        result.stderr[-2000:],
        repr(result.exception),
    )
    if code == ExitCode.BAD_INPUT:  # one line saying why, after the progress lines
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("Error:") and sum(line.startswith("Error:") for line in lines) == 1, result.stderr
        assert "Traceback" not in result.stderr + result.stdout, result.stderr


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return SCENARIOS["bad_sample"].capture(tmp_path_factory.mktemp("values"), device="cpu").dump_path


@pytest.fixture
def dump(pristine, tmp_path) -> Path:
    """A fresh copy of a real, replayable rank dump, alone in its run directory."""
    copy = tmp_path / "dumps" / "run" / f"step-{int(pristine.parent.name[5:]):09d}" / "rank-00000"
    shutil.copytree(pristine, copy)
    return copy


def flat_table(steps: int = 12, **overrides) -> dict:
    """precursors.json of a job whose statistics stayed flat (nothing grew), as the monitor writes it."""
    table = {
        "columns": [
            {"layer": "transformer.h.0", "statistic": "block_absmax"},
            {"layer": "transformer.h.1", "statistic": "block_absmax"},
        ],
        "steps": list(range(steps)),
        "values": [[1.0 + 0.01 * (s % 3), 2.0] for s in range(steps)],
        "firings": [],
        "config": {
            "every": 1,
            "window": 4,
            "warmup": 4,
            "sustained": 2,
            "z_threshold": 6.0,
            "min_growth": 2.0,
            "head_dim": None,
        },
    }
    table.update(overrides)
    return table


def with_precursors(dump: Path, table: dict) -> None:
    resign(dump, spec.PRECURSORS, json.dumps(table).encode())


# -- item 5: precursors on, a sudden NaN, nothing grew, no earlier dump --------------------------------------------
def test_a_crash_dump_whose_statistics_did_not_grow_and_no_earlier_dump_is_reported(dump, tmp_path):
    with_precursors(dump, flat_table())
    result = run(["replay", dump, "--out", tmp_path / "out", *REPLAY])
    assert result.exit_code in (ExitCode.OK, ExitCode.NO_CULPRIT), (result.stderr[-2000:], repr(result.exception))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["precursor_history"]["earlier_dumps"] == [] and report["precursor_history"]["lead"] is None
    assert "None" not in report["verdict"]["explanation"]


def test_a_sibling_step_directory_whose_name_ends_in_a_newline_is_not_an_earlier_dump(dump):
    from forensics.format import open_dump
    from forensics.replay.judge.precursor import earlier_dumps

    run_dir = dump.parent.parent
    shutil.copytree(dump.parent, run_dir / "step-000000003\n")
    shutil.copytree(dump.parent, run_dir / "step-000000002")
    assert [d["step"] for d in earlier_dumps(open_dump(dump))] == [2]


# -- item 3: what the Guard writes, its reader accepts ----------------------------------------------------------------
def test_a_micro_batch_with_a_large_all_zero_tensor_is_written_and_read_back(tmp_path, helpers):
    """A padding mask of zeros compresses ~30,000x: the old ratio rule (beyond 256 MiB at most 1024 x the compressed
    size) refused the Guard's own dump as a zstd bomb. 257 MiB is just over that line (the issue's mask was 1.2 GB:
    the same rule, without allocating it in CI)."""
    import mmap

    import torch

    from forensics.format import open_dump, write_dump

    size = (256 << 20) + (1 << 20)
    mask = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.bool)  # zero pages: nothing resident until read
    content, _ = helpers.synthetic_content()
    content.micro_batches[0]["padding_mask"] = mask
    path = write_dump(content, tmp_path / "dumps")
    assert (path / "batch-000.safetensors.zst").stat().st_size < size // 1024
    for verb in ("verify", "inspect"):
        assert_exit(run([verb, path]), ExitCode.OK)
    read = open_dump(path).micro_batch(0)["padding_mask"]
    assert read.shape == (size,) and read.dtype == torch.bool and not read.any()


# -- item 4: every size a dump asks the replay to build is held to what the dump holds -------------------------------
@pytest.mark.parametrize(
    "key, value, built",
    [
        ("n_layer", 1_000_000, "parameters"),  # 3.5 GB and minutes before the fix (a million GPT-2 blocks)
        ("n_embd", 100_000, "elements of tensors"),  # one block's attention weights alone: 3e10 elements
        ("n_positions", 100_000_000, "elements of tensors"),  # the position embedding
    ],
)
def test_a_recipe_size_edited_far_beyond_the_dumps_weights_stops_the_build_early(dump, tmp_path, key, value, built):
    """A built-in recipe (no --trust): the build stops as soon as it creates more than the dump's weights hold, with
    one line naming both sizes. It stops early: that is what keeps it cheap (no timing asserted)."""
    edit_manifest(dump, lambda m: m["recipe"]["factory_kwargs"]["config"].__setitem__(key, value))
    result = run(["replay", dump, "-o", tmp_path / "out", *REPLAY])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "larger than the weights the dump holds" in result.stderr and "created" in result.stderr
    assert built in result.stderr and "the dump's weights hold" in result.stderr


def test_the_unedited_recipe_builds_within_the_dumps_weights(dump, tmp_path):
    from forensics.format import open_dump
    from forensics.replay.load.build_budget import weights_held
    from forensics.replay.load.recipe import resolve_recipe
    from forensics.replay.load.session import build_model

    opened = open_dump(dump)
    held = weights_held(opened)
    model = build_model(resolve_recipe(opened.recipe), held=held)
    assert held.tensors == len(model.state_dict()) and held.elements == sum(
        t.numel() for t in model.state_dict().values()
    )


# -- item 6: hostile values are refused at the loader, once -----------------------------------------------------------
HUGE = int("1" + "0" * 399)  # 400 digits: valid JSON, within the parser's digit limit, beyond any float


def as_precursor_dump(dump: Path) -> None:
    edit_manifest(
        dump,
        lambda m: m.__setitem__(
            "trigger",
            {
                "kind": "precursor",
                "value": 4.0,
                "threshold": 2.0,
                "micro_batch": None,
                "detail": "block_absmax of transformer.h.1 has stayed above its baseline",
            },
        ),
    )


def growing_table() -> dict:
    """A table whose second column grows from step 8 on, with the firing the monitor recorded."""
    table = flat_table(steps=24)
    for s, row in enumerate(table["values"]):
        row[1] = 2.0 if s < 8 else 2.0 * 1.5 ** (s - 7)
    table["firings"] = [
        {
            "layer": "transformer.h.1",
            "statistic": "block_absmax",
            "step": 5,
            "started": 2,
            "value": 9.0,
            "baseline": 2.0,
            "z": 8.0,
            "rule": "growth",
            "dumped": True,
        }
    ]
    return table


def test_a_precursor_dump_with_growing_statistics_is_reported(dump, tmp_path):
    """The baseline the hostile edits below start from: a normal report."""
    as_precursor_dump(dump)
    with_precursors(dump, growing_table())
    result = run(["replay", dump, "-o", tmp_path / "out", *REPLAY])
    assert result.exit_code == ExitCode.OK, (result.stderr[-2000:], repr(result.exception))
    assert "transformer.h.1" in json.loads((tmp_path / "out" / "report.json").read_text())["verdict"]["headline"]


def _without_statistic(table: dict) -> dict:
    del table["firings"][0]["statistic"]
    table["values"] = [[1.0, 2.0] for _ in table["steps"]]  # nothing ranked: the firing names the statistic
    return table


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t: t["values"][20].__setitem__(1, HUGE), "values[20][1] is out of range (400 digits)"),
        (lambda t: t["columns"][1].__setitem__("limit", HUGE), "columns[1].limit is out of range"),
        (lambda t: t["config"].__setitem__("min_growth", HUGE), "config.min_growth must be an integer within int64"),
        (lambda t: t["steps"].__setitem__(0, HUGE), "steps[0] must be an integer within int64"),
        (_without_statistic, "firing 0 lacks 'statistic'"),
    ],
)
def test_a_hostile_value_in_precursors_json_exits_2_naming_it(dump, tmp_path, edit, words):
    as_precursor_dump(dump)
    table = growing_table()
    edit(table)
    with_precursors(dump, table)
    result = run(["replay", dump, "-o", tmp_path / "out", *REPLAY])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "precursors.json does not have the documented layout" in result.stderr and words in result.stderr


def test_a_400_digit_number_in_history_json_exits_2_naming_it(dump, tmp_path):
    history = json.loads((dump / "history.json").read_text())
    history["loss"][-2] = HUGE
    resign(dump, "history.json", json.dumps(history).encode())
    for verb in (["replay", dump, "-o", tmp_path / "out", *REPLAY], ["inspect", dump]):
        result = run(verb)
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "history.json" in result.stderr and "is out of range (400 digits)" in result.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--memory-budget", f"{HUGE}GiB"], "is larger than any machine's memory"),
        (["--max-unpacked-gb", "inf"], "--max-unpacked-gb"),
        (["--max-unpacked-gb", "nan"], "nan is not a number"),
        (["--max-unpack-ratio", "nan"], "nan is not a number"),
    ],
)
def test_a_size_option_beyond_any_machine_or_not_a_number_exits_2(dump, tmp_path, args, words):
    result = run(["replay", dump, "-o", tmp_path / "out", *REPLAY, *args])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert words in result.stderr


# -- item 7: the smaller ones -------------------------------------------------------------------------------------------
def as_written_by_transformers_recipe(manifest: dict) -> None:
    """The demo dump's recipe as dumps before the plain-torch GPT-2 named it: transformers' GPT2LMHeadModel through the
    built-in Hugging Face recipe (the same parameter names, so the same weights load)."""
    from forensics.demo.models import gpt2_config

    config = gpt2_config(**manifest["recipe"]["factory_kwargs"]["config"]).to_dict()
    manifest["recipe"]["factory"] = "forensics.recipes:huggingface_model"
    manifest["recipe"]["factory_kwargs"] = {
        "architecture": "GPT2LMHeadModel",
        "config": config,
        "attn_implementation": "eager",
    }


@pytest.mark.parametrize("recipe", ["tiny_gpt2", "huggingface_model"])
def test_a_built_in_hugging_face_model_raising_on_edited_data_is_not_called_the_users_code(dump, tmp_path, recipe):
    """The dump's recipe is a built-in one (the demo's plain-torch GPT-2, or transformers' through the built-in Hugging
    Face recipe, as older demo dumps name it) and the default loss: nothing of the user's runs, so a label out of range
    raising inside the model (or inside transformers) is the data not fitting that model, in one sentence."""
    if recipe == "huggingface_model":
        edit_manifest(dump, as_written_by_transformers_recipe)
    from forensics_test_helpers import read_member, resign_member
    from safetensors.torch import load, save

    tensors = load(read_member(dump, "batch-000.safetensors.zst"))
    labels = next(k for k, t in tensors.items() if not t.dtype.is_floating_point)
    tensors[labels] = tensors[labels].clone()
    tensors[labels][0, 3] = 1000  # the vocabulary has 64 tokens
    resign_member(dump, "batch-000.safetensors.zst", save(tensors))
    result = run(["replay", dump, "-o", tmp_path / "out", *REPLAY])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "the model the dump's recipe names (built into forensics) raised IndexError" in result.stderr
    assert "your code raised" not in result.stderr
