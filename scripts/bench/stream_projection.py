"""Project a streamed replay's time to a larger model from one measured row of scripts/bench/replay_stream.py.

    python -m scripts.bench.stream_projection --json OUT/3b.json --budget quarter --host-memory 1TB --disk-gbps 3

Reads the rows replay_stream.py wrote (`--json`): the unconstrained one ("none") and a streamed one (`--row`, the
first with a `stream` block by default), and prints the measured per-block costs, then the replay of a Llama-70B
shape (80 layers, 8192 wide, 28672 intermediate, 8 KV heads of 64; `--layers/--hidden/--intermediate/--vocab`
for another) under `--budget` with `--host-memory` of host RAM, against the floor: each byte of the fp32 weights
read once from the disk at `--disk-gbps` and copied once host->device at `--pcie-gbps`.

The model, and what it assumes (each printed with the numbers):
- Compute (everything but the load, in the unconstrained row) scales with the parameter count: the same samples,
  tokens and passes, FLOPs proportional to parameters (attention's sequence term left out: 128 tokens here).
- The stages walk the blocks as often as in the measured row (walks depend on the micro-batches, samples and
  stages, not on the model's size); a walk materialises the blocks that did not stay: blocks - K, where K is the
  plan's (replay/load/stream_plan.fit_blocks) for the budget, and each read after the load moves a block's fp32
  bytes host->device (the host cache holds the dump's values).
- What the streamed row took beyond the unconstrained one (copies, recomputation of each block for its backward,
  the waits the read-ahead did not hide) is proportional to the bytes it moved host->device after the load: its
  seconds per byte, measured, carry over (a block's recomputation is proportional to its parameters, so to its
  bytes). The same card and bus are assumed.
- The host cache holds half the host's memory (the default on a GPU): blocks beyond it are read from the disk at
  each walk, at `--disk-gbps`, not overlapped with anything (a pessimistic term).
- The load reads the fp32 weights once from the disk at `--disk-gbps` in both replays; the unconstrained 70B replay
  cannot run on one GPU (its weights and gradients alone are 560 GB): it is the hypothetical baseline, computed.
"""

from __future__ import annotations

import argparse
import json
import math

from forensics.core.sizes import parse_bytes, words
from forensics.replay.load.stream_plan import ACTIVATION_SHARE, STATE_FACTOR
from scripts.bench.replay_stream import stage_times

LOAD_STAGE = "loading model and step"


def llama_params(layers: int, hidden: int, intermediate: int, vocab: int, kv_share: float) -> tuple[int, int]:
    """(parameters of one decoder layer, parameters outside the layers): attention q/o full, k/v `kv_share` of it
    (grouped-query attention), the SwiGLU MLP's three matrices, two norms; embeddings and head untied, final norm."""
    attention = 2 * hidden * hidden + 2 * int(hidden * hidden * kv_share)
    return attention + 3 * hidden * intermediate + 2 * hidden, 2 * vocab * hidden + hidden


def plan_k(budget: int, resident_bytes: int, block_bytes: int, blocks: int) -> int:
    """K as the plan picks it (replay/load/stream_plan.fit_blocks): the room beside the resident part, its
    gradients and the activations' share, less one block's worth for the gradients of the block in backward."""
    room = budget * (1 - ACTIVATION_SHARE) - STATE_FACTOR * resident_bytes
    return max(0, min(blocks, int(room // max(block_bytes, 1)) - 1)) if room > 0 else 0


def measured(rows: list[dict], which: str | None) -> dict:
    """The per-block costs of the measured streamed row against the unconstrained one."""
    base = next((r for r in rows if r.get("budget") == "none" and "error" not in r), None)
    streamed = next(
        (r for r in rows if r.get("stream") and "error" not in r and (which is None or r["budget"] == which)), None
    )
    if base is None or streamed is None:
        raise SystemExit("the JSON needs an unconstrained row ('none') and a streamed row (a budget)")
    s = streamed["stream"]
    load_base = stage_times(base).get(LOAD_STAGE, 0.0)
    load_streamed = stage_times(streamed).get(LOAD_STAGE, 0.0)
    compute = base["replay_s"] - load_base
    moved = s["bytes_host_to_device"] - s["bytes_floor"]  # after the load (which moved each block once)
    if moved <= 0:  # a CPU row: nothing crosses a bus; the bytes the reads copied stand in
        moved = s["block_bytes"] * max(1, s["block_reads"] - s["blocks"])
    extra = max(0.0, streamed["replay_s"] - load_streamed - compute)
    params = (s["blocks"] * s["block_bytes"] + s["resident_bytes"]) / 4  # an fp32 dump
    return {
        "base": base,
        "streamed": streamed,
        "stream": s,
        "compute_s": compute,
        "load_s": load_base,
        "extra_s": extra,
        "seconds_per_byte": extra / moved,
        "params": params,
        "walks": s.get("walks"),
        "reads_after_load": s["block_reads"] - s["blocks"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="rows written by scripts/bench/replay_stream.py --json")
    parser.add_argument("--row", default=None, help="the streamed row's budget (default: the first streamed row)")
    parser.add_argument("--budget", default="quarter", help="the projected replay's budget: a size or 'quarter'")
    parser.add_argument("--host-memory", default="1TB", help="host RAM of the projected machine")
    parser.add_argument("--disk-gbps", type=float, default=3.0, help="storage read, GB/s (NVMe: a few)")
    parser.add_argument("--pcie-gbps", type=float, default=50.0, help="host->device, GB/s (PCIe 5 x16 ~50)")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--intermediate", type=int, default=28672)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--kv-share", type=float, default=1 / 8, help="KV heads / query heads (70B: 8 of 64)")
    args = parser.parse_args()
    with open(args.json) as handle:
        m = measured(json.load(handle), args.row)
    s = m["stream"]
    walks = m["walks"]
    if walks is None:  # a row written before the walks were counted: reads after the load / blocks not staying
        walks = math.ceil(m["reads_after_load"] / max(1, s["blocks"] - s["blocks_resident"]))
    print(
        f"measured: {m['streamed']['budget']} vs none ({s['blocks']} blocks of {words(s['block_bytes'])}, K = "
        f"{s['blocks_resident']}, {m['params'] / 1e9:.2f} B parameters)"
    )
    print(
        f"  unconstrained {m['base']['replay_s']:.2f} s (load {m['load_s']:.2f} s, the rest {m['compute_s']:.2f} s);"
        f" streamed {m['streamed']['replay_s']:.2f} s = {m['streamed']['replay_s'] / m['base']['replay_s']:.2f} x"
    )
    print(
        f"  walks {walks}; block reads after the load {m['reads_after_load']} (the model: walks x (blocks - K) = "
        f"{walks * (s['blocks'] - s['blocks_resident'])})"
    )
    disk, pcie = args.disk_gbps * 1e9, args.pcie_gbps * 1e9
    per_byte = m["seconds_per_byte"]
    if per_byte < 1 / pcie:  # faster than the bus: no extra cost measurable (a CPU row, or noise)
        print(
            "  the streamed row took no measurable time beyond the unconstrained one: moves costed at the bus's "
            f"{args.pcie_gbps} GB/s instead"
        )
        per_byte = 1 / pcie
    per_block = per_byte * s["block_bytes"]
    print(
        f"  per block: compute {m['compute_s'] / s['blocks'] * 1e3:.1f} ms per replay; each read after the load "
        f"{per_block * 1e3:.1f} ms (copy, recomputation, waits: {1 / per_byte / 1e9:.1f} GB/s "
        "effective); the load's read "
        + (f"{s['read_seconds'] / s['blocks'] * 1e3:.1f} ms" if s.get("read_seconds") else "not measured")
    )

    layer, outside = llama_params(args.layers, args.hidden, args.intermediate, args.vocab, args.kv_share)
    params = args.layers * layer + outside
    block_bytes, resident, weights = 4 * layer, 4 * outside, 4 * params
    budget = weights // 4 if args.budget == "quarter" else parse_bytes(args.budget)
    k = plan_k(budget, resident, block_bytes, args.layers)
    print(
        f"\nprojected: {params / 1e9:.1f} B parameters ({args.layers} blocks of {words(block_bytes)}, outside "
        f"{words(resident)}), fp32 weights {words(weights)}; budget {words(budget)}: K = {k}"
    )
    if k < 1:
        least = STATE_FACTOR * (resident + block_bytes) / (1 - ACTIVATION_SHARE)
        print(f"  refused: the plan needs at least {words(int(least))}")
        return 1

    compute = m["compute_s"] * params / m["params"]
    load = weights / disk
    reads = walks * (args.layers - k)
    moved = reads * block_bytes
    cache = min(parse_bytes(args.host_memory) // 2, args.layers * block_bytes)
    from_disk = moved * (1 - cache / (args.layers * block_bytes))
    streamed = load + compute + moved * per_byte + from_disk / disk
    unconstrained = load + compute
    floor = weights / disk + weights / pcie
    print(
        f"  unconstrained (hypothetical: one GPU cannot hold it): load {load:.0f} s + compute {compute:.0f} s = "
        f"{unconstrained:.0f} s"
    )
    print(
        f"  streamed: {reads} block reads after the load, {words(moved)} host->device "
        f"({moved * per_byte:.0f} s at the measured cost); host cache {words(cache)}: "
        f"{words(int(from_disk))} read again from the disk ({from_disk / disk:.0f} s)"
    )
    print(
        f"  streamed total {streamed:.0f} s = {streamed / unconstrained:.2f} x the unconstrained "
        f"({streamed / 60:.1f} min)"
    )
    print(
        f"  floor (each fp32 byte once from the disk at {args.disk_gbps} GB/s and once host->device at "
        f"{args.pcie_gbps} GB/s): {floor:.0f} s; the projection's moves are {moved / weights:.1f} x the weights"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
