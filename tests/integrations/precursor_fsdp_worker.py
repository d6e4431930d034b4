"""Test worker: the precursor monitor under FSDP2 (DTensor parameters; gloo on CPUs, NCCL on GPUs), every step
sampled.

A tiny GPT-2 whose blocks and root are `fully_shard`ed over the ranks, AdamW. Usage (under torchrun):
    precursor_fsdp_worker.py measure   3 healthy steps; each rank reports (one `forensics-example` JSON line) whether
                                       its monitor stayed on, the rows it read and, for step 1, each block's
                                       gradient-norm column next to the norm of its local gradient shards
    precursor_fsdp_worker.py grow DIR  16 steps; from step 8 on, rank 1's token embeddings are scaled up 3x more each
                                       step (only its own view of the blocks grows): its precursor fires and every
                                       rank must dump one step together into DIR; each reports the dumps it wrote
    precursor_fsdp_worker.py grow-without-rank-0 DIR   the same, with no precursor monitor on rank 0
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "examples"))
import _common

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, PrecursorConfig, SpikeConfig
from forensics.capture.precursors.statistics import find_blocks
from forensics.core.kinds import PrecursorStatistic


def sharded_gpt2(world: int, device: torch.device) -> torch.nn.Module:
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    model = _common.tiny_model("gpt2", device=device)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(
    guard: Guard,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    sample_ids: list,
    before_check=lambda: None,
) -> None:
    """One guarded step of one micro-batch; `before_check` runs between backward and check()."""
    guard.record_batch({"input_ids": ids}, sample_ids=sample_ids)
    loss = model(input_ids=ids, labels=ids).loss
    guard.record_loss(loss)
    loss.backward()
    before_check()
    if guard.check():
        optimizer.step()
    optimizer.zero_grad()


def measure(rank: int, world: int, device: torch.device) -> dict:
    model = sharded_gpt2(world, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(precursors=PrecursorConfig(every=1)))
    blocks = find_blocks(model)
    generator = torch.Generator().manual_seed(rank)
    direct = {}

    def shard_norms() -> None:
        for name, block in blocks:
            shards = [p.grad.to_local() for p in block.parameters() if p.dim() >= 2]
            direct[name] = math.sqrt(sum(float(g.pow(2).sum()) for g in shards))

    for step in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator).to(device)
        train_step(guard, model, optimizer, ids, [2 * rank, 2 * rank + 1], shard_norms if step == 1 else lambda: None)
    monitor = guard.precursors
    guard.close()
    rows = dict(guard.window._precursor_rows)
    measured = {
        layer: value
        for (layer, stat), value in zip(monitor.columns, rows.get(1, []))
        if stat is PrecursorStatistic.GRAD_NORM
    }
    ratios = [
        value
        for (layer, stat), value in zip(monitor.columns, rows.get(1, []))
        if stat is PrecursorStatistic.UPDATE_RATIO
    ]
    return {
        "sampling": monitor.every == 1,
        "rows": sorted(rows),
        "grad_norm": measured,
        "direct": direct,
        "update_ratios": ratios,
    }


def grow(rank: int, world: int, device: torch.device, dump_dir: str, monitor: bool) -> dict:
    model = sharded_gpt2(world, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    off = SpikeConfig(enabled=False)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=dump_dir,
            run_id="grow",
            detection=DetectionConfig(loss_spike=off, grad_norm_spike=off),
            dumping=DumpConfig(state_layout="sharded"),
            precursors=PrecursorConfig(every=1, warmup=4, attention=False, optimizer=False) if monitor else None,
        ),
    )
    scale = [1.0]
    model.transformer.wte.register_forward_hook(lambda module, args, out: out * scale[0])
    generator = torch.Generator().manual_seed(rank)
    for step in range(16):
        scale[0] = 3.0 ** (step - 7) if rank == 1 and step >= 8 else 1.0
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator).to(device)
        train_step(guard, model, optimizer, ids, [f"{rank}-{step}-0", f"{rank}-{step}-1"])
    guard.close()
    return {
        "dumps": [str(p) for p in guard.dumps],
        "errors": guard.dump_errors,
        "fired": [f.step for f in guard.precursors.firings] if guard.precursors is not None else [],
    }


def main() -> None:
    rank, world, device = _common.init_distributed()  # NCCL on GPUs, else gloo
    mode = sys.argv[1]
    report = (
        measure(rank, world, device)
        if mode == "measure"
        else grow(rank, world, device, sys.argv[2], monitor=rank != 0 or mode != "grow-without-rank-0")
    )
    print("forensics-example " + json.dumps({"rank": rank, **report}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
