"""Test worker: a 2-D mesh (2 data-parallel x 2 tensor-parallel ranks) with FSDP2 over tensor parallelism.

An MLP whose `up` is column-parallel (FSDP then shards it with a strided placement), `down` row-parallel
(Shard(0) x Shard(1)) with a bias replicated over the tensor-parallel ranks. Step 0 is healthy; in step 1
data-parallel rank 1 (global ranks 2 and 3) reads an input holding inf. Before step 1, rank 0 saves every
parameter and AdamW moment gathered with `full_tensor()` to reference.safetensors, the state a dump
must hold. Usage (under torchrun, 4 processes): tp_worker.py DUMP_DIR
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from forensics.capture import Guard, GuardConfig
from forensics.core.errors import TrainingFaultError


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 6)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def mlp_loss(model, batch):
    return model(batch["x"]).square().mean()


def gathered_state(model, optimizer) -> dict:
    """Every parameter and AdamW moment as a whole tensor, keyed as a dump's model / optimizer files key them."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {name: p.full_tensor().contiguous() for name, p in model.named_parameters()}
    for param, entries in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"state/{names[id(param)]}/{key}"] = entries[key].full_tensor().contiguous()
    return state


def main() -> None:
    dump_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=dump_dir, run_id="tp"), loss_fn=mlp_loss)
    dp_rank = mesh["dp"].get_local_rank()
    try:
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dp_rank))
            if step == 1:
                reference = gathered_state(model, optimizer)  # a collective: every rank takes part
                if rank == 0:
                    save_file(reference, f"{dump_dir}/reference.safetensors")
                if dp_rank == 1:
                    x[2, 3] = float("inf")
            batch = {"x": x, "sample_ids": [f"dp{dp_rank}-step{step}-{i}" for i in range(4)]}
            guard.record_batch(batch)
            loss = mlp_loss(model, batch)
            guard.record_loss(loss)
            loss.backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()
        print("forensics-example " + json.dumps({"rank": rank, "dump": None}), flush=True)
    except TrainingFaultError as fault:
        print("forensics-example " + json.dumps({"rank": rank, "dump": str(fault.dump_path)}), flush=True)
    guard.close()


if __name__ == "__main__":
    main()
