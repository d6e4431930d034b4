"""The directories a dump names (`environment.cwd`, `environment.script_dir`) and the model settings it records never
make a replay run code the user did not consent to: without --trust they never reach sys.path (not even when the user
names a factory or loss, forensics' own built-ins included); with --trust they serve only imports nothing installed resolves, so a planted `shlex.py` never stands in for the real one; a dump naming /proc/self/cwd or its own
directory is ignored; a Hugging Face setting that would load code from elsewhere (a Hub kernel, remote code) is
refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner
from forensics_test_helpers import edit_manifest

from forensics.cli import main
from forensics.core.errors import RecipeError
from forensics.recipes import huggingface_model
from forensics.replay.load.recipe import RecordedDirsFinder, job_paths, resolve_recipe

# Standard-library modules a replay imports lazily after the recipe is resolved (seen in the attack round); each
# planted copy leaves a marker file named after itself when it runs.
PLANTED = ("shlex", "getpass", "colorsys", "secrets")
PLANT = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def plant(directory: Path, names=PLANTED) -> Path:
    markers = directory / "markers"
    markers.mkdir(exist_ok=True)
    for name in names:
        (directory / f"{name}.py").write_text(PLANT.format(marker=str(markers / name)))
    return markers


@pytest.fixture
def restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    # the finder of recorded directories goes with it (one an earlier test's --trust replay left is set aside)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, RecordedDirsFinder)])


@pytest.fixture(scope="module")
def crash_dump(tmp_path_factory):
    """A real Guard crash dump of a tiny GPT-2 (built-in Hugging Face recipe: replays without --trust)."""
    import torch
    import transformers

    from forensics.capture import Guard, GuardConfig
    from forensics.core.errors import TrainingFaultError

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    root = tmp_path_factory.mktemp("recorded_dirs")
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(root), run_id="dirs"))
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(TrainingFaultError) as err:
        for step in range(3):
            embeds = model.transformer.wte(ids).detach()
            if step == 2:
                embeds[1, 0, 0] = float("inf")
            batch = {"inputs_embeds": embeds, "labels": ids, "sample_ids": [f"s{step}-0", f"s{step}-1"]}
            guard.record_batch(batch)
            loss = model(inputs_embeds=batch["inputs_embeds"], labels=ids).loss
            guard.record_loss(loss)
            loss.backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()
    guard.close()
    return Path(err.value.dump_path)


def test_without_trust_the_recorded_directories_never_reach_sys_path(tmp_path, restore_sys_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "tinylm.py").write_text("def build():\n    raise SystemExit('must not run')\n")
    before = list(sys.path)
    recipe = {"factory": "forensics.recipes:huggingface_model", "factory_kwargs": {}}
    resolved = resolve_recipe(recipe, loss="forensics.recipes:default_loss", job_dirs=[str(job)])
    assert sys.path == before and not any("job's directories" in n for n in resolved.notes)
    # a factory the user names is consent to that code, not to the dump's directories: the error points at --path
    with pytest.raises(RecipeError) as err:
        resolve_recipe(recipe, factory="tinylm:build", job_dirs=[str(job)])
    assert f"--path {job}" in str(err.value) and "--trust" in str(err.value)
    assert str(job) not in sys.path and "tinylm" not in sys.modules


def test_with_trust_they_come_after_the_standard_library_and_installed_packages(tmp_path, restore_sys_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "tinylm_recorded.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    try:
        resolved = resolve_recipe({"factory": "tinylm_recorded:build"}, trust=True, job_dirs=[str(job)])
    finally:
        sys.modules.pop("tinylm_recorded", None)
    assert resolved.factory().in_features == 2  # importable as in the job
    assert str(job) not in sys.path  # served by the finder placed after every other one
    [finder] = [f for f in sys.meta_path if isinstance(f, RecordedDirsFinder)]
    assert sys.meta_path[-1] is finder and finder.dirs == [str(job)]
    for system in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
        assert system in sys.path
    assert any(str(job) in note and "--trust" in note for note in resolved.notes)  # the report says so


NAMESPACE_CHECK = """
import importlib, pathlib, sys
from forensics.replay.load.recipe import resolve_recipe
job = sys.argv[1]
resolved = resolve_recipe({"factory": "tinyjob:build"}, trust=True, job_dirs=[job])
assert resolved.factory() == "built from the job"
import google.protobuf  # the installed namespace package, as accelerate's probe imports it
import jobns.part  # a namespace package only the job's directory holds
assert jobns.part.VALUE == 7, jobns.part.VALUE
print("google from", list(google.__path__), getattr(google, "__file__", None))
assert not any(p.startswith(job) for p in google.__path__), list(google.__path__)
"""


def test_with_trust_a_recorded_package_never_replaces_an_installed_namespace(tmp_path):
    """The attack: the job's directory holds a regular `google/` package; from the end of sys.path it would replace the
    installed `google` namespace (a regular package anywhere on the path wins over namespace portions)."""
    pytest.importorskip("google.protobuf")
    job = tmp_path / "job"
    (job / "google").mkdir(parents=True)
    marker = tmp_path / "google-ran"
    (job / "google" / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (job / "jobns").mkdir()
    (job / "jobns" / "part.py").write_text("VALUE = 7\n")
    (job / "tinyjob.py").write_text("def build():\n    return 'built from the job'\n")
    ran = subprocess.run(
        [sys.executable, "-P", "-c", NAMESPACE_CHECK, str(job)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not marker.exists()


def test_directories_of_the_kernel_or_inside_the_dump_are_never_used(tmp_path):
    dump = tmp_path / "run" / "step-000000007" / "rank-0"
    (dump / "code").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "run")
    assert job_paths({"cwd": "/proc/self/cwd", "script_dir": "/dev"}) == []
    assert job_paths({"cwd": str(dump / "code"), "script_dir": str(dump)}, dump) == []
    assert job_paths({"cwd": "relative/dir", "script_dir": str(tmp_path / "missing")}) == []
    assert job_paths({"cwd": str(link)}, dump) == [str(tmp_path / "run")]  # resolved: the run dir holds the dump


def test_a_dump_pointing_at_the_replays_directory_runs_nothing_planted_there(
    crash_dump, tmp_path, restore_sys_path, monkeypatch
):
    """The attack: planted stdlib names in the directory the user replays from, the dump naming /proc/self/cwd (that
    directory) and a script_dir holding more; the user passes forensics' own loss (what the refusal recommends)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    markers = plant(tmp_path), plant(elsewhere)
    edit_manifest(crash_dump, lambda m: m["environment"].update(cwd="/proc/self/cwd", script_dir=str(elsewhere)))
    monkeypatch.chdir(tmp_path)
    for name in PLANTED:
        monkeypatch.delitem(sys.modules, name, raising=False)  # imported afresh wherever the replay needs them
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(crash_dump),
            "--device",
            "cpu",
            "--loss",
            "forensics.recipes:default_loss",
            "--no-remedies",
            "-o",
            str(tmp_path / "r"),
        ],
    )
    assert result.exit_code in (0, 3, 4), (result.stdout, result.stderr, result.exception)
    assert [p.name for m in markers for p in m.iterdir()] == []
    assert str(elsewhere) not in sys.path and str(tmp_path) not in sys.path


def test_with_trust_a_planted_standard_module_still_loses_to_the_real_one(crash_dump, tmp_path):
    """A fresh interpreter (its standard modules not yet imported), --trust, the dump's cwd holding planted copies."""
    job = tmp_path / "job"
    job.mkdir()
    markers = plant(job)
    edit_manifest(crash_dump, lambda m: m["environment"].update(cwd=str(job), script_dir=str(job)))
    ran = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            "from forensics.cli import main; main()",
            "replay",
            str(crash_dump),
            "--trust",
            "--device",
            "cpu",
            "--no-remedies",
            "-o",
            str(tmp_path / "r"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert ran.returncode in (0, 3, 4), ran.stderr[-3000:]
    assert sorted(p.name for p in markers.iterdir()) == [], ran.stderr[-2000:]
    assert str(job) in ran.stdout + (tmp_path / "r" / "report.md").read_text()  # the report says where it looked


def test_inspect_shows_the_recorded_directories(crash_dump):
    edit_manifest(crash_dump, lambda m: m["environment"].update(cwd="/srv/job\x1b[31m", script_dir="/srv/job/src"))
    result = CliRunner().invoke(main, ["inspect", str(crash_dump)])
    assert result.exit_code == 0, result.output
    assert "/srv/job/src" in result.output and "only with --trust" in result.output
    assert "\x1b" not in result.output  # printed escaped, never raw


@pytest.mark.parametrize(
    "factory_kwargs, field",
    [
        ({"attn_implementation": "kernels-community/flash-attn"}, "attn_implementation"),
        ({"config": {"_attn_implementation": "org/repo:kernel"}}, "config._attn_implementation"),
        ({"config": {"text_config": {"attn_implementation": "paged|org/repo"}}}, "config.text_config"),
        ({"config": {"auto_map": {"AutoModel": "modeling_evil.Evil"}}}, "config.auto_map"),
    ],
)
def test_a_recorded_hugging_face_setting_cannot_load_code_from_elsewhere(factory_kwargs, field):
    kwargs = {
        "architecture": "GPT2LMHeadModel",
        "config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16},
    }
    kwargs["config"].update(factory_kwargs.get("config", {}))
    kwargs.update({k: v for k, v in factory_kwargs.items() if k != "config"})
    with pytest.raises(RecipeError) as err:
        huggingface_model(**kwargs)
    assert field in str(err.value) and ("Hub" in str(err.value) or "remote code" in str(err.value))


def test_the_cli_refuses_such_a_dump_in_one_line(crash_dump, tmp_path):
    edit_manifest(
        crash_dump, lambda m: m["recipe"]["factory_kwargs"].update(attn_implementation="kernels-community/flash-attn")
    )
    result = CliRunner().invoke(main, ["replay", str(crash_dump), "--device", "cpu", "-o", str(tmp_path / "r")])
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert "Hub" in result.stderr and "Traceback" not in result.stderr
