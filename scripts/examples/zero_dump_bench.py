"""Measures the two ways a ZeRO job can write its state on a fault: gather on write vs per-rank shards.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 scripts/examples/zero_dump_bench.py --zero-stage 3 --layers 6 --width 512
    torchrun --nproc_per_node=8 scripts/examples/zero_dump_bench.py --zero-stage 3 --layers 24 --width 2048   # GPUs

"gather": what DeepSpeedGuard did before per-rank shards became its default: every rank gathers the full weights, fp32 masters and Adam moments
(collectives, one parameter at a time, straight to host) and writes them, so each rank's dump replays
alone. "shards": each rank writes only the flat fp32 partitions and optimizer state it owns (no
collective; zero_to_fp32-style consolidation later needs every rank's file). Prints one JSON line per
rank: seconds to gather, seconds to write, bytes written.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from forensics.capture import GuardConfig
from forensics.capture.state import snapshot
from forensics.format.tensors import write_safetensors


def _write(path: str, tensors: dict[str, torch.Tensor]) -> tuple[float, int]:
    start = time.perf_counter()
    with open(path, "wb", buffering=16 * 1024 * 1024) as handle:
        write_safetensors(handle, tensors)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - start, os.path.getsize(path)


def _flat_state(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}/{k}": v.detach().to("cpu") for k, v in tensors.items()}


def local_shards(engine) -> dict[str, torch.Tensor]:
    """The fp32 partitions and optimizer state this rank owns (what DeepSpeed's own checkpoint holds)."""
    optimizer = engine.optimizer
    basic = optimizer.optimizer
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_partitioned_groups_flat
    out = {}
    for index, flat in enumerate(flats):
        out[f"fp32/{index}"] = flat.detach().to("cpu")
        out.update(
            _flat_state(
                f"state/{index}",
                {k: v for k, v in basic.state[flat].items() if isinstance(v, torch.Tensor) and v.dim() > 0},
            )
        )
    if engine.zero_optimization_stage() == 3:
        for name, param in engine.module.named_parameters():
            out[f"lp/{name}"] = param.ds_tensor.detach().to("cpu")
    return out


def main() -> None:
    import argparse

    import deepspeed
    import transformers

    from forensics.capture.integrations import DeepSpeedGuard

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10_000,
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=8192, n_positions=64
        )
    )
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = torch.randint(0, 8192, (1, 32), device=engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # optimizer state exists from here on
    guard = DeepSpeedGuard(engine, config=GuardConfig(run_id="bench"))
    root = args.dir or tempfile.mkdtemp(prefix="zero-dump-bench-")
    os.makedirs(root, exist_ok=True)

    torch.distributed.barrier()
    start = time.perf_counter()
    state = guard.state.collect(snapshot.HostCopy(enabled=False))
    gather_s = time.perf_counter() - start
    full = dict(state["model"])
    for name, entries in state["optimizer"]["state"].items():
        full.update({f"state/{name}/{k}": v for k, v in entries.items() if isinstance(v, torch.Tensor)})
    write_full_s, full_bytes = _write(os.path.join(root, f"full-rank{rank}.safetensors"), full)

    torch.distributed.barrier()
    start = time.perf_counter()
    shards = local_shards(engine)
    copy_s = time.perf_counter() - start
    write_shard_s, shard_bytes = _write(os.path.join(root, f"shard-rank{rank}.safetensors"), shards)
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    print(
        json.dumps(
            {
                "rank": rank,
                "zero_stage": args.zero_stage,
                "params": params,
                "gather": {"collect_s": round(gather_s, 3), "write_s": round(write_full_s, 3), "bytes": full_bytes},
                "shards": {"collect_s": round(copy_s, 3), "write_s": round(write_shard_s, 3), "bytes": shard_bytes},
            }
        ),
        flush=True,
    )
    guard.close()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    main()
