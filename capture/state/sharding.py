"""What each rank writes in the sharded layout (dump format version 2), decided without any communication.

- A DTensor (FSDP2's `fully_shard`, tensor parallelism, HSDP) is written as this rank's local shard, by the
  ranks at coordinate 0 of every mesh dimension the tensor is replicated along (so HSDP's replicas do not
  write it twice); its box in the global tensor comes from the mesh and placements.
- A plain tensor is the same on every rank (DDP weights, buffers, Adam's `step`): the ranks split the writing.
  Each such tensor goes to the least-loaded rank(s) by bytes, largest first; every rank computes the same
  assignment from names and sizes alone, so a dump is written with the bandwidth of every node.
- A DTensor whose placement is not a plain shard / replicate (e.g. FSDP + TP's strided shard) is gathered
  first (`full_tensor()`, a collective on every rank) and then written as a plain tensor.

Also here: the DTensor-aware grad norm (this rank's owned shards; the agreement all-reduce sums them) and the
choice between the full and the sharded layout.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch

from forensics.capture.state.buddy import buddy_offsets, ranks_per_node
from forensics.format import spec
from forensics.format.shards import LocalShard, table_entry
from forensics.format.tensors import tensor_bytes
from forensics.core.grad_norm import total_grad_norm
from forensics.core.kinds import StateLayout
from forensics.core.thirdparty import dtensor_local_box, fsdp_mixed_precision

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def layout_words(layout: StateLayout | None) -> str:
    """How a dump's state was written, in words (the manifest's `distributed.state` field)."""
    if layout is StateLayout.SHARDED:
        return "sharded: each rank wrote its part (replay reads the step's rank dumps together)"
    return "full on every rank (replayable alone)"


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local") and hasattr(value, "placements")


def has_dtensors(model: torch.nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def reshard(model: torch.nn.Module) -> None:
    """Frees FSDP2's gathered parameters and puts the sharded ones back on every `fully_shard` module (a local
    operation). After backward they are sharded already; in a forward that raised, some are not."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_units(model: torch.nn.Module) -> list[dict]:
    """Each FSDP2 unit (a module `fully_shard` wrapped) with its mixed-precision policy, in module order: the
    manifest's `precision.fsdp`, from which replay computes in the dtypes the job did. [] without FSDP2, and
    [] with a warning when FSDP2's internals differ (replay then computes in the parameters' dtype)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []

    def dtype(value: Any) -> str | None:
        return str(value).removeprefix("torch.") if value is not None else None

    units = []
    try:
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            policy = fsdp_mixed_precision(module)
            if policy is None:
                continue
            units.append(
                {
                    "module": name,
                    "param_dtype": dtype(policy.param_dtype),
                    "reduce_dtype": dtype(policy.reduce_dtype),
                    "output_dtype": dtype(policy.output_dtype),
                    "cast_forward_inputs": bool(policy.cast_forward_inputs),
                }
            )
    except Exception:  # a torch whose FSDP2 internals differ
        log.warning(
            "forensics: could not read FSDP2's mixed-precision policies; replay will compute in the parameters' dtype",
            exc_info=True,
        )
        return []
    return units


def _plain_placements(tensor: Any) -> bool:
    """Only Shard(dim) / Replicate: the local tensor is one box of the global one."""
    return all(type(p).__name__ in ("Shard", "Replicate") for p in tensor.placements)


def _replica_count(tensor: Any) -> int:
    """How many ranks hold the same local data of a DTensor (the sizes of the mesh dimensions it is not
    sharded along: HSDP's replica groups)."""
    count = 1
    for dim, placement in enumerate(tensor.placements):
        if type(placement).__name__ != "Shard":
            count *= tensor.device_mesh.size(dim)
    return count


def _replica_index(tensor: Any) -> int | None:
    """This rank's index among the ranks holding the same local data (0: the first), None off the mesh."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    index = 0
    for dim, placement in enumerate(tensor.placements):
        if type(placement).__name__ != "Shard":
            index = index * tensor.device_mesh.size(dim) + coordinate[dim]
    return index


def local_shard(tensor: Any, replicas: int = 1) -> LocalShard | None:
    """This rank's box of a DTensor with plain placements, or None when another rank writes it (or it is empty)."""
    index = _replica_index(tensor)
    if index is None or index >= replicas:
        return None
    local = tensor.to_local().detach()
    if local.numel() == 0:
        return None
    shape, offsets = dtensor_local_box(tensor)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"DTensor local shard is {tuple(local.shape)}, its placements say {tuple(shape)}")
    return LocalShard(
        local.contiguous(),
        tuple(tensor.shape),
        tuple(int(o) for o in offsets),
        holders=min(_replica_count(tensor), replicas),
    )


def shard_grad_norm(grads: list[Any]) -> torch.Tensor:
    """Norm of the gradients this rank owns: its DTensor shards (first replica only) and, for plain gradients
    of a DTensor model, rank 0's; the agreement all-reduce sums the squares into the global norm. Every rank
    must call it (a strided DTensor gradient is gathered collectively)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    owned = []
    for grad in grads:
        if is_dtensor(grad):
            if _plain_placements(grad):
                if _replica_index(grad) == 0:
                    owned.append(grad.to_local())
            else:
                full = grad.full_tensor()  # a collective: every rank makes it, for the same gradients
                if rank == 0:
                    owned.append(full)
        elif rank == 0:
            owned.append(grad)
    norm = total_grad_norm(owned)
    return norm if norm is not None else torch.zeros(())


def host_norm(value: Any) -> Any:
    """A grad norm the loop passed (a DTensor from clip_grad_norm_ on DTensor gradients) as a plain tensor."""
    if is_dtensor(value):
        return (
            value.to_local() if all(type(p).__name__ == "Replicate" for p in value.placements) else value.full_tensor()
        )
    return value


def state_bytes(state: dict) -> int:
    """Bytes of the complete state (global sizes of DTensors)."""
    total = sum(tensor_bytes(t) for t in state["model"].values())
    for entries in (state.get("optimizer") or {}).get("state", {}).values():
        total += sum(tensor_bytes(v) for v in entries.values())
    return total


def choose_layout(
    config_layout: StateLayout, world_size: int, dtensors: bool, total_bytes: int, full_max_bytes: int
) -> StateLayout:
    """The layout this dump uses: identical on every rank (it depends on what every rank knows alike)."""
    if world_size <= 1:
        return StateLayout.FULL
    if config_layout is not StateLayout.AUTO:
        return config_layout
    return StateLayout.SHARDED if dtensors or total_bytes > full_max_bytes else StateLayout.FULL


def needs_collective(state: dict) -> bool:
    """True when sharding this state gathers some DTensor (strided placements): every rank must take part."""
    values = list(state["model"].values())
    for entries in (state.get("optimizer") or {}).get("state", {}).values():
        values.extend(entries.values())
    return any(is_dtensor(v) and not _plain_placements(v) for v in values)


class Assignment:
    """Which ranks write each replicated tensor: largest first, to the least-loaded rank (LPT), and with
    replicas > 1 also to that rank's buddies (capture/state/buddy.py: on other nodes first), so that a lost node
    loses no replicated tensor either. Every rank is the buddy of as many ranks as it has buddies, so
    balanced first writers keep the copies balanced too."""

    def __init__(self, sizes: dict[str, int], world_size: int, replicas: int, per_node: int | None = None):
        offsets = buddy_offsets(world_size, per_node or world_size, replicas - 1)
        heap = [(0, rank) for rank in range(world_size)]
        self.writers: dict[str, tuple[int, ...]] = {}
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            load, rank = heapq.heappop(heap)
            self.writers[name] = (rank, *((rank + distance) % world_size for distance in offsets))
            heapq.heappush(heap, (load + max(sizes[name], 1), rank))

    def writes(self, name: str, rank: int) -> bool:
        return rank in self.writers[name]


def shard_state(
    state: dict, rank: int, world_size: int, replicas: int, copy: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[dict, dict]:
    """This rank's part of a full-form state (`{"model": {name: tensor}, "optimizer": {...}}`, DTensors as
    they are), and the table of the complete state (`layout.tensors`).

    Returns:
        (`{"model": {name: tensor | LocalShard}, "optimizer": {... "state": {param: {key: ...}}}}`, table)
    """
    model_state = {name: _gathered(t) for name, t in state["model"].items()}
    optimizer = state.get("optimizer")
    entries = {}
    if optimizer is not None:
        entries = {
            f"state/{param}/{key}": _gathered(value)
            for param, values in optimizer["state"].items()
            for key, value in values.items()
            if isinstance(value, (torch.Tensor, LocalShard))
        }
    table = {
        spec.MODEL: {n: _row(t) for n, t in model_state.items()},
        spec.OPTIMIZER_TENSORS: {k: _row(t) for k, t in entries.items()},
    }
    plain = {f"{spec.MODEL}/{n}": tensor_bytes(t) for n, t in model_state.items() if _replicated(t)}
    plain.update({f"{spec.OPTIMIZER_TENSORS}/{k}": tensor_bytes(t) for k, t in entries.items() if _replicated(t)})
    assignment = Assignment(plain, world_size, replicas, ranks_per_node(world_size))

    def mine(file: str, name: str, value: Any) -> Any:
        if isinstance(value, LocalShard):  # already this rank's partition (ZeRO); empty: it holds none
            if value.tensor.numel() == 0:
                return None
            return dataclasses.replace(value, tensor=copy(value.tensor))
        if is_dtensor(value):
            shard = local_shard(value, replicas)
            return None if shard is None else dataclasses.replace(shard, tensor=copy(shard.tensor))
        return copy(value) if assignment.writes(f"{file}/{name}", rank) else None

    model = {n: v for n, t in model_state.items() if (v := mine(spec.MODEL, n, t)) is not None}
    sharded_optimizer = None
    if optimizer is not None:
        kept: dict[str, dict] = {}
        for param, values in optimizer["state"].items():
            kept[param] = {}
            for key, value in values.items():
                if isinstance(value, (torch.Tensor, LocalShard)):
                    full_key = f"state/{param}/{key}"
                    part = mine(spec.OPTIMIZER_TENSORS, full_key, entries[full_key])
                    if part is not None:
                        kept[param][key] = part
                else:
                    kept[param][key] = value
        sharded_optimizer = {**optimizer, "state": kept}
    return {"model": model, "optimizer": sharded_optimizer}, table


def full_state(state: dict, copy: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The whole state on this rank (the full layout): every DTensor gathered (a collective on every rank)."""

    def whole(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return copy(value.full_tensor().detach() if is_dtensor(value) else value)

    optimizer = state.get("optimizer")
    if optimizer is not None:
        optimizer = {
            **optimizer,
            "state": {
                param: {key: whole(v) for key, v in values.items()} for param, values in optimizer["state"].items()
            },
        }
    return {"model": {name: whole(t) for name, t in state["model"].items()}, "optimizer": optimizer}


def _row(value: Any) -> dict:
    """The `layout.tensors` row of a state value: its global shape and dtype."""
    if isinstance(value, LocalShard):
        return table_entry(value.global_shape, value.tensor.dtype)
    return table_entry(value.shape, value.dtype)


def _replicated(value: Any) -> bool:
    """A plain tensor, the same on every rank (written by the ranks the Assignment picks)."""
    return not isinstance(value, LocalShard) and not is_dtensor(value)


def _gathered(value: Any) -> Any:
    """A DTensor with a placement whose local data is not one box (strided shard), gathered; else as it is."""
    if is_dtensor(value) and not _plain_placements(value):
        return value.full_tensor().detach()
    return value
