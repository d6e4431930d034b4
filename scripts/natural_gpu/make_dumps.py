"""Natural-run verdict suite (issue 41 item 6, issue 42 item 1): training runs that go wrong BY THEMSELVES under the
DEFAULT GuardConfig (only dump_dir, run id and a recipe / loss set), their dumps kept small enough for test data,
and each dump replayed as a user replays it:

    PYTHONPATH=. python scripts/natural_gpu/make_dumps.py OUT [--device cuda:0] [--only NAME] [--no-replay]
        [--replay-device cuda:0 --replay-device cpu] [--replay-code before=DIR --replay-code worktree=.]
        [--steps-scale 0.02] [--lrs 0.01,0.1 --sweep]

Nothing is planted: every record of every batch is drawn from one distribution. Scenarios (seeded; each bounded in
steps and wall time; nothing here depends on the exact step a run spikes or dies at):

* copy_fp16_loss_autocast_lr0.03 / _lr0.1 — nanoGPT's model (2 layers x 64, its configure_optimizers: AdamW, weight
  decay 0.1 on matrices, betas 0.9/0.95, fused on CUDA) on a copy task of i.i.d. uniform random tokens, no warm-up, no
  clipping, fp16 autocast entered INSIDE the user's loss function (models.copy_loss_fp16, given to the Guard), a
  GradScaler (issue 41: spikes, then a NaN at lr 0.1);
* copy_bf16 — the same copy task, bf16 autocast inside the loss, no GradScaler, a learning rate that spikes;
* hf_gpt2_fp16 — a Hugging Face GPT2LMHeadModel from a small config (random init, nothing downloaded) on random
  tokens, fp16 autocast entered by the loop, a GradScaler, AdamW at a learning rate that diverges;
* fp32_lr_divergence — a plain fused-AdamW loop in fp32 at lr 300 (issue 42 item 1: the grad norm overflows while
  every gradient value stays finite);
* attention_fp16_loop — nanoGPT's explicit-attention path on learnable sequences, fp16 autocast in the loop, a
  GradScaler, AdamW at a high learning rate: the attention logits grow until q.k overflows fp16 (Wortsman et al.
  2023);
* fp16_params_adam — the model cast with `.half()` (no autocast, no GradScaler), AdamW with its default eps 1e-8,
  which is 0 in fp16: Adam's denominator underflows and the first update is Inf/NaN.

Writes OUT/<scenario>/<step dir>/... (every dump the Guard kept on disk: its first and largest spike dumps, the
crash dump, as the Guard wrote them), OUT/packed/<scenario>-<step dir>.tar.zst (each packed by `forensics pack`:
about 60 % of the directory, what to check in as test data), OUT/<scenario>/losses.json (the loss of every step),
OUT/reports/<code>-<device>/<scenario>/<step dir>/ (each replay's report; the replay runs on a scratch copy of the
dump), OUT/replay_cmds.sh (commands to replay them again) and OUT/summary.json (per scenario: the learning rates
tried, the spike and non-finite steps, each dump's trigger, size and verdicts). A scenario whose run leaves no dump
of the kind it is for is tried at its next learning rate (`lrs`), within its wall-time cap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from forensics.capture import DumpConfig, Guard, GuardConfig  # noqa: E402
from forensics.core.errors import TrainingFaultError  # noqa: E402
from forensics.format import pack_dump  # noqa: E402
from scripts.natural_gpu import models  # noqa: E402

MODELS = "scripts.natural_gpu.models"
NONFINITE = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "exception")


@dataclass(frozen=True)
class Scenario:
    name: str
    lrs: tuple  # tried in order until a run leaves the dumps the scenario is for
    steps: int  # the run is cut here if it has not died
    cap_s: float  # and here, in wall seconds (all tries together)
    data: str = "copy"  # "copy" | "sequences" | "random_tokens"
    model: str = "gpt"  # "gpt" | "hf_gpt2"
    model_kwargs: dict = field(default_factory=dict)
    loss: str | None = "copy_loss"  # a function of models.py, given to the Guard as its loss_fn (None for HF: default)
    loop_autocast: str | None = None  # "float16" | "bfloat16": entered by the loop around the loss
    scaler: bool = False
    half_params: bool = False
    fused: bool = False  # "plain" optimizer: AdamW(fused=True)
    optim: str = "nanogpt"  # "nanogpt": nanoGPT's configure_optimizers (wd 0.1 on matrices, betas 0.9/0.95, fused
    # on CUDA); "plain": AdamW's defaults
    wants: str = "crash"  # "crash": a non-finite dump; "spike": at least one spike dump
    batch: int = 16
    note: str = ""


GPT_2x64 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 64, "block_size": 32}
GPT_2x32 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "block_size": 32}

# The learning rates come from a sweep on an H100 (2026-11-27, torch 2.11; BENCHMARKS.md / the lead's notes): the copy
# task with the loss's own fp16 autocast spikes at lr 0.01-0.03 (first spike ~120) and dies at 0.1 (~340) and 0.3
# (~200); in bf16 it spikes at every lr from 0.01 to 0.3 and never dies within 2000 steps; the HF GPT-2 spikes at
# 0.03-0.3 and dies at 1.0 (~step 11); the explicit attention dies at 0.1 (~1640, after three spikes) and 0.3 (~66).
SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "copy_fp16_loss_autocast_lr0.03",
            (0.03,),
            3000,
            60,
            loss="copy_loss_fp16",
            scaler=True,
            model_kwargs=GPT_2x64,
            wants="spike",
            note="issue 41: spikes ~138/349/976, NaN ~1017 on an H100 (its own setup)",
        ),
        Scenario(
            "copy_fp16_loss_autocast_lr0.1",
            (0.1,),
            1500,
            60,
            loss="copy_loss_fp16",
            scaler=True,
            model_kwargs=GPT_2x64,
            note="issue 41: NaN ~280 on an H100 (its own setup)",
        ),
        Scenario(
            "copy_bf16",
            (0.03, 0.01),
            2000,
            60,
            loss="copy_loss_bf16",
            model_kwargs=GPT_2x64,
            wants="spike",
            note="issue 41: 4 spike dumps",
        ),
        Scenario(
            "hf_gpt2_fp16",
            (0.5, 1.0),
            2000,
            60,
            model="hf_gpt2",
            data="random_tokens",
            loss=None,
            loop_autocast="float16",
            scaler=True,
            optim="plain",
            model_kwargs={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32},
        ),
        Scenario(
            "fp32_lr_divergence",
            (300.0, 1000.0),
            200,
            30,
            model_kwargs={**GPT_2x32, "flash": False},
            optim="plain",
            fused=True,
            note="issue 42 item 1: the norm overflows at ~step 10",
        ),
        Scenario(
            "attention_fp16_loop",
            (0.1, 0.3),
            2000,
            60,
            data="sequences",
            loop_autocast="float16",
            scaler=True,
            model_kwargs={**GPT_2x32, "flash": False},
        ),
        Scenario("fp16_params_adam", (1e-3,), 300, 30, half_params=True, optim="plain", model_kwargs=GPT_2x32),
    )
}


def batches(scenario: Scenario, vocab: int, seed: int):
    if scenario.data == "copy":
        return models.copy_batches(scenario.batch, 16, vocab, seed=seed)
    if scenario.data == "sequences":
        return models.sequence_batches(scenario.batch, 32, vocab, seed=seed)
    return models.random_token_batches(scenario.batch, 32, vocab, seed=seed)


def build(scenario: Scenario, seed: int) -> tuple[torch.nn.Module, dict | None]:
    """The model and the recipe the dump records (None: the Guard's automatic Hugging Face recipe)."""
    if scenario.model == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(seed)
        config = GPT2Config(
            **scenario.model_kwargs, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
        )
        return GPT2LMHeadModel(config), None
    recipe = {"factory": f"{MODELS}:build_gpt", "factory_kwargs": {"seed": seed, **scenario.model_kwargs}}
    return models.build_gpt(seed, **scenario.model_kwargs), recipe


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass


def train(
    scenario: Scenario, lr: float, dump_dir: Path, device: str, steps: int, deadline: float, seed: int = 0
) -> dict:
    """One run under the default GuardConfig; returns what happened (dumps on disk, losses, the first non-finite
    loss)."""
    seed_everything(seed)
    model, recipe = build(scenario, seed)
    model = model.to(device)
    if scenario.half_params:
        model = model.half()
    device_type = torch.device(device).type
    if scenario.optim == "nanogpt":
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device_type == "cuda" or None)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=scenario.fused or None)
    scaler = torch.amp.GradScaler(device_type) if scenario.scaler else None
    loss_fn = getattr(models, scenario.loss) if scenario.loss else None
    dumping = DumpConfig(recipe=recipe) if recipe else DumpConfig()
    run_id = f"{scenario.name}-lr{lr:g}"
    guard = Guard(
        model,
        optimizer,
        scaler=scaler,
        loss_fn=loss_fn,
        config=GuardConfig(dump_dir=str(dump_dir), run_id=run_id, dumping=dumping),
    )
    loop_dtype = getattr(torch, scenario.loop_autocast) if scenario.loop_autocast else None
    losses: list[float | None] = []
    first_nonfinite, fault, stopped = None, None, "steps"
    started = time.time()
    try:
        for step, batch in zip(range(steps), batches(scenario, scenario.model_kwargs["vocab_size"], seed + 1)):
            if time.time() > deadline:
                stopped = "wall time"
                break
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            guard.record_batch(batch)
            inputs = {k: v for k, v in batch.items() if k != "sample_ids"}
            with torch.autocast(device_type, dtype=loop_dtype or torch.float32, enabled=loop_dtype is not None):
                loss = loss_fn(model, batch) if loss_fn is not None else model(**inputs).loss
            guard.record_loss(loss)
            value = float(loss.detach())
            losses.append(round(value, 5) if math.isfinite(value) else None)
            if first_nonfinite is None and not math.isfinite(value):
                first_nonfinite = step
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if guard.check():
                (scaler.step(optimizer) if scaler is not None else optimizer.step())
            if scaler is not None:
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
    except TrainingFaultError as exc:
        fault, stopped = exc, "fault"
    try:
        guard.close()  # the sync-free check judges the last step here, and may raise for it
    except TrainingFaultError as exc:
        fault, stopped = fault or exc, "fault at close"
    return {
        "lr": lr,
        "run_id": run_id,
        "steps_run": len(losses),
        "stopped_by": stopped,
        "first_nonfinite_loss_step": first_nonfinite,
        "fault": str(fault).splitlines()[0] if fault else None,
        "seconds": round(time.time() - started, 1),
        "losses": losses,
        "dumps": [Path(p) for p in guard.dumps if Path(p).exists()],
    }


def describe_dump(path: Path) -> dict:
    from forensics.format import open_dump

    dump = open_dump(path)
    trigger = dump.trigger
    loss = dump.manifest.get("loss") or {}
    return {
        "step": dump.step,
        "trigger": str(getattr(trigger.kind, "value", trigger.kind)),
        "trigger_detail": {
            k: v
            for k, v in (dump.manifest.get("trigger") or {}).items()
            if isinstance(v, (int, float, str, bool)) or v is None
        },
        "loss": loss.get("step_loss"),
        "grad_norm": loss.get("grad_norm"),
        "grad_norm_unscaled_by": loss.get("grad_norm_unscaled_by"),
        "dump_budget": dump.manifest.get("dump_budget"),
    }


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def keep(dump: Path, dest: Path) -> Path:
    """Copies the dump's step directory (the rank dir's parent, when it has one) under dest; returns the copied
    path that replay takes (the same relative form)."""
    step_dir = dump.parent if dump.name.startswith("rank") else dump
    target = dest / step_dir.name
    shutil.copytree(step_dir, target, dirs_exist_ok=True)
    return target / dump.name if step_dir != dump else target


def replay(dump: Path, report_dir: Path, device: str, timeout: float, code: Path = REPO) -> dict:
    """`forensics replay DUMP --device D --trust --json -o REPORT_DIR`, as a user runs it, on a scratch copy of the
    dump's step directory (a replay writes beside the dump: the kept dump stays as the Guard wrote it); its
    verdict."""
    scratch = report_dir / "dump"
    source = dump.parent if dump.name.startswith("rank") else dump
    shutil.copytree(source, scratch / source.name, dirs_exist_ok=True)
    copy = scratch / source.name / dump.name if source != dump else scratch / source.name
    cmd = [
        sys.executable,
        "-m",
        "forensics.cli",
        "replay",
        str(copy),
        "--device",
        device,
        "--trust",
        "--json",
        "-o",
        str(report_dir),
    ]
    try:
        return _replay(cmd, report_dir, timeout, code)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _replay(cmd: list, report_dir: Path, timeout: float, code: Path) -> dict:
    paths = [str(code)] + ([str(REPO)] if code != REPO else []) + [os.environ.get("PYTHONPATH", "")]
    env = {"OMP_NUM_THREADS": "2", **os.environ, "PYTHONPATH": os.pathsep.join(paths).rstrip(os.pathsep)}
    started = time.time()
    try:
        # cwd: `python -m` puts it first on sys.path, so it decides which forensics is imported
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(code))
    except subprocess.TimeoutExpired:
        return {
            "exit_code": None,
            "error": f"timed out after {timeout:.0f} s",
            "seconds": round(time.time() - started, 1),
        }
    out: dict[str, Any] = {"exit_code": done.returncode, "seconds": round(time.time() - started, 1)}
    try:
        report = json.loads(done.stdout[done.stdout.index("{") :])
    except ValueError:
        out["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:400]
        return out
    verdict = report.get("verdict") or {}
    culprit = report.get("culprit") or {}
    precision = report.get("precision") or {}
    out.update(
        kind=verdict.get("kind"),
        headline=verdict.get("headline"),
        samples=[s.get("sample_id") for s in culprit.get("samples") or []],
        reproduced=report.get("reproduced"),
        precision={k: v for k, v in precision.items() if isinstance(v, (int, float, str, bool)) or v is None},
        blocklist=any(report_dir.rglob("blocklist*.jsonl")),
    )
    return out


def run_scenario(scenario: Scenario, out: Path, device: str, steps_scale: float, sweep: bool = False) -> dict:
    started = time.time()
    deadline = started + scenario.cap_s * (len(scenario.lrs) if sweep else 1)
    work = out / "_work" / scenario.name
    tries: list[dict] = []
    runs: list[tuple] = []
    for lr in scenario.lrs:
        if time.time() > deadline:
            break
        steps = max(1, int(scenario.steps * steps_scale))
        run = train(scenario, lr, work / f"lr{lr:g}", device, steps, deadline)
        described = [describe_dump(p) for p in run["dumps"]]
        kinds = [d["trigger"] for d in described]
        got = any(k in NONFINITE for k in kinds) if scenario.wants == "crash" else any("spike" in k for k in kinds)
        tries.append(
            {k: v for k, v in run.items() if k not in ("losses", "dumps")}
            | {"triggers": [f"{d['step']}:{d['trigger']}" for d in described], "loss_every_100": run["losses"][::100]}
        )
        print(
            f"  {scenario.name} lr={lr:g}: {run['steps_run']} steps, {run['seconds']} s, stopped by "
            f"{run['stopped_by']}, dumps {tries[-1]['triggers']}",
            flush=True,
        )
        runs.append((got, len(run["dumps"]), -len(runs), run))
        if got and not sweep:
            break
    # the run that left the dumps the scenario is for, else the one that left the most
    chosen = max(runs, key=lambda r: r[:3])[3] if runs else None
    dest = out / scenario.name
    dest.mkdir(parents=True, exist_ok=True)
    (out / "packed").mkdir(exist_ok=True)
    dumps = []
    if chosen is not None:
        (dest / "losses.json").write_text(json.dumps({"lr": chosen["lr"], "losses": chosen["losses"]}))
        for path in sorted(chosen["dumps"], key=lambda p: describe_dump(p)["step"]):
            kept = keep(path, dest)
            step_dir = kept.parent if kept.name.startswith("rank") else kept
            packed = pack_dump(step_dir, out / "packed" / f"{scenario.name}-{step_dir.name}.tar.zst")
            entry = {
                "path": str(kept.relative_to(out)),
                "bytes": dir_bytes(step_dir),
                "packed": str(packed.relative_to(out)),
                "packed_bytes": packed.stat().st_size,
            } | describe_dump(kept)
            dumps.append(entry)
    summary = {
        "scenario": scenario.name,
        "note": scenario.note,
        "lr": chosen["lr"] if chosen else None,
        "tries": tries,
        "spike_steps": [d["step"] for d in dumps if "spike" in d["trigger"]],
        "nonfinite_steps": [d["step"] for d in dumps if d["trigger"] in NONFINITE],
        "first_nonfinite_loss_step": chosen["first_nonfinite_loss_step"] if chosen else None,
        "dumps": dumps,
        "dump_bytes": sum(d["bytes"] for d in dumps),
        "packed_bytes": sum(d["packed_bytes"] for d in dumps),
        "train_seconds": round(time.time() - started, 1),
    }
    summary["wall_seconds"] = round(time.time() - started, 1)
    return summary


def replay_all(results: list, out: Path, devices: list, codes: dict, timeout: float, workers: int) -> None:
    """Replays every kept dump on each device with each code (name -> directory holding the forensics, capture
    and replay packages), `workers` replays at a time; writes entry["replay"]["CODE@DEVICE"]."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [
        (r["scenario"], entry, device, code)
        for r in results
        for entry in r["dumps"]
        for code in codes
        for device in devices
    ]

    def one(job):
        scenario, entry, device, code = job
        report_dir = out / "reports" / f"{code}-{device.replace(':', '')}" / scenario / Path(entry["path"]).parts[1]
        return job, replay(out / entry["path"], report_dir, device, timeout, codes[code])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for (scenario, entry, device, code), verdict in pool.map(one, jobs):
            entry.setdefault("replay", {})[f"{code}@{device}"] = verdict
            print(
                f"  replay {scenario} step {entry['step']} ({entry['trigger']}) {code}@{device}: {verdict.get('kind')} "
                f"exit {verdict.get('exit_code')}, {verdict.get('seconds')} s — "
                f"{(verdict.get('headline') or verdict.get('error') or '')[:200]}",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run these scenarios (repeatable)")
    parser.add_argument(
        "--steps-scale", type=float, default=1.0, help="scale every scenario's step bound (a smoke test: 0.02)"
    )
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--lrs", help="comma-separated learning rates instead of each scenario's ladder")
    parser.add_argument("--sweep", action="store_true", help="try every learning rate of the ladder (tuning)")
    parser.add_argument(
        "--replay-device", action="append", help="replay every dump on this device too (repeatable; default: --device)"
    )
    parser.add_argument(
        "--replay-code",
        action="append",
        metavar="NAME=DIR",
        help="replay with the forensics / "
        "capture / replay packages under DIR too (e.g. a `git archive` of a commit; repeatable; "
        "default: this checkout, named 'worktree')",
    )
    parser.add_argument("--replay-workers", type=int, default=4, help="replays at a time")
    parser.add_argument("--replay-timeout", type=float, default=240.0)
    parser.add_argument(
        "--replay-existing",
        action="store_true",
        help="train nothing: replay the dumps OUT/summary.json lists (as a run of this script wrote them)",
    )
    args = parser.parse_args()
    args.out = args.out.resolve()
    torch.set_num_threads(min(4, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    device = args.device
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join(sys.argv),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(json.dumps(info), flush=True)
    results = []
    if args.replay_existing:
        made = json.loads((args.out / "summary.json").read_text())
        results = [r for r in made["scenarios"] if not args.only or r["scenario"] in args.only]
        for r in results:
            for d in r["dumps"]:
                d.pop("replay", None)
        info["made"] = {k: v for k, v in made.items() if k != "scenarios"}
    for name in [] if args.replay_existing else args.only or list(SCENARIOS):
        print(f"{name} ...", flush=True)
        scenario = SCENARIOS[name]
        if args.lrs:
            scenario = dataclasses.replace(scenario, lrs=tuple(float(x) for x in args.lrs.split(",")))
        results.append(run_scenario(scenario, args.out, device, args.steps_scale, args.sweep))
        (args.out / "summary.json").write_text(json.dumps(info | {"scenarios": results}, indent=1, default=str))
    shutil.rmtree(args.out / "_work", ignore_errors=True)
    info["train_seconds"] = round(time.time() - started, 1)
    if not args.no_replay:
        codes = dict(c.split("=", 1) for c in args.replay_code or ["worktree=" + str(REPO)])
        info["replay_code"] = codes
        replay_all(
            results,
            args.out,
            args.replay_device or [device],
            {k: Path(v).resolve() for k, v in codes.items()},
            args.replay_timeout,
            args.replay_workers,
        )
    info["wall_seconds"] = round(time.time() - started, 1)
    info["dump_bytes"] = sum(r["dump_bytes"] for r in results)
    info["packed_bytes"] = sum(r.get("packed_bytes", 0) for r in results)
    (args.out / "summary.json").write_text(json.dumps(info | {"scenarios": results}, indent=1, default=str))
    lines = [
        "# Replays every dump of the natural suite with the code of the checkout it runs in. From the repository root:",
        "#   DUMPS=THIS_SCRIPTS_OUT REPORTS=OUTDIR DEVICE=cuda:0 bash replay_cmds.sh",
        "# (the packed archives; a replay of a dump directory writes replays.jsonl beside it)",
        "set -u",
        'mkdir -p "$REPORTS"',
    ]
    for r in results:
        for d in r["dumps"]:
            name = f"{r['scenario']}-{d['step']}"
            lines.append(
                f'PYTHONPATH=. python3 -m forensics.cli replay "$DUMPS/{d.get("packed", d["path"])}" --device "$DEVICE" '
                f'--trust --json -o "$REPORTS/{name}" > "$REPORTS/{name}.json"; echo "{name} exit $?"'
            )
    (args.out / "replay_cmds.sh").write_text("\n".join(lines) + "\n")
    order = [f"{c.split('=')[0]}@{d}" for c in args.replay_code or ["worktree"] for d in args.replay_device or [device]]
    print(f"{'scenario':34} {'lr':>6} {'spikes':18} {'nonfinite':10} {'MB':>5} {'s':>6}  verdicts")
    for r in results:
        verdicts = ", ".join(
            f"{d['step']}:" + "/".join(str((d.get("replay") or {}).get(o, {}).get("kind")) for o in order)
            for d in r["dumps"]
        )
        print(
            f"{r['scenario']:34} {r['lr'] or 0:>6g} {str(r['spike_steps']):18} {str(r['nonfinite_steps']):10} "
            f"{r['dump_bytes'] / 1e6:5.2f} {r['wall_seconds']:6.1f}  {verdicts}"
        )
    print(
        f"total {info['dump_bytes'] / 1e6:.2f} MB of dumps ({info['packed_bytes'] / 1e6:.2f} MB packed), {info['wall_seconds']} s (verdicts: {' / '.join(order)})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
