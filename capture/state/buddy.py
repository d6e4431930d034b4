"""Buddy copies of the shards only one rank holds (GuardConfig.dumping.shard_replicas >= 2), exchanged before writing.

A plain FSDP2 / tensor-parallel shard or a ZeRO partition lives on one rank: if that rank (or its node) dies
while writing its dump, the state cannot be rebuilt. With `shard_replicas = k`, before any rank starts
writing, each rank sends those shards to k - 1 buddy ranks, which write them beside their own
(`copy-<rank>-model.safetensors`, manifest `layout.copies`, docs/DUMP_FORMAT.md); a reader uses a copy where
the owner's dump is missing.

- The buddies sit along a ring: rank r sends to r + d and receives from r - d, with d = the ranks per node
  when there are several nodes (torchrun's LOCAL_WORLD_SIZE), so a copy lands on another node's disk.
- The exchange is point to point only (each rank talks to 2 (k - 1) peers, whatever the world size), in
  rounds of at most ROUND_BYTES per direction: the extra device memory is one round; the host holds the
  copies received (1 / world of the state per copy) until they are written.
- Only a dump every rank makes (a trigger agreed at check()) exchanges; a step that raised on one rank is
  written without copies (its peers would never answer). A failed or timed-out exchange costs the copies,
  never the dump.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os

import torch

from forensics.format import spec
from forensics.format.shards import LocalShard, ShardCopies, dtype_name

log = logging.getLogger(__name__)

ROUND_BYTES = 256 * 1024 * 1024
"""Bytes sent (and received) per round of the exchange, at most (a larger tensor goes alone)."""
ROUND_TIMEOUT = datetime.timedelta(seconds=120)
"""How long a rank waits for its buddy in one round before writing its dump without the copies."""


def buddy_offsets(world_size: int, local_world_size: int, count: int) -> list[int]:
    """The ring distances of a rank's `count` buddies: whole nodes first (so copies leave the node), then
    neighbours; never the rank itself, never twice the same."""
    node = local_world_size if 0 < local_world_size < world_size and world_size % local_world_size == 0 else 1
    offsets: list[int] = []
    for distance in [node * j for j in range(1, world_size)] + list(range(1, world_size)):
        distance %= world_size
        if distance and distance not in offsets and len(offsets) < count:
            offsets.append(distance)
    return offsets


def ranks_per_node(world_size: int) -> int:
    """Ranks per node as the launcher says (torchrun's LOCAL_WORLD_SIZE); the whole world when it does not."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) or world_size
    except ValueError:
        return world_size


def sole_shards(state: dict) -> dict[str, dict[str, LocalShard]]:
    """The shards of a sharded state (`{"model", "optimizer"}` as StateSource.collect returns them) that no other
    rank writes, by file and stored name."""
    found: dict[str, dict[str, LocalShard]] = {spec.MODEL: {}, spec.OPTIMIZER_TENSORS: {}}
    for name, value in state["model"].items():
        if isinstance(value, LocalShard) and value.holders == 1:
            found[spec.MODEL][name] = value
    for param, entries in ((state.get("optimizer") or {}).get("state") or {}).items():
        for key, value in entries.items():
            if isinstance(value, LocalShard) and value.holders == 1:
                found[spec.OPTIMIZER_TENSORS][f"state/{param}/{key}"] = value  # as the writer names them
    return {file: shards for file, shards in found.items() if shards}


def exchange(shards: dict[str, dict[str, LocalShard]], rank: int, world_size: int, replicas: int) -> list[ShardCopies]:
    """Sends this rank's `shards` to its buddies and returns the copies received from the ranks it is buddy of
    (one ShardCopies per source rank). Every rank of the job must call it for the same dump. Never raises: a
    failure is logged and leaves the copies received so far."""
    received: list[ShardCopies] = []
    for distance in buddy_offsets(world_size, ranks_per_node(world_size), replicas - 1):
        to, source = (rank + distance) % world_size, (rank - distance) % world_size
        try:
            received.append(_exchange_with(shards, to, source))
        except Exception as exc:  # noqa: BLE001 - the copies are a safeguard: the dump goes on without them
            log.error(
                "forensics: the buddy copy exchange (send to rank %d, receive from rank %d) failed: %s: %s; "
                "this rank's dump is written without rank %d's shards",
                to,
                source,
                type(exc).__name__,
                str(exc)[:300],
                source,
            )
            break
    return received


def _exchange_with(shards: dict[str, dict[str, LocalShard]], to: int, source: int) -> ShardCopies:
    device = _comm_device()
    outgoing = [(file, name, shard) for file, rows in shards.items() for name, shard in rows.items()]
    header = json.dumps(
        [
            [
                file,
                name,
                list(s.global_shape),
                list(s.offsets),
                list(s.tensor.shape),
                dtype_name(s.tensor.dtype),
                s.flat,
            ]
            for file, name, s in outgoing
        ]
    ).encode()
    length = torch.tensor([len(header)], dtype=torch.int64, device=device)
    their_length = torch.zeros(1, dtype=torch.int64, device=device)
    _swap([length], [their_length], to, source)
    their_header = torch.empty(int(their_length.item()), dtype=torch.uint8, device=device)
    _swap([torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)], [their_header], to, source)
    incoming = json.loads(their_header.cpu().numpy().tobytes().decode())

    sends = _rounds([s.tensor.numel() * s.tensor.element_size() for _, _, s in outgoing])
    receives = _rounds([math.prod(shape) * spec.ITEM_SIZE[dtype] for _, _, _, _, shape, dtype, _ in incoming])
    copies = ShardCopies(source, {})
    for index in range(max(len(sends), len(receives))):
        out = [_byte_view(outgoing[i][2].tensor, device) for i in (sends[index] if index < len(sends) else [])]
        mine = receives[index] if index < len(receives) else []
        into = [
            torch.empty(math.prod(incoming[i][4]) * spec.ITEM_SIZE[incoming[i][5]], dtype=torch.uint8, device=device)
            for i in mine
        ]
        _swap(out, into, to, source)
        for i, data in zip(mine, into):
            file, name, global_shape, offsets, shape, dtype, flat = incoming[i]
            tensor = data.cpu().view(getattr(torch, dtype)).reshape(shape)
            copies.files.setdefault(file, {})[name] = LocalShard(tensor, tuple(global_shape), tuple(offsets), flat)
    return copies


def _swap(out: list[torch.Tensor], into: list[torch.Tensor], to: int, source: int) -> None:
    """Sends `out` to rank `to` and receives `into` from rank `source`, all at once; waits (bounded)."""
    dist = torch.distributed
    ops = [dist.P2POp(dist.isend, t, to) for t in out] + [dist.P2POp(dist.irecv, t, source) for t in into]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        if not work.wait(ROUND_TIMEOUT):
            raise TimeoutError(f"rank {to} or {source} did not answer within {ROUND_TIMEOUT.seconds} s")


def _rounds(sizes: list[int]) -> list[list[int]]:
    """Indices of `sizes` grouped in order into rounds of at most ROUND_BYTES (a larger item alone); both ends
    compute the same grouping from the header."""
    rounds: list[list[int]] = []
    total = ROUND_BYTES
    for index, size in enumerate(sizes):
        if not rounds or total + size > ROUND_BYTES:
            rounds.append([])
            total = 0
        rounds[-1].append(index)
        total += size
    return rounds


def _comm_device() -> torch.device:
    """Where the process group moves tensors: the current GPU under NCCL, else the host."""
    if "nccl" in str(torch.distributed.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _byte_view(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
