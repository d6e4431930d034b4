"""A training script written the way nanoGPT's train.py is — everything at top level, no main guard, a config file
exec'd into the module's globals, a model factory in the script that reads those globals, the GPT class in a sibling
model.py — dumped by running `python train.py` from its directory and replayed with `--trust` alone from another
directory (issue 31, item 1): the dump holds the values the factory read, so replay rebuilds the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main
from forensics.core.errors import RecipeError
from forensics.replay.load.main_script import define_from_script
from forensics.replay.load.recipe import resolve_recipe

REPO = Path(__file__).resolve().parents[2]
VOCAB, BAD_ID = 65, 70  # meta.txt's vocabulary (what nanoGPT reads from meta.pkl); a corrupt token id past it

MODEL = textwrap.dedent('''
    """A GPT as nanoGPT's model.py has it, shrunk: token + position embeddings, MLP blocks, a head."""
    from dataclasses import dataclass
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    @dataclass
    class GPTConfig:
        block_size: int = 1024
        vocab_size: int = 50304
        n_layer: int = 12
        n_embd: int = 768

    class GPT(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.h = nn.ModuleList(nn.Sequential(nn.LayerNorm(config.n_embd), nn.Linear(config.n_embd, config.n_embd),
                                                 nn.GELU()) for _ in range(config.n_layer))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        def forward(self, idx, targets=None):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = x + block(x)
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
            return logits, loss
''')

CONFIGURATOR = textwrap.dedent("""
    # nanoGPT's "Poor Man's Configurator": exec'd by train.py, it overrides the globals from --key=value
    import sys
    from ast import literal_eval
    for arg in sys.argv[1:]:
        key, val = arg[2:].split('=')
        globals()[key] = literal_eval(val)
""")

TRAIN = textwrap.dedent(f'''
    """Trains a tiny GPT the nanoGPT way: all at top level."""
    import os
    import torch
    from model import GPTConfig, GPT
    from forensics.capture import DumpConfig, Guard, GuardConfig

    n_layer = 12
    n_embd = 768
    block_size = 8
    learning_rate = 1e-3
    max_iters = 6
    config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, str))]
    exec(open('configurator.py').read())  # overrides from the command line
    config = {{k: globals()[k] for k in config_keys}}
    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp:
        ddp_world_size = int(os.environ['WORLD_SIZE'])
    else:
        ddp_world_size = 1
    tokens_per_iter = ddp_world_size * block_size * 4
    meta_vocab_size = None
    if os.path.exists('meta.txt'):
        meta_vocab_size = int(open('meta.txt').read())

    def build_model():
        model_args = dict(n_layer=n_layer, n_embd=n_embd, block_size=block_size,
                          vocab_size=meta_vocab_size if meta_vocab_size is not None else 50304)
        torch.manual_seed(1337 + ddp_world_size)
        return GPT(GPTConfig(**model_args))

    def lm_loss(model, batch):
        _, loss = model(batch["x"], batch["y"])
        return loss

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    guard = Guard(model, optimizer, loss_fn=lm_loss,
                  config=GuardConfig(dump_dir="out/dumps", run_id="nano",
                                     dumping=DumpConfig(recipe={{"factory": "__main__:build_model"}})))
    data = torch.Generator().manual_seed(0)
    for iter_num in range(max_iters):
        x = torch.randint(0, meta_vocab_size, (4, block_size + 1), generator=data)
        if iter_num == 3:
            x[2, 5] = {BAD_ID}  # a corrupt token in the data file
        batch = {{"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous(), "sample_ids": [f"doc-{{iter_num}}-{{i}}" for i in range(4)]}}
        guard.record_batch(batch)
        loss = lm_loss(model, batch)
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
        print(f"TRAINING iter {{iter_num}}", flush=True)
''')


@pytest.fixture(scope="module")
def nano_dump(tmp_path_factory) -> Path:
    job = tmp_path_factory.mktemp("nanogpt")
    for name, text in (
        ("train.py", TRAIN),
        ("model.py", MODEL),
        ("configurator.py", CONFIGURATOR),
        ("meta.txt", str(VOCAB)),
    ):
        (job / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    ran = subprocess.run(
        [sys.executable, "train.py", "--n_layer=2", "--n_embd=16"],
        cwd=job,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode != 0 and "IndexError" in ran.stderr, ran.stderr[-3000:]  # the job fails as it would
    dumps = sorted((job / "out" / "dumps").glob("nano/step-*/rank-*"))
    assert len(dumps) == 1, ran.stderr[-3000:]
    return dumps[0]


def test_the_dump_records_the_globals_the_factory_read_and_where_the_script_ran(nano_dump):
    manifest = json.loads((nano_dump / "manifest.json").read_text())
    recorded = manifest["recipe"]["script"]["globals"]
    assert recorded["n_layer"] == 2 and recorded["n_embd"] == 16  # the configurator's values, not the defaults
    assert recorded["meta_vocab_size"] == VOCAB and recorded["ddp_world_size"] == 1
    job = nano_dump.parents[4]
    assert manifest["environment"]["script_dir"] == str(job) and manifest["environment"]["cwd"] == str(job)


def test_trust_alone_replays_it_from_another_directory(nano_dump, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the job's directory goes on it for this test only
    try:
        result = CliRunner().invoke(
            main,
            [
                "replay",
                str(nano_dump),
                "--trust",
                "--device",
                "cpu",
                "--no-rng-check",
                "--no-remedies",
                "-o",
                str(tmp_path / "report"),
            ],
        )
    finally:
        sys.modules.pop("model", None)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert "TRAINING" not in result.stdout + result.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["verdict"]["kind"] == "exception"
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["doc-3-2"]
    said = " ".join(report["environment"]["warnings"])
    assert "n_layer=2" in said and f"meta_vocab_size={VOCAB}" in said  # what replay used, said in the report


def test_a_global_the_dump_could_not_hold_is_refused_with_what_to_do_and_no_false_reason():
    source = textwrap.dedent("""
        import torch
        def lm_loss(model, batch):
            return criterion(model(batch["x"]), batch["y"])
        if __name__ == "__main__":
            criterion = torch.nn.MSELoss()
            print("TRAINING")
    """).encode()
    with pytest.raises(RecipeError) as refused:
        define_from_script(source, "lm_loss", "train.py", "loss function", "--loss", {}, {"criterion": "MSELoss"})
    message = str(refused.value)
    assert "`criterion` (a MSELoss: not a JSON value, so the dump holds none)" in message
    assert "--loss train_lib:lm_loss --path DIR_OF_THAT_MODULE" in message and "train again" not in message


def test_factory_keeps_the_recorded_kwargs_unless_others_are_given():
    """The user's factory moved out of the script keeps its recorded kwargs; a built-in recipe's own kwargs (the
    Hugging Face config) do not follow a --factory that replaces it."""
    recipe = {"factory": "__main__:build", "factory_kwargs": {"width": 3}, "loss": "forensics.recipes:default_loss"}
    kept = resolve_recipe(recipe, factory="forensics.recipes:huggingface_model")
    assert kept.factory_kwargs == {"width": 3}
    given = resolve_recipe(recipe, factory="forensics.recipes:huggingface_model", factory_kwargs={"width": 5})
    assert given.factory_kwargs == {"width": 5}
    builtin = {"factory": "forensics.recipes:huggingface_model", "factory_kwargs": {"architecture": "GPT2LMHeadModel"}}
    assert resolve_recipe(builtin, factory="forensics.recipes:default_loss").factory_kwargs == {}


def test_its_repro_scripts_reproduce_the_raising_op_and_sample_from_any_directory(nano_dump, tmp_path, monkeypatch):
    """`forensics repro --trust --path .` in the job's directory; the scripts then run from another directory in a
    fresh process: op_repro.py calls the embedding on the corrupt token and fails, model_repro.py runs that sample."""
    monkeypatch.chdir(nano_dump.parents[4])
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "repro"
    try:
        result = CliRunner().invoke(main, ["repro", str(nano_dump), "-o", str(out), "--trust", "--path", "."])
    finally:
        sys.modules.pop("model", None)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    spec = json.loads((out / "model.json").read_text())
    assert not os.path.isabs(spec["dump"]) and not any(os.path.isabs(p) or p == "." for p in spec["sys_path"])
    assert spec["sample_ids"] == ["doc-3-2"] and spec["blames_sample"] is True
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(elsewhere), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    ran = subprocess.run(
        [sys.executable, "-c", RUN_BOTH, str(out / "op_repro.py"), str(out / "model_repro.py")],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "op_repro.py: AssertionError: aten::embedding raised IndexError" in ran.stdout, ran.stdout + ran.stderr
    assert "model_repro.py: AssertionError: sample(s) ['doc-3-2'] make the step raise IndexError" in ran.stdout, (
        ran.stdout + ran.stderr
    )


RUN_BOTH = """
import runpy, sys
for script in sys.argv[1:]:  # each as `python SCRIPT` would run it; one fresh process for both (one torch import)
    sys.argv = [script]  # what `python SCRIPT` gives the script (model_repro.py parses its arguments)
    try:
        runpy.run_path(script, run_name="__main__")
    except AssertionError as exc:
        print(f"{script.rsplit('/', 1)[-1]}: AssertionError: {exc}", flush=True)
"""
