"""The planted-fault scenario catalogue: small real training runs that each hit one known fault.

Every scenario trains a small randomly initialised model (transformers GPT-2 / Llama, or a model of
forensics.demo.models) with AdamW, a linear warm-up schedule and gradient accumulation 2, with the
capture Guard in its loop exactly as a user would add it (the lines marked `# forensics` in
`train`). A planted fault makes the Guard write a dump; `Scenario.capture(out_dir)` returns that
dump's path and the `Expected` answer a correct replay must give, so tests can check the replay.

Sample IDs look like a real sharded data set ("shard-0003/rec-00117") and travel in each batch's
"sample_ids" field, where the Guard reads them.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from forensics.format.location import Location
from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SpikeConfig
from forensics.demo import models
from forensics.core.errors import ForensicsError, TrainingFaultError
from forensics.format.batch_tree import map_tensors
from forensics.core.kinds import Phase, TriggerKind
from forensics.recipes import name_default_loss

log = logging.getLogger(__name__)

Echo = Callable[[str], None]

SEQ_LEN = 16
VOCAB = 64
MICRO_BATCH = 4
GRAD_ACCUM = 2
FLT_MAX = torch.finfo(torch.float32).max


class ScenarioError(ForensicsError):
    """A scenario did not produce the dump it was built to produce (the planted fault did not fire)."""


@dataclass(frozen=True)
class Expected:
    """What a correct replay of a scenario's dump reports. Fields left None are not asserted."""

    verdict: str
    """report["verdict"]["kind"]."""
    samples: tuple = ()
    """report["culprit"]["samples"] sample ids (order-free); () means no culprit sample."""
    module: str | None = None
    op: str | None = None
    parameter: str | None = None
    phase: Phase | None = None
    reproduced: bool = True
    trigger: TriggerKind = TriggerKind.NONFINITE_LOSS
    """The kind of trigger the Guard fired in the job."""
    top_sample: str | None = None
    """The sample ranked first by per-sample loss (spikes)."""
    optimizer_state_words: tuple = ()
    """Words report["culprit"]["optimizer_state"] must contain (its wording is the replay's)."""


@dataclass
class Captured:
    """A scenario's training run, stopped (or continued) by the automatic capture."""

    dump_path: Path
    expected: Expected
    step: int
    """The step the dump holds."""
    message: str
    """What the Guard said when it fired (the TrainingFaultError text, or its log line)."""
    losses: list[float] = field(default_factory=list)
    """Step losses of the run, as the loop logged them."""


@dataclass(frozen=True)
class Scenario:
    """One planted fault: `capture(out_dir, device, echo)` trains until it fires and returns the dump."""

    name: str
    description: str
    """One line, shown by `forensics demo --help`."""
    story: str
    """A few sentences, in plain words, of what goes wrong in this run."""
    run: Callable[[Path, torch.device, Echo], Captured]

    def capture(
        self, out_dir: str | Path, device: str | torch.device | None = None, echo: Echo | None = None
    ) -> Captured:
        """Runs the training until the Guard captures the planted fault.

        Args:
            out_dir: the dump goes under <out_dir>/dumps/.
            device: where to train ("cpu" default; "cuda:0" works too).
            echo: called with progress lines (default: nothing printed).
        Returns:
            Captured: the dump path and the expected replay answer.
        Raises:
            ScenarioError: the run ended without a dump.
        """
        return self.run(Path(out_dir), torch.device(device or "cpu"), echo or (lambda _line: None))


# -- data: deterministic records with sample ids that look like a sharded data set ------------------
def sample_ids(seed: int, count: int) -> list[str]:
    """`count` distinct ids "shard-SSSS/rec-RRRRR", drawn deterministically from `seed`."""
    rng = random.Random(seed)
    picked = rng.sample(range(16 * 4096), count)
    return [f"shard-{n // 4096:04d}/rec-{n % 4096:05d}" for n in picked]


def token_record(gen: torch.Generator) -> torch.Tensor:
    """A learnable token sequence: start + stride * t (mod vocabulary), token 0 never used."""
    start = int(torch.randint(1, VOCAB, (1,), generator=gen))
    stride = int(torch.randint(1, 6, (1,), generator=gen))
    return (start + stride * torch.arange(SEQ_LEN)) % (VOCAB - 1) + 1


def collate(records: list[dict]) -> dict:
    """Stacks tensors field by field; the "sample_ids" field stays a list of strings."""
    batch: dict[str, Any] = {}
    for key in records[0]:
        values = [r[key] for r in records]
        batch[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
    return batch


def make_steps(n_steps: int, seed: int, make_record: Callable[[torch.Generator], dict]) -> list[list[list[dict]]]:
    """n_steps x GRAD_ACCUM micro-batches x MICRO_BATCH records, each with its "sample_ids" entry."""
    gen = torch.Generator().manual_seed(seed)
    ids = iter(sample_ids(seed, n_steps * GRAD_ACCUM * MICRO_BATCH))
    return [
        [[{**make_record(gen), "sample_ids": next(ids)} for _ in range(MICRO_BATCH)] for _ in range(GRAD_ACCUM)]
        for _ in range(n_steps)
    ]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """What a Hugging Face user writes: model(**inputs).loss (the sample ids are not an input)."""
    return model(**{k: v for k, v in batch.items() if k != "sample_ids"}).loss


def dict_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "sample_ids"})["loss"]


# -- the training loop, as a user writes it, with the Guard's five lines ----------------------------
@dataclass
class Run:
    """The parts of one scenario's training run that differ between scenarios."""

    name: str
    model: torch.nn.Module
    steps: list[list[list[dict]]]
    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor]
    config: GuardConfig
    lr: float = 3e-3
    eps: float = 1e-8
    autocast: torch.dtype | None = None
    before_step: Callable[[int], None] | None = None
    warmup: int = 3


def train(run: Run, device: torch.device, echo: Echo) -> tuple[list[Path], str, list[float]]:
    """Trains `run` until the Guard stops it or the data ends. Returns (dumps, message, step losses)."""
    from transformers import get_linear_schedule_with_warmup

    model = run.model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, eps=run.eps, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, run.warmup, len(run.steps))
    amp = run.autocast is not None
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12, enabled=run.autocast == torch.float16)
    guard = Guard(model, optimizer, scheduler, scaler, config=run.config)  # forensics
    message, losses = "", []
    try:
        for step, micro_batches in enumerate(run.steps):
            if run.before_step is not None:
                run.before_step(step)
            step_loss = 0.0
            for records in micro_batches:
                batch = map_tensors(collate(records), lambda t: t.to(device))
                guard.record_batch(batch)  # forensics
                with torch.autocast(device.type, dtype=run.autocast or torch.bfloat16, enabled=amp):
                    loss = run.loss_fn(model, batch)
                    guard.record_loss(loss)  # forensics (inside autocast: the Guard records its dtype)
                scaler.scale(loss / len(micro_batches)).backward()
                step_loss += float(loss.detach()) / len(micro_batches)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if guard.check(grad_norm=grad_norm):  # forensics
                scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(step_loss)
            echo(
                f"  step {step:2d}   loss {step_loss:10.4g}   grad norm {float(grad_norm):9.4g}   "
                f"lr {scheduler.get_last_lr()[0]:.2e}"
            )
    except TrainingFaultError as fault:  # forensics: the Guard wrote the dump and stopped the run
        message = str(fault)
        echo(f"  training stopped: {fault}")
    finally:
        guard.close()
    if not message and guard.dumps:
        message = f"the Guard wrote a dump at step {_step_of(guard.dumps[0])} and training went on"
        echo(f"  {message}: {guard.dumps[0]}")
    return [Path(str(path)) for path in guard.dumps], message, losses  # the demo writes to a local directory


def _step_of(path: Location) -> int:
    return int(path.parent.name.removeprefix("step-"))


def _finish(run: Run, device: torch.device, echo: Echo, expected: Expected) -> Captured:
    dumps, message, losses = train(run, device, echo)
    if not dumps:
        raise ScenarioError(
            f"scenario {run.name!r}: the planted fault did not produce a dump ({message or 'nothing triggered'})"
        )
    return Captured(dump_path=dumps[0], expected=expected, step=_step_of(dumps[0]), message=message, losses=losses)


def _config(out_dir: Path, name: str, **groups: Any) -> GuardConfig:
    """The scenario's Guard settings (`groups`: GuardConfig's detection= / dumping= / recording=); dumps go to
    <out_dir>/dumps/<run id>/ (a fresh run id per run)."""
    dump_dir = out_dir / "dumps"
    return GuardConfig(dump_dir=str(dump_dir), run_id=free_run_id(dump_dir, f"demo-{name}"), **groups)


def free_run_id(dump_dir: Path, base: str) -> str:
    """`base`, or `base-2`, `base-3`... : the first run id with no dumps under `dump_dir` yet, so a
    second demo into the same folder does not collide with the first one's dump."""
    candidate, n = base, 1
    while (dump_dir / candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _recipe_of(factory: str, factory_kwargs: dict) -> dict:
    """GuardConfig.dumping.recipe naming a demo model factory, so replay rebuilds it without --trust, and the built-in
    loss `model(**batch).loss` that the demo's models answer (named, so the Guard does not doubt it)."""
    return {
        "factory": f"{models.MODULE}:{factory}",
        "factory_kwargs": factory_kwargs,
        "loss": "forensics.recipes:default_loss",
        "loss_kwargs": {"ignore_keys": ["sample_ids"]},
    }


# -- (a) bad_sample: a corrupted feature record --------------------------------------------------
def _bad_sample_scenario(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    from transformers import GPT2LMHeadModel

    seed_everything(0)
    n_embd = 32
    projection = torch.randn(n_embd, VOCAB, generator=torch.Generator().manual_seed(1))

    def record(gen: torch.Generator) -> dict:
        features = torch.randn(SEQ_LEN, n_embd, generator=gen)
        return {"inputs_embeds": features, "labels": (features @ projection).argmax(-1)}

    steps = make_steps(10, seed=3, make_record=record)
    bad = steps[6][1][2]  # a record whose features were mis-decoded: three tokens hold ~1e38
    bad["inputs_embeds"][5:8] = (torch.rand(3, n_embd, generator=torch.Generator().manual_seed(2)) * 2 - 1) * 1e38
    run = Run(
        "bad_sample",
        name_default_loss(GPT2LMHeadModel(models.gpt2_config(n_embd=n_embd))),
        steps,
        hf_loss,
        # replay rebuilds it as plain torch (the same numbers, bit for bit), without importing transformers
        _config(
            out_dir, "bad_sample", dumping=DumpConfig(recipe=_recipe_of("tiny_gpt2", {"config": {"n_embd": n_embd}}))
        ),
    )
    return _finish(
        run,
        device,
        echo,
        Expected("bad_sample", (bad["sample_ids"],), module="transformer.h.0.ln_1", phase=Phase.FORWARD),
    )


# -- (b) log(0) in a custom loss ------------------------------------------------------------------
def _log_zero(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    from transformers import GPT2LMHeadModel

    seed_everything(0)

    def record(gen: torch.Generator) -> dict:
        return {"input_ids": token_record(gen), "quality": 0.5 + 0.5 * torch.rand((), generator=gen)}

    steps = make_steps(10, seed=4, make_record=record)
    bad = steps[5][0][1]
    bad["quality"] = torch.tensor(0.0)  # the quality filter "rejected" it with weight 0 instead of dropping it
    config = _config(
        out_dir,
        "log_zero",
        dumping=DumpConfig(recipe={"loss": f"{models.MODULE}:quality_weighted_loss", "loss_kwargs": {}}),
    )
    model = name_default_loss(GPT2LMHeadModel(models.gpt2_config()))
    run = Run("log_zero", model, steps, models.quality_weighted_loss, config)
    return _finish(run, device, echo, Expected("bad_sample", (bad["sample_ids"],), op="aten::log", phase=Phase.FORWARD))


# -- (c) float16 overflow that fp32 does not have ---------------------------------------------------
def _fp16_overflow(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    seed_everything(0)
    n_features = 16
    projection = torch.randn(n_features, VOCAB, generator=torch.Generator().manual_seed(1))

    def record(gen: torch.Generator) -> dict:
        features = torch.randn(SEQ_LEN, n_features, generator=gen)
        return {"features": features, "labels": (features @ projection).argmax(-1)}

    steps = make_steps(10, seed=5, make_record=record)
    bad = steps[5][1][3]
    bad["features"] = bad["features"] * 300.0  # exported un-normalised: values of a few hundred
    kwargs: dict[str, Any] = {"n_features": n_features, "adapter_hidden": 64, "config": {}}
    model = models.adapter_lm(**kwargs)
    config = _config(out_dir, "fp16_overflow", dumping=DumpConfig(recipe=_recipe_of("adapter_lm", kwargs)))
    run = Run("fp16_overflow", model, steps, hf_loss, config, autocast=torch.float16)
    return _finish(
        run,
        device,
        echo,
        Expected("numerical_precision", (bad["sample_ids"],), module="adapter", op="aten::mul", phase=Phase.FORWARD),
    )


# -- (d) Adam with eps=0 on a parameter whose gradient is zero ---------------------------------------
def _adam_eps_zero(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    from transformers import GPT2LMHeadModel

    seed_everything(0)
    # 32 position embeddings, sequences of 16: rows 16..31 never get a gradient. eps=0 makes Adam
    # divide 0 by sqrt(0) for them on the first step that updates the position embeddings.
    model = name_default_loss(GPT2LMHeadModel(models.gpt2_config(n_positions=32)))
    wpe = model.transformer.wpe.weight
    wpe.requires_grad_(False)  # position embeddings frozen for the first steps, then unfrozen
    unfreeze_at = 4

    def before_step(step: int) -> None:
        if step == unfreeze_at:
            wpe.requires_grad_(True)

    steps = make_steps(8, seed=6, make_record=lambda gen: {"input_ids": (ids := token_record(gen)), "labels": ids})
    config = _config(out_dir, "adam_eps_zero", detection=DetectionConfig(verify_update=True))
    run = Run("adam_eps_zero", model, steps, hf_loss, config, eps=0.0, before_step=before_step)
    return _finish(
        run,
        device,
        echo,
        Expected(
            "optimizer_update",
            (),
            parameter="transformer.wpe.weight",
            phase=Phase.OPTIMIZER,
            trigger=TriggerKind.NONFINITE_PARAM,
            optimizer_state_words=("exp_avg_sq", "eps"),
        ),
    )


# -- (e) two samples that fail only together (batch statistics) ----------------------------------
def _pair(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    seed_everything(0)
    n_channels = 8

    def record(gen: torch.Generator) -> dict:
        features = torch.randn(n_channels, SEQ_LEN, generator=gen)  # channels first, as recorded
        return {"features": features, "labels": features[:4].mean(1).argmax()}

    steps = make_steps(10, seed=7, make_record=record)
    first, second = steps[5][1][0], steps[5][1][3]
    # The ingest job writes an overflowing reading as a sentinel, 0.75 x FLT_MAX. Two records of one micro-batch
    # each carry one on sensor 3. Either alone is harmless: its square overflows the channel variance to inf and
    # the layer outputs its bias there. Together their sum overflows the channel mean to inf, so every reading of
    # channel 3 standardises to NaN in the forward pass, the same on the CPU and on CUDA.
    first["features"][3, 5] = 0.75 * FLT_MAX
    second["features"][3, 9] = 0.75 * FLT_MAX
    kwargs: dict[str, Any] = {"n_channels": n_channels, "hidden": 32, "n_classes": 4}
    config = _config(out_dir, "pair", dumping=DumpConfig(recipe=_recipe_of("sensor_classifier", kwargs)))
    run = Run("pair", models.sensor_classifier(**kwargs), steps, dict_loss, config)
    return _finish(
        run,
        device,
        echo,
        Expected("bad_sample", (first["sample_ids"], second["sample_ids"]), module="bn", phase=Phase.FORWARD),
    )


# -- (f) silent data corruption: a NaN injected once, inside the job only -----------------------------
def _sdc(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    from transformers import GPT2LMHeadModel

    seed_everything(0)
    model = name_default_loss(GPT2LMHeadModel(models.gpt2_config()))
    fire_at = 4
    fired: list[bool] = []
    state = {"step": 0}

    def flip_one_activation(module, inputs, output):  # stands in for a flaky GPU: one value, once
        if state["step"] == fire_at and not fired:
            fired.append(True)
            output = output.clone()
            output[0, 7, 5] = float("nan")
            return output
        return None

    model.transformer.h[1].mlp.c_fc.register_forward_hook(flip_one_activation)

    def before_step(step: int) -> None:
        state["step"] = step

    steps = make_steps(8, seed=8, make_record=lambda gen: {"input_ids": (ids := token_record(gen)), "labels": ids})
    run = Run(
        "sdc", model, steps, hf_loss, _config(out_dir, "sdc", dumping=DumpConfig(recheck=True)), before_step=before_step
    )
    return _finish(run, device, echo, Expected("not_reproduced", (), reproduced=False))


# -- (g) a NaN that needs one particular dropout mask ---------------------------------------------------
def _dropout_mask(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    seed_everything(12)  # on the CPU the first all-dropping gate mask comes at step 7 (p = 1/16 a forward)
    kwargs: dict[str, Any] = {"n_gates": 4, "gate_dropout": 0.5, "aux_weight": 0.01, "config": {}}
    steps = make_steps(40, seed=9, make_record=lambda gen: {"input_ids": (ids := token_record(gen)), "labels": ids})
    config = _config(out_dir, "dropout_mask", dumping=DumpConfig(recipe=_recipe_of("gated_lm", kwargs)))
    run = Run("dropout_mask", models.gated_lm(**kwargs), steps, dict_loss, config)
    return _finish(run, device, echo, Expected("model_state", (), op="aten::log", phase=Phase.FORWARD))


# -- (h) a finite loss spike from one sample --------------------------------------------------------
def _spike_scenario(out_dir: Path, device: torch.device, echo: Echo) -> Captured:
    from transformers import GPT2ForSequenceClassification

    seed_everything(0)

    def record(gen: torch.Generator) -> dict:
        ids = token_record(gen)
        return {"input_ids": ids, "labels": ids.float().mean() / VOCAB}

    steps = make_steps(12, seed=10, make_record=record)
    bad = steps[8][0][2]
    bad["labels"] = bad["labels"] * 100.0  # its target was exported in percent, not as a fraction
    model = GPT2ForSequenceClassification(models.gpt2_config(num_labels=1, problem_type="regression", pad_token_id=0))
    config = _config(
        out_dir,
        "spike",
        detection=DetectionConfig(
            loss_spike=SpikeConfig(window=16, warmup=4), grad_norm_spike=SpikeConfig(enabled=False)
        ),
    )
    run = Run("spike", model, steps, hf_loss, config)
    return _finish(
        run,
        device,
        echo,
        Expected("bad_sample", (bad["sample_ids"],), trigger=TriggerKind.LOSS_SPIKE, top_sample=bad["sample_ids"]),
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "bad_sample",
            "one corrupted input record (values ~1e38) turns the loss NaN",
            "A GPT-2 trains on features precomputed by a frozen encoder. One record was mis-decoded: "
            "three of its tokens hold values around 1e38. Its first LayerNorm overflows and the loss "
            "goes NaN.",
            _bad_sample_scenario,
        ),
        Scenario(
            "log_zero",
            "a custom loss takes log(0) for one sample whose data-quality weight is 0",
            "The loss weights each sample by a data-quality score in log space (nll - log w). One "
            "record was rejected by the quality filter with weight 0 instead of being dropped.",
            _log_zero,
        ),
        Scenario(
            "fp16_overflow",
            "activations overflow float16 under autocast; fp32 is fine",
            "Features pass a SwiGLU adapter into a small Llama, trained with float16 autocast. One "
            "record was exported without normalisation (values of a few hundred): the adapter's "
            "products exceed float16's 65504.",
            _fp16_overflow,
        ),
        Scenario(
            "adam_eps_zero",
            "AdamW with eps=0 divides 0 by 0 for parameters with zero gradient",
            "AdamW runs with eps=0. When the position embeddings are unfrozen, the rows beyond the "
            "sequence length get exactly zero gradient, and Adam's update 0 / sqrt(0) is NaN.",
            _adam_eps_zero,
        ),
        Scenario(
            "pair",
            "two samples that fail only together in one micro-batch (batch statistics)",
            "A sensor classifier that standardises each channel with the micro-batch's statistics. Two records "
            "carry a 0.75 x FLT_MAX sentinel; each alone is harmless, but together in one micro-batch their sum "
            "overflows the channel mean and the forward pass turns NaN.",
            _pair,
        ),
        Scenario(
            "sdc",
            "one activation flips to NaN once, in the job only (simulated silent data corruption)",
            "A forward hook stands in for a faulty GPU: at one step it flips one activation to NaN. "
            "Replaying the same step on healthy hardware does not fail.",
            _sdc,
        ),
        Scenario(
            "dropout_mask",
            "a NaN that needs one particular dropout mask (reproduced only with the dump's RNG)",
            "A regulariser takes -log(sum of the gates kept by gate dropout). With four gates, a "
            "mask that drops all of them happens now and then: log(0).",
            _dropout_mask,
        ),
        Scenario(
            "spike",
            "a finite loss spike caused by one mislabelled sample (training continues)",
            "A GPT-2 regression head; one record's target was exported in percent instead of a "
            "fraction. The loss jumps 100-fold; the Guard dumps the step and training goes on.",
            _spike_scenario,
        ),
    ]
}

DEFAULT_SCENARIO = "bad_sample"


__all__ = ["SCENARIOS", "DEFAULT_SCENARIO", "Scenario", "Expected", "Captured", "ScenarioError", "train", "Run"]
