"""Benchmark: what the silent-corruption checks (DetectionConfig.silent) cost a healthy step, from per-step times of
the same run.

One process (default): GPT-2 small (124M) on a GPU, bf16 autocast, fused AdamW, `--micro` x `--batch` x 1024 tokens
(CPU: a 4-layer stand-in, 128 tokens). Modes: guarded (GuardConfig()) and recompute (SilentConfig(recompute_every=
EVERY, replica_every=0)): each round builds each mode's Guard afresh, warms it up and times `--steps` steps one by
one (each ends with a device sync), marking which were sampled. Cost of a sampled step = its median - the unsampled
median of the same run (paired: the machine's drift cancels); amortised at the default period = that cost /
SilentConfig().recompute_every / the guarded step, plus (unsampled - guarded) / guarded (no hook is installed on an
unsampled step: this column shows drift; the modes run in a rotating order, one round each first). Mismatches seen (false alarms: none expected with deterministic algorithms)
are counted, never dumped.
Under torchrun with 2+ ranks (`--ddp`): the model is DDP-wrapped and the modes are guarded, replicas
(replica_every=EVERY, the recompute off) and recompute (with the cross-rank check): the replica check's cost per
checked step (with the after-update digest its previous step takes, timed apart as "before") and amortised at its
default period; an "unsampled" step neither is checked nor precedes a check.
The recompute compares bits: CUDA runs use torch.use_deterministic_algorithms(True) (CUBLAS_WORKSPACE_CONFIG set),
as a job using the check should (docs/GUIDE.md, "Silent corruption").
Usage: python -m scripts.bench.silent_overhead [--rounds 3] [--steps 24] [--micro 2 --batch 4] [--json OUT]
       torchrun --nproc-per-node 2 -m scripts.bench.silent_overhead --ddp [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SilentConfig
from forensics.core.kinds import Policy
from scripts.bench.common import gpt2, machine, median, sync

EVERY = 4  # the bench's sampling period: a quarter of the steps sampled, so both kinds have many samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    rank = 0
    if args.ddp:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = torch.distributed.get_rank()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        torch.use_deterministic_algorithms(True)
    size, seq = ("small", 1024) if device.startswith("cuda") else ("tiny", 128)
    torch.manual_seed(0)
    model: Any = gpt2(size, device, dropout=0.0)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if args.ddp else model
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
    generator = torch.Generator(device=device).manual_seed(rank)
    data = [
        {
            "input_ids": torch.randint(0, vocab, (args.batch, seq), device=device, generator=generator),
            "sample_ids": list(range(i * args.batch, (i + 1) * args.batch)),
        }
        for i in range(args.micro)
    ]

    def loss_fn(m, batch):
        return m(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def step(guard: Guard) -> None:
        for b in data:
            guard.record_batch(b)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                loss = loss_fn(wrapped, b)
            guard.record_loss(loss)
            (loss / args.micro).backward()
        if guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    modes = {
        "guarded": None,
        "recompute": SilentConfig(recompute_every=EVERY, replica_every=0, on_mismatch=Policy.CONTINUE),
    }
    if args.ddp:
        modes["replicas"] = SilentConfig(recompute_every=0, replica_every=EVERY, on_mismatch=Policy.CONTINUE)
    mismatches = dict.fromkeys(modes, 0)

    def fresh(mode: str) -> Guard:
        config = GuardConfig(
            dump_dir=tempfile.mkdtemp(),
            detection=DetectionConfig(on_nonfinite=Policy.CONTINUE, silent=modes[mode]),
            dumping=DumpConfig(max_dumps=0),
        )
        guard = Guard(wrapped, optimizer, config=config, loss_fn=loss_fn)
        original = guard.handle_incident

        def counted(incident):
            mismatches[mode] += 1
            return original(incident)

        guard.handle_incident = counted  # type: ignore[method-assign]  # the bench counts, nothing is dumped
        return guard

    def kind(guard: Guard, mode: str) -> str:
        silent = guard.silent
        if silent is None:
            return "unsampled"
        if mode == "replicas":
            replicas = silent.replicas
            if replicas is not None and replicas.due(guard.step):
                return "sampled"
            # the update before a checked step takes its after-update digest: part of the check's cost
            return "before" if replicas is not None and replicas.due(guard.step + 1) else "unsampled"
        return "sampled" if silent.sampled(guard.step) else "unsampled"

    times: dict[tuple[str, str], list[float]] = {(m, k): [] for m in modes for k in ("unsampled", "sampled", "before")}
    names = list(modes)
    for round_ in range(args.rounds):
        for mode in names[round_ % len(names) :] + names[: round_ % len(names)]:  # each mode in each place: drift
            guard = fresh(mode)
            for _ in range(2):
                step(guard)
            sync(device)
            for _ in range(args.steps):
                which = kind(guard, mode)
                begin = time.perf_counter()
                step(guard)
                sync(device)
                times[mode, which].append(time.perf_counter() - begin)
            guard.close()
    if rank != 0:
        torch.distributed.barrier()
        return
    base = median(times["guarded", "unsampled"])
    default = SilentConfig()
    figures: dict[str, Any] = {
        "machine": machine(),
        "model": f"GPT-2 {size}, {args.micro} x {args.batch} x {seq} tokens per step, bf16 autocast",
        "world_size": torch.distributed.get_world_size() if args.ddp else 1,
        "guarded_step_ms": base * 1e3,
        "modes": {},
    }
    print(f"machine: {figures['machine']}\nmodel: {figures['model']}, world size {figures['world_size']}")
    print(f"guarded step: {base * 1e3:.2f} ms")
    for mode in list(modes)[1:]:
        plain, sampled = median(times[mode, "unsampled"]), median(times[mode, "sampled"])
        period = default.replica_every if mode == "replicas" else default.recompute_every
        before = times[mode, "before"]
        cost = max(sampled - plain, 0.0) + (max(median(before) - plain, 0.0) if before else 0.0)
        amortised = cost / period / base + max(plain - base, 0.0) / base
        figures["modes"][mode] = {
            "unsampled_ms": plain * 1e3,
            "sampled_ms": sampled * 1e3,
            "sampled_cost_ms": cost * 1e3,
            "sampled_cost_x_step": cost / base,
            "default_period": period,
            "amortised_percent": 100 * amortised,
            "unsampled_minus_guarded_percent": 100 * (plain - base) / base,
            "mismatches": mismatches[mode],
        }
        print(
            f"{mode:<10} unsampled {plain * 1e3:7.2f} ms, sampled {sampled * 1e3:7.2f} ms (+{cost * 1e3:.2f} ms = "
            f"{cost / base:.2f} x a step); amortised at every={period}: {100 * amortised:.3f} %; unsampled - "
            f"guarded {100 * (plain - base) / base:+.2f} %; mismatches (false alarms) {mismatches[mode]}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
    if args.ddp:
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
