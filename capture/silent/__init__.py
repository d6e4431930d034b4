"""Silent data corruption: the opt-in checks of GuardConfig.detection.silent (SilentConfig) and their dump.

- recompute.py: a sampled step run twice on its device (and, replicated, rank 0's first micro-batch on every rank);
- replicas.py: the replicas' parameters compared across ranks;
- inject.py: the fault injection that proves them (FaultSpec, FORENSICS_SILENT_INJECT).

The Guard calls `attach` once, `before_batch` / `note_loss` while a step is recorded, and `judge` at check(): a
mismatch on any rank (one all-reduce of two flags, on sampled steps only) makes every rank report an Incident of
kind `silent_corruption`, with this rank's evidence in the dump member `silent.json` (docs/DUMP_FORMAT.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from typing import Any, Callable

import torch

from forensics.capture.config import GuardConfig
from forensics.capture.recording.incident import Incident, StepRecord
from forensics.capture.silent.inject import FaultSpec, Injector
from forensics.capture.silent.recompute import Recompute, cross_rank
from forensics.capture.silent.replicas import ReplicaCheck
from forensics.capture.state.run_id import collective_device
from forensics.capture.state.source import Ranks
from forensics.core.kinds import Phase, SilentCheck, TriggerKind
from forensics.core.silent import Computation, device_identity, first_difference
from forensics.core.trigger import Trigger
from forensics.format import spec
from forensics.recipes import default_loss

log = logging.getLogger(__name__)

EVIDENCE_VERSION = 1


class SilentWatch:
    """The silent-corruption checks of one Guard (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        wrapped: torch.nn.Module,
        optimizer: Any,
        scaler: Any,
        loss_fn: Callable | None,
        config: GuardConfig,
        ranks: Ranks,
        add_hook: Callable[[Any], None],
    ):
        silent = config.detection.silent
        if silent is None:
            raise ValueError("SilentWatch needs GuardConfig.detection.silent (attach() returns None without it)")
        self.config, self.model, self.ranks, self.scaler = silent, model, ranks, scaler
        self.loss_divisor = config.detection.loss_divisor
        key = config.recording.sample_id_key
        self.sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
        self.recompute = Recompute(
            model, loss_fn or (lambda m, batch: default_loss(m, batch, [key])), grads=not self.sharded
        )
        add_hook(types.SimpleNamespace(remove=self.recompute.recorder.detach))  # a step left armed: close() removes
        self.replicated = ranks.multi_rank and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.replicas = (
            ReplicaCheck(model, optimizer, silent.replica_every, add_hook, collective_device())
            if self.replicated and silent.replica_every
            else None
        )
        fault = silent.inject if silent.inject is not None else FaultSpec.from_environment()
        fault = FaultSpec.parse(fault) if isinstance(fault, str) else fault
        self.injector = Injector(model, fault, ranks.rank, add_hook) if fault is not None else None
        self.first = True

    def sampled(self, step: int) -> bool:
        every = self.config.recompute_every
        return every > 0 and (self.first or step % every == 0)

    def before_batch(self, step: int, first_of_step: bool) -> None:
        """Called by record_batch before the micro-batch is recorded (`first_of_step`: it starts a step)."""
        if first_of_step:
            if self.injector is not None:
                self.injector.begin_step(step)
            if self.sampled(step):
                self.recompute.arm()
        self.recompute.next_micro_batch()

    def note_loss(self, loss: Any) -> None:
        self.recompute.note_loss(loss)

    def judge(self, record: StepRecord, step: int, report: Callable[[Incident], bool], dumped: bool) -> bool:
        """At check(): runs the checks due at `step` and reports a mismatch (`report` is the Guard's
        handle_incident: it dumps and applies the policy). Returns report's decision, True when nothing was found.
        `dumped`: the step already had an incident (its dump directory is taken): a mismatch is logged only."""
        self.first = False
        evidence: dict[str, Any] = {}
        if self.recompute.armed:
            scale = float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else 1.0
            fallback = scale / record.divisor(self.loss_divisor)
            done = self.recompute.finish(record, fallback)
            if done is not None:
                evidence.update(self._recompute_evidence(record, *done))
        replicas = self.replicas.check(step, self.ranks.world_size) if self.replicas is not None else None
        if replicas is not None:
            evidence["replicas"] = replicas
        checks = [evidence.get("recompute_differs", False), evidence.get("cross_rank_differs", False)]
        ran = "recompute_differs" in evidence
        if self.ranks.multi_rank and ran:  # every rank ran the recompute: one flag each crosses
            flags = torch.tensor([float(c) for c in checks], device=collective_device())
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            any_rank = bool(flags.max().item())
        else:
            any_rank = any(checks)
        if not (any_rank or replicas is not None):
            return True
        incident = self._incident(record, step, evidence, any(checks), replicas)
        if dumped:
            log.error(
                "forensics: step %d rank %d: %s (not dumped: the step is dumped already)",
                step,
                self.ranks.rank,
                incident.trigger.message,
            )
            return True
        return report(incident)

    def _recompute_evidence(
        self, record: StepRecord, job: Computation, again: Computation, seeds: list[float]
    ) -> dict[str, Any]:
        found: dict[str, Any] = {"job": job.as_dict(), "recompute": again.as_dict(), "seeds": seeds}
        difference = first_difference(job, again)
        found["recompute_differs"] = difference is not None
        found["first_difference"] = dataclasses.asdict(difference) if difference is not None else None
        if self.replicated and self.config.cross_check and self.ranks.multi_rank:
            local = self.device.index if self.device.type == "cuda" else None
            side = cross_rank(self.recompute, record, job, seeds, self.ranks.rank, local)
            if side is not None:
                part = first_difference(
                    Computation.from_dict(side["reference"]), Computation.from_dict(side["this_rank"])
                )
                side["first_difference"] = dataclasses.asdict(part) if part is not None else None
                found["cross_rank"] = side
                found["cross_rank_differs"] = part is not None
        return found

    def _incident(self, record: StepRecord, step: int, evidence: dict, local: bool, replicas: dict | None) -> Incident:
        rank = self.ranks.rank
        if evidence.get("recompute_differs"):
            check, where = SilentCheck.RECOMPUTE, evidence["first_difference"]
            detail = f"rank {rank}: the recompute of step {step} disagrees with the job's run ({_where(where)})"
        elif evidence.get("cross_rank_differs"):
            check, where = SilentCheck.CROSS_RANK, evidence["cross_rank"]["first_difference"]
            detail = f"rank {rank}: its run of rank 0's micro-batch 1 disagrees with rank 0's ({_where(where)})"
        elif replicas is not None:
            check, local = SilentCheck.REPLICAS, bool(replicas["drifted"]) or replicas["how"] == "undecided"
            names = ", ".join(f"`{p['name']}`" for p in replicas["params"][:3])
            detail = f"replicas disagree on {replicas['differing']} parameter(s) ({names})" + (
                f"; rank {rank}'s copy drifted" if replicas["drifted"] else ""
            )
        else:
            check = SilentCheck.RECOMPUTE
            detail = f"another rank's silent-corruption check failed at step {step}"
        policy = self.config.on_mismatch
        silent = {
            "version": EVIDENCE_VERSION,
            "check": check.value,
            "step": step,
            "rank": rank,
            "world_size": self.ranks.world_size,
            "device": device_identity(self.device),
            "policy": policy.value,
            "injected": list(self.injector.injected) if self.injector is not None else [],
            **evidence,
        }
        losses = [float(v) if isinstance(v, (int, float)) else float(v.detach().float().mean()) for v in record.losses]
        trigger = Trigger(TriggerKind.SILENT_CORRUPTION, None, None, None, detail, local)
        return Incident(
            trigger,
            step,
            record,
            losses,
            None,
            record.divisor(self.loss_divisor),
            policy,
            agreed=self.ranks.multi_rank,
            files={spec.SILENT: json.dumps(silent).encode()},
        )


def _where(where: dict | None) -> str:
    if not where:
        return "no entry named"
    kind = where.get("where")
    if kind == Phase.FORWARD:
        return f"first at module `{where['name']}`'s output, micro-batch {where['micro_batch'] + 1}"
    if kind == Phase.BACKWARD:
        return f"first at the gradient of `{where['name']}`, micro-batch {where['micro_batch'] + 1}"
    return f"first at the {kind} of micro-batch {where['micro_batch'] + 1}"


def attach(
    model: torch.nn.Module,
    wrapped: torch.nn.Module,
    optimizer: Any,
    scaler: Any,
    loss_fn: Callable | None,
    config: GuardConfig,
    ranks: Ranks,
    add_hook: Callable[[Any], None],
) -> SilentWatch | None:
    """The Guard's silent-corruption checks, or None when GuardConfig.detection.silent is None (the default).

    Args:
        model: the unwrapped model; wrapped: as the loop calls it (DDP: its parameters are replicated).
        optimizer, scaler, loss_fn: the Guard's; config: its configuration; ranks: who this process is.
        add_hook: keeps the hooks the checks and the injector install (the Guard removes them at close()).
    """
    if config.detection.silent is None:
        if FaultSpec.from_environment() is not None:
            log.warning("forensics: FORENSICS_SILENT_INJECT is set but DetectionConfig.silent is off: nothing injected")
        return None
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        log.warning(
            "forensics: a DTensor (FSDP2 / tensor-parallel) model: the silent-corruption recompute compares the "
            "loss and every module's output (its forward, run by every rank together), not the gradients; no "
            "replica check (docs/GUIDE.md, 'Silent corruption')"
        )
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda and not torch.are_deterministic_algorithms_enabled():
        log.warning(
            "forensics: the silent-corruption recompute compares bits: without torch.use_deterministic_algorithms(True)"
            " (and CUBLAS_WORKSPACE_CONFIG=:4096:8) a non-deterministic kernel can raise a false alarm, whose replay "
            "then says 'not the hardware' and names the module"
        )
    return SilentWatch(model, wrapped, optimizer, scaler, loss_fn, config, ranks, add_hook)


__all__ = ["FaultSpec", "SilentWatch", "attach"]
