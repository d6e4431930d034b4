"""The precursor monitor on a real divergence (tests/capture/precursor_divergence_job.py): a tiny GPT-2 (random init,
no QK-norm) trained with SGD + momentum at learning rate 1.0 on learnable token sequences diverges by itself —
nothing planted — and the monitor dumps a
`precursor` step at least 10 steps before the loss or gradients go non-finite, naming the layer whose statistic
rose first. The same model at a sane learning rate fires nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from forensics_test_helpers import load_test_module

from forensics.capture import Guard, GuardConfig, PrecursorConfig
from forensics.capture.precursors import statistics as precursor_stats
from forensics.capture.precursors.statistics import find_blocks
from forensics.format import open_dump, verify_dump
from forensics.core.kinds import PrecursorStatistic, TriggerKind, VerdictKind
from forensics.report import render_markdown
from forensics.report.plots import plot_precursors
from forensics.replay.engine import ReplayOptions, run_replay

_job = load_test_module("forensics_precursor_divergence_job", Path(__file__).with_name("precursor_divergence_job.py"))
AHEAD, batches, gpt2, train = _job.AHEAD, _job.batches, _job.gpt2, _job.train


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    return train(tmp_path_factory.mktemp("precursor"), lr=1.0)


def onset(steps: list, series: list, rising: bool, baseline: range, factor: float = 2.0, hold: int = 3) -> int | None:
    """An independent rule for where a series rose: the first step after `baseline` from which it stays `factor` x
    beyond the median of its values at the `baseline` steps for `hold` values."""
    first = sorted(v for s, v in zip(steps, series) if s in baseline and v is not None)
    if not first:
        return None
    median = first[len(first) // 2]
    beyond = [v is not None and (v >= factor * median if rising else v <= median / factor) for v in series]
    return next(
        (steps[i] for i in range(len(series) - hold + 1) if steps[i] >= baseline.stop and all(beyond[i : i + hold])),
        None,
    )


def test_a_provoked_divergence_is_dumped_as_a_precursor_ten_steps_ahead_naming_the_first_layer(diverged):
    guard, nonfinite_at = diverged
    assert nonfinite_at is not None, "the learning rate did not make the run diverge"
    precursor = [p for p in guard.dumps if open_dump(p).trigger.kind == TriggerKind.PRECURSOR]
    assert len(precursor) == 1  # PrecursorConfig.max_dumps
    dump = open_dump(precursor[0])
    assert verify_dump(precursor[0]).ok
    assert dump.step <= nonfinite_at - AHEAD
    table = dump.precursors()
    # the sampled step that fired is before the dump (its row is read with the next check's transfer; a step that
    # was dumped for an incident of its own passes the precursor dump on to the next one)
    assert dump.step - PrecursorConfig().every <= table["steps"][-1] < dump.step
    assert len(table["values"]) == len(table["steps"])
    report = run_replay(precursor[0], ReplayOptions(device="cpu"))
    assert report["verdict"]["kind"] == VerdictKind.INSTABILITY_AHEAD and report["schema"] == "forensics-report/3"
    first = report["precursor"]["ranking"][0]
    assert report["culprit"]["module"] == first["layer"] and first["layer"] in report["verdict"]["headline"]
    assert first["layer"].startswith("transformer.h.")
    # the named series rose first by a rule of its own: no other series stays 2x above its start clearly earlier
    # (more than one sample before the step replay says the named one started). Which of several series rising
    # within a sample of each other is ranked first depends on the machine's rounding, so ties are not judged, and
    # the named series need not pass this rule's own 2x bar by the dump (on another machine it had not: issue 30).
    onsets, warmup, every = {}, PrecursorConfig().warmup, PrecursorConfig().every
    for j, column in enumerate(table["columns"]):
        stat = PrecursorStatistic(column["statistic"])
        at = onset(table["steps"], [row[j] for row in table["values"]], stat.rising, range(warmup - 32, warmup))
        if at is not None:
            onsets[(column["layer"], column["statistic"])] = at
    assert all(at >= first["started"] - every for at in onsets.values()), (first, onsets)
    named = onsets.get((first["layer"], first["statistic"]))
    assert named is None or abs(named - first["started"]) <= 2 * every, (first, named)
    assert any("QK-norm" in s or "learning rate" in s for s in report["verdict"]["suggestions"])
    assert "instability ahead" in render_markdown(report) and plot_precursors(report)


def test_the_crash_dump_still_comes_and_carries_the_statistics(diverged):
    guard, nonfinite_at = diverged
    crash = open_dump(guard.dumps[-1])
    assert crash.trigger.kind in (TriggerKind.NONFINITE_LOSS, TriggerKind.NONFINITE_GRAD)
    table = crash.precursors()
    assert crash.step == nonfinite_at
    # the last sampled step before the crash (its row is read with the next check()'s transfer, before a raise)
    assert crash.step - PrecursorConfig().every <= table["steps"][-1] < crash.step
    assert all(s % PrecursorConfig().every == 0 for s in table["steps"])  # the Guard counts from step 0
    assert [f for f in table["firings"] if f["dumped"]]  # the precursor that fired is in the crash dump too


def test_repro_of_a_precursor_dump_says_there_is_nothing_to_reproduce(diverged, tmp_path):
    """A precursor dump is a healthy step: `forensics repro` refuses it (exit 2) and points to replay and to the
    crash dump, writing nothing."""
    from click.testing import CliRunner

    from forensics.cli import main

    guard, _ = diverged
    precursor = next(p for p in guard.dumps if open_dump(p).trigger.kind == TriggerKind.PRECURSOR)
    result = CliRunner().invoke(main, ["repro", str(precursor), "-o", str(tmp_path / "repro")])
    assert result.exit_code == 2, result.output
    assert "precursor dump" in result.output and "crash dump" in result.output
    assert not (tmp_path / "repro").exists()


def test_a_healthy_run_fires_no_precursor(tmp_path):
    guard, nonfinite_at = train(tmp_path, lr=0.1, steps=100)
    assert nonfinite_at is None and guard.dumps == [] and guard.precursors.firings == []


def test_blocks_and_attention_projections_are_found_generically():
    from transformers import LlamaForCausalLM

    from forensics.demo.models import llama_config

    model = LlamaForCausalLM(llama_config(num_hidden_layers=3))
    assert [name for name, _ in find_blocks(model)] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    guard = Guard(model, torch.optim.AdamW(model.parameters()), config=GuardConfig(precursors=PrecursorConfig()))
    columns = set(guard.precursors.columns)
    for layer in ("model.layers.0", "model.layers.2"):
        for stat in PrecursorStatistic:
            if stat is not PrecursorStatistic.OUTPUT_LOGIT:
                assert (layer, stat) in columns, (layer, stat)
    assert ("lm_head", PrecursorStatistic.OUTPUT_LOGIT) in columns
    guard.close()


def test_blocks_in_a_sequential_and_a_head_of_a_plain_model_are_found():
    """Not a Hugging Face model: blocks in an nn.Sequential (as a ViT keeps them), the output projection a direct
    child named `head`; nn.MultiheadAttention has no separate q / k projections, so no attention bound."""

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 16)
            self.blocks = torch.nn.Sequential(
                *[torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(3)]
            )
            self.head = torch.nn.Linear(16, 10)

    model = Plain()
    assert [name for name, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    guard = Guard(model, torch.optim.AdamW(model.parameters()), config=GuardConfig(precursors=PrecursorConfig()))
    columns = set(guard.precursors.columns)
    assert ("head", PrecursorStatistic.OUTPUT_LOGIT) in columns
    assert ("blocks.2", PrecursorStatistic.GRAD_NORM) in columns
    assert not [c for c in columns if c[1] is PrecursorStatistic.ATTENTION_LOGIT]
    guard.close()


@pytest.mark.xdist_group("torchtitan")  # one worker imports torchtitan (12 s of CPU) for both torchtitan tests
def test_a_torchtitan_llama_is_watched_block_by_block():
    """torchtitan's Llama 3: blocks in a ModuleDict, grouped-query projections `wq` / `wk` whose head size only the
    attention module states, the logits from its `output` projection; a sampled row against direct computations."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    model = Transformer(
        TransformerModelArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16, use_flex_attn=False
        )
    )
    model.init_weights()
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        config=GuardConfig(precursors=PrecursorConfig(every=1, optimizer=False)),
    )
    seen = {}
    keep = lambda key: lambda m, a, out: seen.__setitem__(key, out.detach())  # noqa: E731
    handles = [model.output.register_forward_hook(keep("logits"))]
    for name, layer in model.layers.items():
        handles += [
            layer.register_forward_hook(keep(name)),
            layer.attention.wq.register_forward_hook(keep((name, "q"))),
            layer.attention.wk.register_forward_hook(keep((name, "k"))),
        ]
    tokens = torch.randint(0, 128, (3, 16))
    for step in range(2):  # the row of step 0 is read at step 1's check()
        guard.record_batch({"tokens": tokens}, sample_ids=[0, 1, 2])
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        guard.record_loss(loss)
        loss.backward()
        if step == 0:
            stat = PrecursorStatistic
            expected = {("output", stat.OUTPUT_LOGIT): float(seen["logits"].abs().max())}
            for name in model.layers:
                out, q, k = seen[name], seen[name, "q"], seen[name, "k"]
                heads = [t.unflatten(-1, (-1, 16)).norm(dim=-1).max() for t in (q, k)]  # head_dim 16
                grads = [p.grad for p in model.layers[name].parameters() if p.dim() >= 2]
                expected |= {
                    (f"layers.{name}", stat.BLOCK_RMS): float(out.pow(2).mean().sqrt()),
                    (f"layers.{name}", stat.BLOCK_ABSMAX): float(out.abs().max()),
                    (f"layers.{name}", stat.ATTENTION_LOGIT): float(heads[0] * heads[1]) / 4.0,
                    (f"layers.{name}", stat.GRAD_NORM): math.sqrt(sum(float(g.pow(2).sum()) for g in grads)),
                }
        assert guard.check()
        guard.optimizer.step()
        guard.optimizer.zero_grad()
    values = rows_after_close(guard, handles)[0]
    assert seen["0", "q"].shape[-1] == 2 * seen["0", "k"].shape[-1]  # grouped-query attention
    assert sorted(values) == sorted(expected)
    for column, value in expected.items():
        assert values[column] == pytest.approx(value, rel=1e-5), column


@pytest.mark.slow  # compiling with aot_eager dominates; the hooks are the eager ones
def test_a_torch_compiled_model_gives_the_rows_of_the_eager_model():
    """Under torch.compile the hooks run inside the traced forward (their flag is a guard: sampled and other steps
    are two graphs); the rows equal the eager model's. (aot_eager: the compiler's tracing without a C compiler.)"""

    def rows(compiled: bool) -> dict[int, list]:
        model = gpt2()
        model.eval()  # no dropout: the same numbers in both runs
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        guard = Guard(run, optimizer, config=GuardConfig(precursors=PrecursorConfig(every=2)))
        train_steps(guard, run, optimizer, 5)
        assert guard.precursors.every == 2  # still on
        return {step: values for step, values in rows_after_close(guard).items()}

    eager, compiled = rows(False), rows(True)
    assert sorted(eager) == sorted(compiled) == [0, 2]  # the row of step 4 is read at step 5's check()
    for step, values in eager.items():
        assert all(
            value is not None
            for column, value in values.items()
            if column[1] not in (PrecursorStatistic.UPDATE_RATIO, PrecursorStatistic.ADAM_V_FLOOR)
        ), step
        for column, value in values.items():
            expected = None if value is None else pytest.approx(value, rel=1e-4)
            assert compiled[step][column] == expected, (step, column)


def test_a_block_without_gradients_reads_as_not_measured_not_as_zero():
    """A frozen block, and one whose gradients are not in `.grad` (a ZeRO optimizer keeps them in its own buffers;
    an unused block has none): their gradient norm is not measured (null), never a vanished 0."""
    model = gpt2()
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(precursors=PrecursorConfig(every=1)))

    def drop_block_1_gradients():
        for p in model.transformer.h[1].parameters():
            p.grad = None

    train_steps(guard, model, optimizer, 3, drop_block_1_gradients)
    values = rows_after_close(guard)[1]
    stat = PrecursorStatistic
    assert values[("transformer.h.0", stat.GRAD_NORM)] is None and values[("transformer.h.1", stat.GRAD_NORM)] is None
    assert values[("transformer.h.2", stat.GRAD_NORM)] > 0
    assert values[("transformer.h.0", stat.UPDATE_RATIO)] is None and values[("transformer.h.2", stat.UPDATE_RATIO)] > 0
    assert values[("transformer.h.0", stat.BLOCK_RMS)] > 0  # its forward is still watched


@pytest.mark.parametrize("unscaled", [False, True], ids=["scaled_at_check", "unscale_before_check"])
def test_gradient_norms_under_a_grad_scaler_are_the_true_ones(unscaled):
    """With a GradScaler the gradients at check() are still multiplied by the loss scale unless the loop called
    `scaler.unscale_` first; the scale doubles here at every step, which must not read as a gradient that grows."""
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    guard = Guard(model, optimizer, scaler=scaler, config=GuardConfig(precursors=PrecursorConfig(every=1)))
    expected = {}
    for step, batch in enumerate(batches(4)):
        guard.record_batch(batch, sample_ids=list(range(len(batch["input_ids"]))))
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        guard.record_loss(loss)
        scaler.scale(loss).backward()
        if unscaled:
            scaler.unscale_(optimizer)
        divisor = 1.0 if unscaled else scaler.get_scale()
        expected[step] = math.sqrt(
            sum(float((p.grad / divisor).pow(2).sum()) for p in model.transformer.h[1].parameters() if p.dim() >= 2)
        )
        assert guard.check()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert scaler.get_scale() == 2.0**14  # doubled at every step
    rows = rows_after_close(guard)
    for step in (0, 1, 2):
        assert rows[step][("transformer.h.1", PrecursorStatistic.GRAD_NORM)] == pytest.approx(expected[step], rel=1e-4)


def train_steps(guard: Guard, model, optimizer, steps: int, before_check=lambda: None) -> None:
    """`steps` guarded steps of one micro-batch of the job's learnable sequences; `before_check` runs after backward."""
    for batch in batches(steps):
        guard.record_batch(batch, sample_ids=list(range(len(batch["input_ids"]))))
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        guard.record_loss(loss)
        loss.backward()
        before_check()
        assert guard.check()
        optimizer.step()
        optimizer.zero_grad()


def rows_after_close(guard: Guard, handles=()) -> dict[int, dict]:
    """Closes the Guard and removes the test's own hooks; the rows the monitor read, by step, as {column: value}."""
    guard.close()
    for handle in handles:
        handle.remove()
    return {step: dict(zip(guard.precursors.columns, values)) for step, values in guard.window._precursor_rows}


@pytest.mark.parametrize("reentrant", [True, False])
def test_every_block_is_measured_under_activation_checkpointing(reentrant):
    """Checkpointed blocks run their forward again inside backward (reentrant: without gradients first, then
    recomputed from the last block backwards): every block's statistics are still those of the step's forward."""
    model = gpt2()
    model.train()
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        config=GuardConfig(precursors=PrecursorConfig(every=1, optimizer=False)),
    )
    batch = next(iter(batches(1)))
    for checkpointed in (False, True):
        if checkpointed:
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
        for _ in range(2):  # the row of the first step is read at the second's check()
            guard.record_batch(batch, sample_ids=list(range(len(batch["input_ids"]))))
            torch.manual_seed(0)  # the same dropout masks in both runs
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            guard.record_loss(loss)
            loss.backward()
            assert guard.check()
            model.zero_grad()
    rows = rows_after_close(guard)
    plain = {False: rows[0], True: rows[2]}  # steps 0-1 plain, 2-3 checkpointed: the rows of 0 and 2 were read
    for name, _ in find_blocks(model):
        for stat in (PrecursorStatistic.BLOCK_RMS, PrecursorStatistic.BLOCK_ABSMAX, PrecursorStatistic.ATTENTION_LOGIT):
            assert plain[True][(name, stat)] is not None, (name, stat)
            assert plain[True][(name, stat)] == pytest.approx(plain[False][(name, stat)], rel=1e-5), (name, stat)


def test_the_attention_bound_of_a_grouped_query_llama_is_max_q_norm_times_max_k_norm():
    """Separate q_proj / k_proj outputs of different widths (4 query heads, 2 key heads): the bound per block is
    the largest per-head row norm of each, multiplied, over sqrt(head_dim)."""
    from transformers import LlamaForCausalLM

    from forensics.demo.models import llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=GuardConfig(precursors=PrecursorConfig(every=1, optimizer=False)),
    )
    outputs = {}
    handles = [
        getattr(layer.self_attn, name).register_forward_hook(
            lambda m, a, out, key=(index, name): outputs.__setitem__(key, out.detach())
        )
        for index, layer in enumerate(model.model.layers)
        for name in ("q_proj", "k_proj")
    ]
    input_ids = torch.randint(1, 64, (3, 10))
    for step in range(2):  # the row of step 0 is read at step 1's check()
        guard.record_batch({"input_ids": input_ids}, sample_ids=[0, 1, 2])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        guard.record_loss(loss)
        loss.backward()
        if step == 0:
            heads = {key: t.unflatten(-1, (-1, 8)).norm(dim=-1).max() for key, t in outputs.items()}  # head_dim 8
            expected = {
                index: float(heads[index, "q_proj"] * heads[index, "k_proj"]) / math.sqrt(8) for index in range(3)
            }
        assert guard.check()
        guard.optimizer.zero_grad()
    values = rows_after_close(guard, handles)[0]
    assert outputs[0, "q_proj"].shape[-1] == 2 * outputs[0, "k_proj"].shape[-1]  # grouped-query attention
    for index in range(3):
        got = values[(f"model.layers.{index}", PrecursorStatistic.ATTENTION_LOGIT)]
        assert got == pytest.approx(expected[index], rel=1e-5), index


@pytest.mark.parametrize(
    "bad", [dict(window=2), dict(sustained=0), dict(min_growth=1.0), dict(history=3), dict(every=0)]
)
def test_config_is_validated(bad):
    with pytest.raises(ValueError, match="PrecursorConfig"):
        PrecursorConfig(**bad)


@pytest.mark.parametrize("part_elements", [None, 5000], ids=["one_part", "parts_of_5000"])
def test_a_sampled_row_holds_the_statistics_computed_directly_and_other_steps_none(part_elements, monkeypatch):
    """The batched statistics (one `_foreach` chain per param group and part of the optimizer state, sign tricks
    included) against a plain per-parameter computation of the same definitions, at the sampled steps only; also
    with the state split into parts of ~1-2 weight matrices each, as a large model's is."""
    if part_elements is not None:
        monkeypatch.setattr(precursor_stats, "PART_ELEMENTS", part_elements)
    model = gpt2()
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3},
            {
                "params": [p for n, p in model.named_parameters() if not n.endswith("bias")],
                "lr": 1e-3,
                "betas": (0.8, 0.99),
            },
        ]
    )
    guard = Guard(model, optimizer, config=GuardConfig(precursors=PrecursorConfig(every=3)))
    blocks = dict(find_blocks(model))
    outputs = {}
    handles = [
        block.register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(
                name, (out if isinstance(out, torch.Tensor) else out[0]).detach()
            )
        )
        for name, block in blocks.items()
    ]
    handles += [
        block.attn.c_attn.register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__((name, "qkv"), out.detach())
        )
        for name, block in blocks.items()
    ]
    handles.append(model.lm_head.register_forward_hook(lambda m, a, out: outputs.__setitem__("logits", out.detach())))
    expected = {}
    for step, batch in enumerate(batches(8)):  # the row of step 6 is read at step 7
        guard.record_batch(batch)
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        guard.record_loss(loss)
        loss.backward()
        expected[step] = _direct_statistics(blocks, outputs, optimizer)
        assert guard.check()
        optimizer.step()
        optimizer.zero_grad()
    rows = rows_after_close(guard, handles)
    assert sorted(rows) == [0, 3, 6]  # every=3, from the first step
    for step, got in rows.items():
        for column, value in expected[step].items():
            if value is None:
                assert got[column] is None, (step, column)
            else:
                assert got[column] == pytest.approx(value, rel=1e-4), (step, column)


def test_the_forward_statistics_of_a_step_with_several_micro_batches_are_its_first_micro_batchs():
    """A sampled step measures its first micro-batch's forward only (each measurement is launches on a GPU step's
    critical path); the gradient norm covers the whole step's accumulated gradient."""
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(precursors=PrecursorConfig(every=1)))
    blocks = dict(find_blocks(model))
    first_block, last = list(blocks)[0], list(blocks)[-1]
    seen = []  # per forward: [last block's output abs-max, logits abs-max]
    handles = [
        blocks[last].register_forward_hook(
            lambda m, a, out: seen.append(
                [float((out if isinstance(out, torch.Tensor) else out[0]).detach().abs().max())]
            )
        ),
        model.lm_head.register_forward_hook(lambda m, a, out: seen[-1].append(float(out.detach().abs().max()))),
    ]
    expected = {}
    for step in range(3):  # the row of step 1 is read at step 2's check()
        seen.clear()
        for index, (batch, scale) in enumerate(zip(batches(2), (1.0, 50.0))):  # the second far larger
            guard.record_batch(batch, sample_ids=[f"{index}-{i}" for i in range(len(batch["input_ids"]))])
            loss = model(
                inputs_embeds=model.transformer.wte(batch["input_ids"]) * scale, labels=batch["input_ids"]
            ).loss
            guard.record_loss(loss)
            loss.backward()
        grads = [p.grad for p in blocks[first_block].parameters() if p.dim() >= 2]
        expected[step] = (seen[0], seen[1], math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
        assert guard.check()
        optimizer.step()
        optimizer.zero_grad()
    values = rows_after_close(guard, handles)[1]
    measured, other, grad_norm = expected[1]
    assert other[0] > 5 * measured[0] and other[1] > measured[1]
    assert values[(last, PrecursorStatistic.BLOCK_ABSMAX)] == pytest.approx(measured[0], rel=1e-5)
    assert values[("lm_head", PrecursorStatistic.OUTPUT_LOGIT)] == pytest.approx(measured[1], rel=1e-5)
    assert values[(first_block, PrecursorStatistic.GRAD_NORM)] == pytest.approx(grad_norm, rel=1e-4)


def _direct_statistics(blocks, outputs, optimizer) -> dict:
    stat = PrecursorStatistic
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = {("lm_head", stat.OUTPUT_LOGIT): float(outputs["logits"].abs().max())}
    for name, block in blocks.items():
        q, k, _ = outputs[(name, "qkv")].chunk(3, dim=-1)
        size = 16  # n_embd 32 / 2 heads
        bound = float(q.reshape(-1, size).norm(dim=-1).max() * k.reshape(-1, size).norm(dim=-1).max())
        out[(name, stat.ATTENTION_LOGIT)] = bound / math.sqrt(size)
        t = outputs[name].float()
        out[(name, stat.BLOCK_RMS)] = float(t.pow(2).mean().sqrt())
        out[(name, stat.BLOCK_ABSMAX)] = float(t.abs().max())
        params = [p for p in block.parameters() if p.requires_grad and p.dim() >= 2]  # the weight matrices
        assert len(params) == 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj
        weights = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in params))
        out[(name, stat.GRAD_NORM)] = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
        if not optimizer.state:
            out[(name, stat.UPDATE_RATIO)] = out[(name, stat.ADAM_V_FLOOR)] = None
            continue
        squares, floor = 0.0, math.inf
        for p in params:
            state, group = optimizer.state[p], groups[id(p)]
            (beta1, beta2), n = group["betas"], float(state["step"])
            update = (state["exp_avg"] / (1 - beta1**n)) / (
                (state["exp_avg_sq"] / (1 - beta2**n)).sqrt() + group["eps"]
            )
            squares += float((group["lr"] * update).pow(2).sum())
            floor = min(floor, float(state["exp_avg_sq"].min()))
        out[(name, stat.UPDATE_RATIO)] = math.sqrt(squares) / weights
        out[(name, stat.ADAM_V_FLOOR)] = floor
    return out


class PackedBlocks(torch.nn.Module):
    """Variable-length sequences packed as a jagged nested tensor through a ModuleList of blocks: ops the
    statistics' reductions (aminmax, _foreach_norm) do not support on that layout."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2))

    def forward(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        hidden = torch.nested.as_nested_tensor([self.embed(s) for s in sequences], layout=torch.jagged)
        for block in self.blocks:
            hidden = block(hidden)
        return torch.cat(hidden.unbind()).pow(2).mean()


def test_a_statistic_that_fails_on_a_block_output_never_stops_the_training_step(tmp_path, caplog):
    torch.manual_seed(0)
    model = PackedBlocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="packed", precursors=PrecursorConfig(every=1)),
    )
    try:
        for step in range(3):
            sequences = [torch.randint(0, 16, (n,)) for n in (3, 5)]
            guard.record_batch({"sequences": sequences, "sample_ids": [2 * step, 2 * step + 1]})
            loss = model(sequences)  # raised NotImplementedError from the Guard's hook before the fix
            guard.record_loss(loss)
            loss.backward()
            assert guard.check()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        guard.close()
    assert "precursors: the statistics failed" in caplog.text and not guard.dumps
    assert not model.blocks[0]._forward_hooks  # the monitor turned itself off and removed its hooks
