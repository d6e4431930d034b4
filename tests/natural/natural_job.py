"""Training runs that diverge by themselves — no planted value — under a Guard: the natural-instability suite.

Each scenario trains the tiny transformer of natural_models.py on learnable token sequences, seeded, one thread,
with a setting a user gets wrong (tests/natural/test_natural_runs.py runs them on the CPU; on a GPU:

    python tests/natural/natural_job.py OUTDIR --scenario attention_fp16 [--device cuda:0] [--precursors]

prints one JSON line (where it went non-finite, the dumps it left, the crash dump's verdict after replay, the
precursor's lead) and exits 1 unless the run left its crash dump, its replay blames no sample and gives the
scenario's verdict kind, and — with --precursors, where the physics gives a warning — a precursor came >= 10 steps
ahead naming a block):

* attention_fp16 — fp16 autocast + GradScaler, AdamW at lr 0.1, no warm-up, no QK-norm: the queries and keys grow
  until q·k overflows fp16 (Wortsman et al. 2023's attention-logit growth);
* output_logits — fp16 autocast + GradScaler, no final norm, no z-loss (QK-norm on), SGD whose learning rate keeps
  rising: the residual stream and the output logits grow until the output projection overflows fp16;
* lr_too_high — fp32, SGD with momentum far above the stable step size, no warm-up, no clipping: the loss grows
  geometrically to Inf within ~70 steps;
* spiky_late — fp32 SGD whose data mixes in a harder, shifted source every 7th step (spikes that recover) and whose
  learning rate keeps rising (a schedule with no decay): it spikes, then dies late (~240 steps).

Not here (tried, issue 30): Adam second-moment collapse (AdamW eps 1e-16, beta2 0.99-0.999, rare tokens every 40
steps, fp32 and fp16) did not diverge within 400 steps on this tiny model — Adam's update is bounded by
lr x (1 - beta1) / sqrt(1 - beta2), so the collapse makes spikes, not a NaN, without something to amplify them.

Every run uses the DEFAULT GuardConfig (plus its dump directory, run id and recipe); --precursors adds
PrecursorConfig() (opt-in: docs/GUIDE.md "Precursors: see it coming"). Nothing here depends on the exact step a run dies at: the
checks are kinds and ranges.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from natural_models import build, lm_loss  # noqa: E402

from forensics.capture import DumpConfig, Guard, GuardConfig, PrecursorConfig  # noqa: E402
from forensics.core.errors import TrainingFaultError  # noqa: E402

AHEAD = 10  # the promise: a precursor at least this many steps before the non-finite step
VOCAB, SEQ, BATCH = 64, 17, 8


@dataclass(frozen=True)
class Scenario:
    name: str
    optimizer: str  # "adamw" | "sgd"
    lr: float
    steps: int  # the run is cut here if it has not diverged (the test then fails: it must diverge)
    autocast: str | None = None  # "float16" | "bfloat16" | None
    scaler: bool = False
    model: dict = field(default_factory=dict)
    lr_growth: float = 0.0  # per step: lr x (1 + lr_growth x step), a schedule that never decays
    data: str = "sequences"  # "sequences" | "mixed"
    verdicts: tuple = ()  # the verdict kinds its crash dump's replay may give
    precursor_lead: bool = True  # whether a precursor must come >= AHEAD steps before the crash (physics allows)
    lead_statistics: tuple = ()  # the statistics a leading precursor may name ((): any)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "attention_fp16",
            "adamw",
            0.1,
            320,
            autocast="float16",
            scaler=True,
            verdicts=("numerical_precision",),
            lead_statistics=("attention_logit_bound",),
        ),
        # no final norm (QK-norm holds the attention), a learning rate that keeps rising: the residual stream and with it
        # the output logits grow until they overflow fp16 in the output projection. The last growth is geometric over a
        # few steps (the precursor came 6 steps ahead, on the update/weight ratio): no lead is promised
        Scenario(
            "output_logits",
            "sgd",
            0.05,
            420,
            autocast="float16",
            scaler=True,
            lr_growth=0.03,
            model={"final_norm": False, "qk_norm": True},
            verdicts=("numerical_precision",),
            precursor_lead=False,
        ),
        # dies within ~70 steps: inside the precursor monitor's 64-step warm-up, so no lead is promised
        Scenario("lr_too_high", "sgd", 1.0, 240, verdicts=("optimizer_update", "model_state"), precursor_lead=False),
        Scenario(
            "spiky_late",
            "sgd",
            0.1,
            1000,
            lr_growth=0.03,
            data="mixed",
            verdicts=("optimizer_update", "model_state", "numerical_precision"),
        ),
    )
}


def batches(kind: str, seed: int = 1):
    """Seeded batches of learnable sequences (start + stride x t mod VOCAB), with their sample IDs. "mixed": every
    7th step's batch comes from a second source with larger strides (a harder distribution: spikes that recover)."""
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        stride = torch.randint(1, 6, (BATCH, 1), generator=gen)
        if kind == "mixed" and step % 7 == 6:
            stride = stride + 6
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        yield {"input_ids": ids, "sample_ids": [f"s{step}-{i}" for i in range(BATCH)]}
        step += 1


@dataclass
class Run:
    guard: Guard
    nonfinite_at: int | None
    dumps: list


def recipe(scenario: Scenario) -> dict:
    return {"factory": "natural_models:build", "factory_kwargs": dict(scenario.model), "loss": "natural_models:lm_loss"}


def train(
    scenario: Scenario, dump_dir, device: str = "cpu", precursors: bool = False, seed: int = 0, fused: bool = False
) -> Run:
    """Trains the scenario under the default GuardConfig (PrecursorConfig() added with `precursors`); returns the
    closed Guard, the first step whose loss or gradients were non-finite, and its dumps. `fused`: the fused optimizer,
    with which the default configuration runs the sync-free check (unless a GradScaler or the precursors keep the
    synchronous one)."""
    torch.manual_seed(seed)
    model = build(seed, **scenario.model).to(device)
    if scenario.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=scenario.lr, momentum=0.9, fused=fused)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=scenario.lr, weight_decay=0.0, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 + scenario.lr_growth * s)
    dtype = getattr(torch, scenario.autocast) if scenario.autocast else None
    scaler = torch.amp.GradScaler(torch.device(device).type) if scenario.scaler else None
    config = GuardConfig(
        dump_dir=str(dump_dir),
        run_id=f"natural-{scenario.name}",
        precursors=PrecursorConfig() if precursors else None,
        dumping=DumpConfig(recipe=recipe(scenario)),
    )
    guard = Guard(model, optimizer, schedule, scaler, config=config, loss_fn=lm_loss)
    nonfinite_at = None
    try:
        for step, batch in zip(range(scenario.steps), batches(scenario.data, seed + 1)):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            guard.record_batch(batch)
            with torch.autocast(torch.device(device).type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = lm_loss(model, batch)
                guard.record_loss(loss)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # no clipping: only the norm
            if nonfinite_at is None and not math.isfinite(float(loss.detach())):
                nonfinite_at = step
            if guard.check(grad_norm=norm):
                (scaler.step(optimizer) if scaler is not None else optimizer.step())
            if scaler is not None:
                scaler.update()
            schedule.step()
            optimizer.zero_grad()
    except TrainingFaultError:
        pass
    finally:
        guard.close()
    return Run(guard, nonfinite_at, list(guard.dumps))


def summarize(scenario: Scenario, run: Run, device: str = "cpu", replay: bool = True) -> dict:
    """What a user checks after the run: the crash dump, its verdict after replay, the samples it blames, the
    precursor's lead (JSON-safe)."""
    from forensics.format import open_dump
    from forensics.core.kinds import TriggerKind

    triggers = [(p, open_dump(p)) for p in run.dumps]
    crash = next(
        (
            (p, d)
            for p, d in reversed(triggers)
            if d.trigger.kind in (TriggerKind.NONFINITE_LOSS, TriggerKind.NONFINITE_GRAD, TriggerKind.NONFINITE_PARAM)
        ),
        None,
    )
    precursor = next(((p, d) for p, d in triggers if d.trigger.kind == TriggerKind.PRECURSOR), None)
    out = {
        "scenario": scenario.name,
        "device": device,
        "nonfinite_at": run.nonfinite_at,
        "dumps": [f"{d.step}:{d.trigger.kind}" for _, d in triggers],
        "crash_step": None,
    }
    if crash is not None:
        out["crash_step"] = crash[1].step
        out["crash_kind"] = crash[1].trigger.kind
    if precursor is not None:
        table = precursor[1].precursors() or {}
        fired = next((f for f in reversed(table.get("firings") or []) if f.get("dumped")), {})
        out.update(
            precursor_step=precursor[1].step,
            precursor_layer=fired.get("layer"),
            precursor_statistic=fired.get("statistic"),
            precursor_rule=fired.get("rule"),
        )
        if crash is not None:
            out["ahead"] = crash[1].step - precursor[1].step
    if replay and crash is not None:
        from forensics.replay.engine import ReplayOptions, run_replay

        report = run_replay(crash[0], ReplayOptions(device=device, trust=True, sys_path=[str(HERE)]))
        out.update(
            verdict=report["verdict"]["kind"],
            headline=report["verdict"]["headline"],
            samples=[s.get("sample_id") for s in report["culprit"]["samples"]],
            precursor_history=(report.get("precursor_history") or {}).get("sentence"),
        )
    return out


def judge(scenario: Scenario, out: dict, precursors: bool) -> list[str]:
    """What is wrong with a run's summary (empty: it holds)."""
    problems = []
    if out.get("crash_step") is None:
        problems.append("no crash dump")
    if "verdict" in out and out["verdict"] not in scenario.verdicts:
        problems.append(f"verdict {out['verdict']} not in {scenario.verdicts}")
    if out.get("samples"):
        problems.append(f"samples blamed: {out['samples']}")
    if precursors and scenario.precursor_lead:
        if out.get("ahead") is None or out["ahead"] < AHEAD:
            problems.append(f"no precursor >= {AHEAD} steps ahead (ahead: {out.get('ahead')})")
        elif scenario.lead_statistics and out.get("precursor_statistic") not in scenario.lead_statistics:
            problems.append(f"the precursor named {out.get('precursor_statistic')}, not {scenario.lead_statistics}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="dump directory")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precursors", action="store_true", help="add PrecursorConfig() (opt-in)")
    parser.add_argument("--fused", action="store_true", help="the fused optimizer (the sync-free check by default)")
    args = parser.parse_args()
    scenario = SCENARIOS[args.scenario]
    run = train(scenario, args.out, args.device, precursors=args.precursors, fused=args.fused)
    out = summarize(scenario, run, args.device)
    out["problems"] = judge(scenario, out, args.precursors)
    print(json.dumps(out))
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
