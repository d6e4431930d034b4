"""Test worker: the precursor monitor under FSDP2 (DTensor parameters, gloo), every step sampled.

A tiny GPT-2 whose blocks and root are `fully_shard`ed over the ranks, AdamW, 3 healthy steps. Each rank reports
(one `forensics-example` JSON line) whether its monitor stayed on, how many rows it read, and, for the row of
step 1, each block's gradient-norm column next to the norm of the block's local gradient shards computed
directly before the optimizer step. Usage (under torchrun): precursor_fsdp_worker.py
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
import _common  # noqa: E402

from capture import Guard, GuardConfig, PrecursorConfig  # noqa: E402
from capture.precursor_stats import find_blocks  # noqa: E402
from forensics.kinds import PrecursorStatistic  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = _common.tiny_model("gpt2")
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(precursors=PrecursorConfig(every=1)))
    blocks = find_blocks(model)
    generator = torch.Generator().manual_seed(rank)
    direct = {}
    for step in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
        guard.record_batch({"input_ids": ids}, sample_ids=[2 * rank, 2 * rank + 1])
        loss = model(input_ids=ids, labels=ids).loss
        guard.record_loss(loss)
        loss.backward()
        if step == 1:
            for name, block in blocks:
                shards = [p.grad.to_local() for p in block.parameters() if p.dim() >= 2]
                direct[name] = math.sqrt(sum(float(g.pow(2).sum()) for g in shards))
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    monitor = guard.precursors
    guard.close()
    rows = dict(guard.window._precursor_rows)
    measured = {layer: value for (layer, stat), value in zip(monitor.columns, rows.get(1, []))
                if stat is PrecursorStatistic.GRAD_NORM}
    ratios = [value for (layer, stat), value in zip(monitor.columns, rows.get(1, []))
              if stat is PrecursorStatistic.UPDATE_RATIO]
    print("forensics-example " + json.dumps({"rank": rank, "sampling": monitor.every == 1, "rows": sorted(rows),
                                             "grad_norm": measured, "direct": direct, "update_ratios": ratios}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
