"""A custom (non Hugging Face) model, as a new user writes one: the capture says when the recorded loss
cannot serve it, a user override replaces the recipe's fields consistently, and replay never ends in a
traceback with exit 1."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from forensics_test_helpers import guarded_step

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig
from forensics.capture.state.recipe import build_recipe
from forensics.cli import main
from forensics.recipes import DEFAULT_LOSS, HUGGINGFACE_FACTORY

USER_MODULE = textwrap.dedent("""
    import torch

    class TinyRegressor(torch.nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

        def forward(self, x):
            return self.net(x)

    def build(width=4):
        return TinyRegressor(width)

    def mse(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "tinyreg_user.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tinyreg_user", None)
    import tinyreg_user

    yield tinyreg_user
    sys.modules.pop("tinyreg_user", None)


def _train(module, tmp_path, loss_fn=None, recipe=None):
    torch.manual_seed(0)
    model = module.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="reg",
            detection=DetectionConfig(on_nonfinite="skip"),
            dumping=DumpConfig(recipe=recipe),
        ),
        loss_fn=loss_fn,
    )
    for step in range(4):
        x, y = torch.randn(8, 3), torch.randn(8, 1)
        if step == 2:
            x[5] = float("inf")
        guarded_step(
            guard,
            optimizer,
            {"x": x, "y": y, "sample_ids": [f"row-{step * 8 + i}" for i in range(8)]},
            lambda batch: module.mse(model, batch),
        )
    guard.close()
    assert len(guard.dumps) == 1
    return guard.dumps[0]


def test_capture_warns_when_the_default_loss_cannot_serve_a_custom_model(user_module, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    dump = _train(user_module, tmp_path, recipe={"factory": "tinyreg_user:build"})
    assert "not a Hugging Face model" in caplog.text and "loss_fn" in caplog.text
    result = CliRunner().invoke(
        main, ["replay", str(dump), "--device", "cpu", "--trust", "--path", str(tmp_path), "-o", str(tmp_path / "r")]
    )
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert "--loss" in result.stderr and "Traceback" not in result.stderr


def test_a_recorded_loss_fn_replays_the_custom_model_to_the_sample(user_module, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    dump = _train(user_module, tmp_path, loss_fn=user_module.mse, recipe={"factory": "tinyreg_user:build"})
    assert "not a Hugging Face model" not in caplog.text
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump),
            "--device",
            "cpu",
            "--trust",
            "--path",
            str(tmp_path),
            "-o",
            str(tmp_path / "r"),
            "--no-rng-check",
        ],
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert "'row-21'" in result.stdout


def test_a_loss_override_replaces_the_default_losss_kwargs(user_module, tmp_path):
    dump = _train(user_module, tmp_path, recipe={"factory": "tinyreg_user:build", "loss": "tinyreg_user:mse"})
    from forensics.format import open_dump

    recipe = open_dump(dump).recipe
    assert recipe["loss"] == "tinyreg_user:mse" and recipe["loss_kwargs"] == {} and recipe["source"] == "user"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump),
            "--device",
            "cpu",
            "--trust",
            "--path",
            str(tmp_path),
            "-o",
            str(tmp_path / "r"),
            "--no-rng-check",
        ],
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)


def test_a_factory_override_on_a_hugging_face_model_drops_the_automatic_factory_kwargs(gpt2):
    gpt2 = gpt2()
    recipe = build_recipe(gpt2, None, "sample_ids", {"factory": "mypkg:build"})
    assert recipe["factory"] == "mypkg:build" and recipe["factory_kwargs"] == {}
    assert recipe["loss"] == DEFAULT_LOSS and recipe["loss_kwargs"] == {"ignore_keys": ["sample_ids"]}
    kept = build_recipe(gpt2, None, "sample_ids", {"factory": "mypkg:build", "factory_kwargs": {"n": 2}})
    assert kept["factory_kwargs"] == {"n": 2}
    auto = build_recipe(gpt2, None, "sample_ids", None)
    assert auto["factory"] == HUGGINGFACE_FACTORY and auto["factory_kwargs"]["architecture"] == "GPT2LMHeadModel"
