"""Partly corrupted weights (issue "diagnosis depth", item 1): a tiny Llama whose embedding row 99 holds +inf;
only one sample of the step uses token 99. The replay names the parameter, the row (token id 99) and the
sample, says only that sample fails, and verify_update never blames an update for a row broken before it."""

from __future__ import annotations

import json
import logging

import torch
import transformers
from click.testing import CliRunner
from forensics_test_helpers import guarded_step

from forensics.capture import DetectionConfig, Guard, GuardConfig
from forensics.cli import main

BAD_TOKEN, BAD_STEP = 99, 4


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _train(tmp_path, **config_changes):
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[BAD_TOKEN] = float("inf")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = GuardConfig(
        dump_dir=str(tmp_path / "dumps"), run_id="row99", detection=DetectionConfig(on_nonfinite="skip")
    )
    guard = Guard(model, optimizer, config=config.replace(**config_changes))
    data = torch.Generator().manual_seed(0)
    for step in range(BAD_STEP + 1):
        ids = torch.randint(0, 64, (8, 12), generator=data)  # token 99 never appears ...
        if step == BAD_STEP:
            ids[5, 7] = BAD_TOKEN  # ... except in one sample of step 4
        guarded_step(
            guard,
            optimizer,
            {"input_ids": ids, "labels": ids, "sample_ids": [f"doc-{step}-{i}" for i in range(8)]},
            lambda batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
        )
    guard.close()
    return guard


def test_a_broken_embedding_row_is_named_with_its_token_and_the_only_sample_that_uses_it(tmp_path):
    guard = _train(tmp_path)
    assert len(guard.dumps) == 1
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["replay", str(guard.dumps[0]), "--device", "cpu", "--no-rng-check", "-o", str(out)]
    )
    assert result.exit_code == 4, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "model_state"
    weights = report["weights"]
    entry = next(p for p in weights["parameters"] if p["name"] == "model.embed_tokens.weight")
    assert entry["bad_rows"] == [BAD_TOKEN] and entry["slice_kind"] == "token ids" and entry["pos_inf"] == 32
    assert weights["touching"]["model.embed_tokens.weight"] == ["doc-4-5"]
    assert weights["samples_failing"] == ["doc-4-5"] and weights["samples_checked"] == 8
    headline = report["verdict"]["headline"]
    assert "token ids [99]" in headline and "'doc-4-5'" in headline and "1 of 8" in headline
    assert "whatever the data" not in report["verdict"]["explanation"]


def test_verify_update_does_not_blame_an_update_for_a_row_broken_before_it(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    guard = _train(tmp_path, verify_update=True)
    kinds = [json.loads((p / "manifest.json").read_text())["trigger"]["kind"] for p in guard.dumps]
    assert "nonfinite_param" not in kinds
    assert "already non-finite before the update" in caplog.text
