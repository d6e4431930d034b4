"""Test worker (torchrun, gloo): a finite loss spike on rank 1 only, under DistributedGuard or plain Guard, or plain
Guard with a fused SGD (`fused`: the sync-free check across ranks, which holds the dumped spike back on every rank).

Each rank trains a tiny linear regression on its own data; in step 8 rank 1's inputs are 100x larger,
so only rank 1's local loss jumps. Usage: spike_worker.py DUMP_DIR {distributed|plain|fused}
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SpikeConfig
from forensics.capture.integrations import DistributedGuard
from forensics.core.thirdparty import TorchDispatchMode

SPIKE_STEP = 8
COUNTED_STEP = 6  # healthy, after the detector's warm-up: the operators its check() dispatches are reported


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    dump_dir, kind = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, fused=kind == "fused")
    config = GuardConfig(
        dump_dir=dump_dir,
        run_id=kind,
        detection=DetectionConfig(
            loss_spike=SpikeConfig(window=8, warmup=4), grad_norm_spike=SpikeConfig(enabled=False)
        ),
        dumping=DumpConfig(background_write=False),
    )
    guard = (DistributedGuard if kind == "distributed" else Guard)(ddp, optimizer, config=config)
    data = torch.Generator().manual_seed(rank)
    check_ops = None
    for step in range(SPIKE_STEP + 2):
        x = torch.randn(8, 4, generator=data)
        if rank == 1 and step == SPIKE_STEP:
            x = x * 100
        batch = {"x": x, "y": torch.zeros(8, 1), "sample_ids": [f"r{rank}s{step}i{i}" for i in range(8)]}
        guard.record_batch(batch)
        loss = ((ddp(batch["x"]) - batch["y"]) ** 2).mean()
        guard.record_loss(loss)
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        counter = CountOps()
        with counter if step == COUNTED_STEP else contextlib.nullcontext():
            go_on = guard.check()
        check_ops = counter.count if step == COUNTED_STEP else check_ops
        if go_on:
            optimizer.step()
        if step == SPIKE_STEP:
            held = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        optimizer.zero_grad()
    guard.close()
    sys.stdout.write(
        "forensics-example "
        + json.dumps({"rank": rank, "dumps": [str(p) for p in guard.dumps], "held": held, "check_ops": check_ops})
        + "\n"
    )
    sys.stdout.flush()
    torch.distributed.barrier()
    os._exit(0)  # no gloo teardown: under load it can abort a rank whose peer closed first


if __name__ == "__main__":
    main()
