"""The report of a silent-corruption dump (trigger `silent_corruption`, capture/silent/): the step run again on the
replay device, its digests set against the job's two computations, and the class the verdict gives it.

The dump's `silent.json` holds the job's run and its recompute as digests per module output and per gradient
(forensics/core/silent.py), the gradient seeds of each micro-batch, the job's device and the check that fired. The
replay loads the step (pre-step weights, micro-batches, RNG), runs each micro-batch's forward and backward with the
same seeds and digests it the same way, twice (a replay that differs from itself shows the non-determinism that
would explain the job's mismatch). A replica check's dump is judged from the dumped states instead: each rank dump of
the step beside this one is digested parameter by parameter, and the ranks' own evidence says whose weights changed
outside an update. The verdict is decided and worded in replay/judge/verdict_silent.py.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime, timezone
from typing import Any

import torch

from forensics.core.errors import DumpError
from forensics.core.kinds import FidelityMode, Phase, Policy, SilentCheck, SilentClass
from forensics.core.rng import restore_rng
from forensics.core.silent import Computation, device_identity, first_difference, run_computation, tensor_digest
from forensics.report.model import schema_for, to_json_safe
from forensics.report.tree import (
    CaptureEnv,
    Culprit,
    DumpInfo,
    Environment,
    Fidelity,
    History,
    ReplayEnv,
    Report,
    Stats,
    Timings,
    TriggerBlock,
)
from forensics.replay.judge.findings import HistoryFinding
from forensics.replay.judge.verdict_silent import SilentFacts, judgement_block, silent_verdict
from forensics.replay.load.environment import replay_environment, to_device
from forensics.replay.load.fsdp_precision import fsdp_compute
from forensics.replay.options import ReplayOptions, load
from forensics.replay.stages import Progress, stage


def silent_report(
    dump: Any,
    options: ReplayOptions,
    dump_info: dict,
    history: HistoryFinding,
    started: float,
    progress: Progress | None = None,
) -> Report:
    """The report (schema forensics-report/5, verdict `silent_corruption`) of a silent-corruption dump."""
    evidence = dump.silent()
    if evidence is None:
        raise DumpError(f"{dump_info.get('path') or 'the dump'} is a silent-corruption dump without its silent.json")
    check = SilentCheck.parse(evidence.get("check"), SilentCheck.RECOMPUTE)
    base = {
        "check": check,
        "step": dump.step,
        "rank": dump.rank,
        "device": evidence.get("device") if isinstance(evidence.get("device"), dict) else {},
        "policy": Policy.parse(evidence.get("policy"), Policy.RAISE),
    }
    passes = 0
    if check is SilentCheck.REPLICAS:
        stage(progress, "a replica check's dump: comparing the ranks' dumped weights parameter by parameter")
        facts = SilentFacts(**base, replay_device=device_identity("cpu"), replicas=_replicas(dump, evidence))
    else:
        stage(progress, f"replaying step {dump.step} (rank {dump.rank}) twice and digesting every module")
        facts, passes = _replayed_facts(dump, options, evidence, base)
    verdict, judged = silent_verdict(facts)
    return Report.built(
        schema=schema_for(str(verdict.kind)),
        created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        dump=DumpInfo.parse(to_json_safe(dump_info)),
        trigger=TriggerBlock.of(dump.trigger),
        environment=Environment.built(
            capture=CaptureEnv.parse(to_json_safe(dump.manifest.get("environment") or {})),
            replay=ReplayEnv.parse(to_json_safe(replay_environment(torch.device(options.device or "cpu")))),
            warnings=[],
        ),
        reproduced=judged.kind is SilentClass.REPLICA_DRIFT or (judged.kind.hardware and judged.wrong == "both"),
        fidelity=Fidelity.built(
            mode=(FidelityMode.BITWISE if facts.comparable else FidelityMode.TOLERANCE).value
            if passes
            else FidelityMode.NOT_REPLAYED.value,
            reason=None if passes else "a replica check's dump: the ranks' dumped weights were compared, nothing run",
        ),
        verdict=verdict,
        culprit=Culprit(samples=[], module=judged.module, stats=Stats()),
        history=History.parse(to_json_safe(history.block)) if history.block is not None else None,
        history_pattern=history.pattern.value,
        silent=to_json_safe(judgement_block(facts, judged)),
        timings=Timings(total_s=round(time.monotonic() - started, 3), passes=passes),
    )


def _replayed_facts(dump: Any, options: ReplayOptions, evidence: dict, base: dict) -> tuple[SilentFacts, int]:
    session = load(dump, options)
    device = session.device
    replay_device = device_identity(device)
    job_device = base["device"]
    comparable = str(replay_device.get("name")) == str(job_device.get("name"))
    same_device = comparable and (
        (replay_device.get("uuid") and replay_device.get("uuid") == job_device.get("uuid"))
        or (device.type == "cpu" and replay_device.get("host") == job_device.get("host"))
    )
    seeds = [float(s) for s in evidence.get("seeds") or []]

    def rng(index: int) -> None:
        states = session.rng_states
        if index < len(states) and states[index] is not None:
            if device.type == "cuda" and session.source_cuda_device is not None:
                restore_rng(states[index], int(session.source_cuda_device), device.index or 0)
            else:
                restore_rng(states[index])

    model = session.model
    model.train()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    backward = bool(evidence.get("job") and any(evidence["job"].grads))  # an FSDP2 job's check ran its forward only
    precision = (lambda: fsdp_compute(model, session.fsdp_units)) if session.fsdp_units else contextlib.nullcontext

    def replay_once() -> Computation:
        try:
            with precision():  # the dtypes the job's FSDP2 units computed in
                computed = run_computation(
                    model, session.loss_fn, session.micro_batches, seeds, session.autocast, rng, backward=backward
                )
            return computed.to_host()
        finally:
            with torch.no_grad():
                for buffer, kept in buffers:
                    buffer.copy_(kept)

    threads = torch.get_num_threads()
    job_threads = job_device.get("threads")
    if device.type == "cpu" and isinstance(job_threads, int) and 0 < job_threads <= 4096:
        torch.set_num_threads(job_threads)  # a CPU's reductions split by thread: the job's count gives its bits
    try:
        first, second = replay_once(), replay_once()
    finally:
        torch.set_num_threads(threads)
    job: Computation | None = evidence.get("job")
    again: Computation | None = evidence.get("recompute")
    notes = []
    if session.warnings:
        notes.append(f"Replay warnings: {len(session.warnings)} (see the environment block).")
    agree = job is not None and again is not None and first_difference(job, again) is None
    reference = None
    if job is not None and agree and comparable and evidence.get("cross_rank") and first_difference(job, first):
        reference = _replay_reference(dump, session, evidence, backward, precision)  # is the replay comparable?
    determinism = dump.manifest.get("determinism") if isinstance(dump.manifest.get("determinism"), dict) else {}
    facts = SilentFacts(
        **base,
        replay_device=replay_device,
        comparable=comparable,
        same_device=bool(same_device),
        job_vs_recompute=first_difference(job, again) if job and again else None,
        replay_vs_job=first_difference(job, first) if job else None,
        replay_vs_recompute=first_difference(again, first) if again else None,
        replay_vs_replay=first_difference(first, second),
        cross_rank=_cross(evidence),
        job_deterministic=job_device.get("type") == "cpu" or determinism.get("deterministic_algorithms") is True,
        reference_replayed=reference is not None,
        comparison=comparison(job, again, first),
        replay_vs_reference=reference[0] if reference is not None else None,
        notes=notes,
    )
    return facts, 2 + (reference is not None)


COMPARED_ROWS = 20


def comparison(job: Computation | None, again: Computation | None, replay: Computation) -> dict | None:
    """Module by module (forward order), the first COMPARED_ROWS outputs of the micro-batch where the replay first
    parts from the job's run (micro-batch 0 when it does not): each row `[module, job digest, recompute digest,
    replay digest]` (the first rows; where the replay parts later than that, from 5 rows before it; None where a computation has no such row). Names are the dump's, untrusted: cut short."""
    if job is None:
        return None
    parted = first_difference(job, replay)
    micro_batch = parted.micro_batch if parted is not None else 0

    def rows(computation: Computation | None) -> list:
        if computation is None or micro_batch >= len(computation.outputs):
            return []
        return computation.outputs[micro_batch]

    mine, theirs, replayed = rows(job), rows(again), rows(replay)
    at = parted.index if parted is not None and parted.where == Phase.FORWARD else 0
    start = 0 if at < COMPARED_ROWS else at - 5  # the first rows, or those just before the parting and after
    table = []
    for index in range(start, min(start + COMPARED_ROWS, len(mine))):
        name, digest = str(mine[index][0])[:120], mine[index][1]
        other = theirs[index][1] if index < len(theirs) else None
        again_digest = replayed[index][1] if index < len(replayed) else None
        table.append([index, name, digest, other, again_digest])
    return {"micro_batch": micro_batch, "columns": ["call", "module", "job", "recompute", "replay"], "rows": table}


def _replay_reference(dump: Any, session: Any, evidence: dict, backward: bool, precision: Any) -> Any:
    """The cross-rank check's micro-batch (rank 0's first) run on the replay device with this rank's weights (the
    same as rank 0's: replicated), from rank 0's dump of the step beside this one, against rank 0's own digests of it
    (`evidence['cross_rank']['reference']`, computed on a healthy device): (where they part or None,) — None when
    rank 0's dump is not there or cannot be read."""
    try:
        peer = next((p for p in dump.peers() if p.rank == 0), None)
        if peer is None or peer.num_micro_batches < 1:
            return None
        batch = to_device(peer.micro_batch(0), session.device)
        state = peer.rng_state(0)
        seeds = (peer.silent() or {}).get("seeds") or [None]
        seed = float(seeds[0]) if isinstance(seeds[0], (int, float)) else None
        source = peer.manifest.get("local_rank")
    except Exception:  # noqa: BLE001 - a peer that cannot be read leaves the replay unchecked, said in the verdict
        return None

    def rng(_: int) -> None:
        if session.device.type == "cuda" and isinstance(source, int):
            restore_rng(state, source, session.device.index or 0)
        else:
            restore_rng(state)

    model = session.model
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with precision():
            mine = run_computation(model, session.loss_fn, [batch], [seed], session.autocast, rng, backward=backward)
        mine = mine.to_host()
    finally:
        with torch.no_grad():
            for buffer, kept in buffers:
                buffer.copy_(kept)
    return (first_difference(evidence["cross_rank"]["reference"], mine),)


def _cross(evidence: dict) -> Any:
    cross = evidence.get("cross_rank")
    if not cross:
        return None
    return first_difference(cross["reference"], cross["this_rank"])


def _replicas(dump: Any, evidence: dict) -> dict:
    """The replica check's facts: the parameters the job found differing, the rank that drifted (by the job's vote, or
    the one whose weights changed since its update, from every rank's evidence beside this dump), and whether the
    dumped states differ on those parameters."""
    mine: dict = evidence["replicas"] if isinstance(evidence.get("replicas"), dict) else {}
    names = [str(p.get("name")) for p in mine.get("params") or [] if isinstance(p, dict)]
    drifted: int | None = dump.rank if mine.get("drifted") else None
    how = mine.get("how") if drifted is not None else None
    peers: list = []
    try:
        peers = dump.peers()
    except Exception:  # noqa: BLE001 - a rank dump alone: its own evidence is all there is
        peers = []
    confirmed = False
    if peers:
        wanted = set(names)  # only the parameters that differ are read: a large state stays on disk
        state = dict(dump.iter_model_tensors(names=wanted))
        for peer in peers:
            other = peer.silent() or {}
            theirs: dict = other["replicas"] if isinstance(other.get("replicas"), dict) else {}
            if drifted is None and theirs.get("drifted"):
                drifted, how = peer.rank, theirs.get("how")
            peer_state = dict(peer.iter_model_tensors(names=wanted))
            for name in names:
                if name in state and name in peer_state and _digest(state[name]) != _digest(peer_state[name]):
                    confirmed = True
    return {
        "params": names,
        "differing": mine.get("differing"),
        "world_size": mine.get("world_size"),
        "drifted_rank": drifted,
        "how": how,
        "confirmed": confirmed,
    }


def _digest(tensor: torch.Tensor) -> int:
    return int(tensor_digest(tensor)[0])
