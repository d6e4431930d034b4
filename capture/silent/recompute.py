"""The recompute check: a sampled step's forward and backward, run a second time before the optimizer, must give the
same digests (forensics/core/silent.py) as the job's own run; with replicated weights, another rank's run of rank
0's first micro-batch must give rank 0's (the cross-rank check, which also sees a fault that repeats on its device).

The job's run is recorded by hooks installed when the step's first micro-batch is recorded (`arm`) and removed at
check() (`finish`): a forward hook per module, a gradient hook per parameter (the micro-batch's gradient before it is
accumulated or all-reduced, so each rank digests its own), and a hook on each recorded loss that keeps the gradient
the job's backward sent into it (its division and loss scale), with which the recompute seeds its backward. The
recompute calls the unwrapped model (no DDP hook, no collective), restores each micro-batch's RNG, computes the
gradients with torch.autograd.grad (no `.grad` is touched) and puts the RNG and the buffers back afterwards.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from forensics.capture.recording.incident import StepRecord
from forensics.core.rng import capture_rng, restore_rng
from forensics.core.silent import Computation, Recorder, run_computation, tensor_digest
from forensics.format.batch_tree import map_tensors

log = logging.getLogger(__name__)


class Recompute:
    """Records the job's run of a sampled step and runs it again.

    Args:
        model: the unwrapped model; loss_fn: `(model, batch) -> loss` (the Guard's).
        grads: compare the gradients too (False: a sharded model — FSDP2 — whose recompute is its forward alone,
            run by every rank together through the model's own all-gathers).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], Any], grads: bool = True):
        self.model, self.loss_fn, self.grads = model, loss_fn, grads
        self.recorder = Recorder(model, grads=grads)
        self.job: Computation | None = None
        self.seeds: list[Any] = []

    @property
    def armed(self) -> bool:
        return self.job is not None

    def arm(self) -> None:
        """The step is sampled: record its run from its first micro-batch on."""
        self.job, self.seeds = self.recorder.attach(), []

    def next_micro_batch(self) -> None:
        if self.job is not None:
            self.job.start_micro_batch()

    def note_loss(self, loss: Any) -> None:
        """A recorded loss: its digest, and (a hook) the gradient the backward sends into it."""
        if self.job is None or not isinstance(loss, torch.Tensor):
            return
        self.job.losses.append(tensor_digest(loss))
        index = len(self.seeds)
        self.seeds.append(None)
        if loss.requires_grad:

            def keep(grad: torch.Tensor, index: int = index) -> None:
                self.seeds[index] = grad.detach().clone()

            loss.register_hook(keep)

    def finish(self, record: StepRecord, fallback_seed: float) -> tuple[Computation, Computation, list[float]] | None:
        """Stops recording and runs the step again: (the job's run, the recompute, the seeds), digests on the host;
        None when the step was not recorded whole (no micro-batch, or fewer losses than micro-batches)."""
        job, self.job = self.job, None
        self.recorder.detach()
        if job is None or not record.batches or len(job.outputs) != len(record.batches):
            return None
        seeds = [float(s) if s is not None else fallback_seed for s in self.seeds]
        seeds += [fallback_seed] * (len(record.batches) - len(seeds))
        again = self.run(record.batches, seeds, record.autocast, lambda i: restore_rng(record.rng[i]))
        return job.to_host(), again.to_host(), seeds

    def run(self, batches: list[Any], seeds: list[float], autocast: dict | None, rng: Callable[[int], None]) -> Any:
        """The micro-batches' forward and backward once more, the RNG and buffers put back afterwards."""
        saved = capture_rng()
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]  # BatchNorm statistics move in a forward
        try:
            return run_computation(self.model, self.loss_fn, batches, seeds, autocast, rng, backward=self.grads)
        finally:
            restore_rng(saved)
            with torch.no_grad():
                for buffer, kept in buffers:
                    buffer.copy_(kept)
            if not self.grads:
                reshard(self.model)


def reshard(model: torch.nn.Module) -> None:
    """FSDP2 leaves the root's parameters unsharded after a forward without autograd (it expects a backward): the
    job's next forward would then use these bf16 copies of the pre-update weights. Every FSDP2 module is resharded, as
    after the job's own backward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2 has no DTensor model to reshard
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def cross_rank(
    recompute: Recompute,
    record: StepRecord,
    job: Computation,
    seeds: list[float],
    rank: int,
    local_device: int | None,
) -> dict | None:
    """Rank 0 sends its first micro-batch, its RNG, its seed and its digests of it (one broadcast of one micro-batch);
    every other rank runs it on its own copy of the weights. Returns this rank's side: rank 0's digests and its own
    (rank 0: None)."""
    device = next((p.device for p in recompute.model.parameters()), torch.device("cpu"))
    if rank == 0:
        sent = [
            map_tensors(record.batches[0], lambda t: t.detach().cpu()),
            record.rng[0],
            seeds[0],
            Computation(job.losses[:1], job.outputs[:1], job.grads[:1]).as_dict(),
            torch.cuda.current_device() if device.type == "cuda" else None,
        ]
    else:
        sent = [None] * 5
    torch.distributed.broadcast_object_list(sent, src=0, device=_object_device())
    if rank == 0:
        return None
    batch, rng, seed, reference, source_device = sent
    batch = map_tensors(batch, lambda t: t.to(device))
    mine = recompute.run(
        [batch], [seed], record.autocast, lambda _: restore_rng(rng, source_device, local_device)
    ).to_host()
    return {"reference": reference, "this_rank": mine.as_dict()}


def _object_device() -> torch.device | None:
    if "nccl" in str(torch.distributed.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None
