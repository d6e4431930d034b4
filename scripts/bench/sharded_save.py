"""Sharded capture vs gather-per-rank vs torch.distributed.checkpoint, on one FSDP2 state (issue 8's comparison).

    torchrun --nproc_per_node=2 -m scripts.bench.sharded_save --dir /tmp/bench --hidden 512 --layers 8

Every rank builds a Llama-shaped model (transformers, random init, fp32), shards it with `fully_shard`, takes
one AdamW step (so the moments exist), then, with a barrier between each:
- `forensics sharded`: the Guard's real path (a NaN loss seen by `check()`), DumpConfig(state_layout="sharded");
- `forensics sharded x2`: the same with shard_replicas=2 (each rank's shards also sent to a buddy rank and
  written there), and the buddy exchange alone (`exchange`: its wall time and the bytes each rank sent);
- `forensics full`: the same with state_layout="full" (every rank gathers and writes the whole state: the
  first version's behaviour);
- `dcp FileSystemWriter`: `dcp.save(get_state_dict(model, optimizer))`, the default storage;
- `dcp HuggingFaceStorageWriter`: the safetensors storage (model state only: it takes no optimizer state).
Each reports per-rank wall time of the save (the training loop's stall) and bytes written, and, for dcp,
whether anything it wrote is a pickle (the dump format forbids pickle). Rank 0 prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _pickled(path: Path) -> list[str]:
    """Files that start like a pickle stream (protocol 2+ opcode PROTO)."""
    found = []
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                if handle.read(1) == b"\x80":
                    found.append(file.name)
    return found


def build(hidden: int, layers: int):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=32000,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer, ids


def forensics_save(model, optimizer, ids, root: Path, layout: str, replicas: int = 1) -> tuple[float, int]:
    from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig

    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(root),
            run_id=f"{layout}-{replicas}",
            detection=DetectionConfig(on_nonfinite="continue"),
            dumping=DumpConfig(state_layout=layout, background_write=False, shard_replicas=replicas),
        ),
    )
    guard.record_batch({"input_ids": ids, "labels": ids})
    guard.record_loss(float("nan"))
    start = time.perf_counter()
    guard.check(grad_norm=1.0)
    seconds = time.perf_counter() - start
    guard.close()
    [path] = guard.dumps
    return seconds, _bytes(path)


def exchange_only(model, optimizer) -> dict:
    """The buddy exchange of shard_replicas=2 alone, on the state the Guard collects."""
    from forensics.capture import DumpConfig, Guard, GuardConfig
    from forensics.capture.state import buddy, snapshot

    guard = Guard(model, optimizer, config=GuardConfig(dumping=DumpConfig(state_layout="sharded", shard_replicas=2)))
    state = guard.state.collect(snapshot.HostCopy(enabled=False))
    shards = buddy.sole_shards(state)
    sent = sum(s.tensor.numel() * s.tensor.element_size() for rows in shards.values() for s in rows.values())
    dist.barrier()
    start = time.perf_counter()
    copies = buddy.exchange(shards, dist.get_rank(), dist.get_world_size(), 2)
    seconds = time.perf_counter() - start
    guard.close()
    received = sum(
        s.tensor.numel() * s.tensor.element_size() for c in copies for rows in c.files.values() for s in rows.values()
    )
    return {"seconds": seconds, "bytes": sent, "received": received}


def dcp_save(model, optimizer, root: Path, storage: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    if storage == "filesystem":
        state, writer = {"model": model_state, "optimizer": optimizer_state}, dcp.FileSystemWriter(str(root))
    else:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        state, writer = model_state, HuggingFaceStorageWriter(str(root), save_distributed=True)
    start = time.perf_counter()
    try:
        dcp.save(state, storage_writer=writer)
    except Exception as exc:  # noqa: BLE001 - a storage this torch cannot use is a result, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    model, optimizer, ids = build(args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    one_copy = 3 * 4 * params  # fp32 weights + two AdamW moments
    results: dict[str, dict] = {}
    for name, layout, replicas in (("sharded", "sharded", 1), ("sharded x2", "sharded", 2), ("full", "full", 1)):
        dist.barrier()
        seconds, written = forensics_save(model, optimizer, ids, args.dir / "forensics", layout, replicas)
        results[f"forensics {name}"] = {"seconds": seconds, "bytes": written}
    dist.barrier()
    results["exchange"] = exchange_only(model, optimizer)
    for storage in ("filesystem", "huggingface"):
        dist.barrier()
        root = args.dir / f"dcp-{storage}"
        outcome = dcp_save(model, optimizer, root, storage)
        dist.barrier()
        if rank == 0 and "error" not in outcome:
            outcome.update(total_bytes=_bytes(root), pickled_files=_pickled(root))
        results[f"dcp {storage}"] = outcome
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        summary = {"world_size": world, "parameters": params, "one_copy_bytes": one_copy, "per_rank": gathered}
        for name in ("forensics sharded", "forensics sharded x2", "forensics full"):
            summary[f"{name}: total bytes / one copy"] = round(sum(r[name]["bytes"] for r in gathered) / one_copy, 3)
            summary[f"{name}: slowest rank s"] = round(max(r[name]["seconds"] for r in gathered), 3)
        for name in ("dcp filesystem", "dcp huggingface"):
            if "error" not in gathered[0][name]:
                summary[f"{name}: total bytes / one copy"] = round(gathered[0][name]["total_bytes"] / one_copy, 3)
                summary[f"{name}: slowest rank s"] = round(max(r[name]["seconds"] for r in gathered), 3)
        exchange = gathered[0]["exchange"]
        summary["buddy exchange: slowest rank s"] = round(max(r["exchange"]["seconds"] for r in gathered), 3)
        summary["buddy exchange: GB/s per rank"] = round(
            exchange["bytes"] / 1e9 / max(r["exchange"]["seconds"] for r in gathered), 3
        )
        print(json.dumps(summary, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
