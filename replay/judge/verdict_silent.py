"""The verdict of a silent-corruption dump (trigger `silent_corruption`), decided from the facts the replay handed
over (`SilentFacts`, built by replay/judge/silent.py), worded and checked here.

The job computed the step twice (its own run A and the Guard's recompute B, on the job's device); the replay runs it a
third time (R) on the replay device, twice, to see its own non-determinism. The replay is evidence only where it is
shown to reproduce the job's numerics: where A and B part (P), R must agree with A and B on everything before P; where
A == B, R must reproduce a healthy reference computed on another device (the cross-rank check's: rank 0's digests of
its micro-batch, which the replay runs again from rank 0's dump beside this one: `replay_vs_reference`). Where the
replay cannot be shown comparable, the job's own evidence decides (or the verdict says it cannot). Rules, in order:

| facts                                                                   | class          | blamed / evidence     |
|-------------------------------------------------------------------------|----------------|-----------------------|
| the check was the replicas'                                             | `replica_drift`| the rank that drifted |
| not replayed                                                            | `undecided`    | nothing               |
| the replay's two runs differ from each other                            | `not_hardware` | nothing (that module) |
| A != B, R == A through P (`sides_with`)                                 | `transient`    | the recompute B       |
| A != B, R == B through P                                                | `transient`    | the job's run A       |
| A != B, R == A == B before P, R differs from both at P                  | `persistent`   | the job's device      |
| A != B, R differs from both before P (or another kind of device), the   | `transient`    | the job's device; the |
|   job deterministic                                                     |                | job's evidence alone  |
| A != B, R not comparable, the job not deterministic                     | `undecided`    | nothing               |
| A == B == R, the replay on the job's own device                         | `undecided`    | cannot tell (say so)  |
| A == B == R                                                             | `not_hardware` | this rank is fine     |
| A == B, R != A, R reproduces rank 0's reference                         | `persistent`   | the job's device      |
| A == B, R != A, no reference or R does not reproduce it; this rank's    | `undecided`    | persistent likely on  |
|   cross-rank check disagreed with rank 0                                |                | this rank: drain it   |
| A == B, R != A, no comparable reference, nothing local                  | `undecided`    | nothing               |
| A == B, another kind of device                                          | `undecided`    | as the two rows above |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forensics.core.kinds import Phase, Policy, SilentCheck, SilentClass, VerdictKind
from forensics.core.silent import Difference
from forensics.report.tree import Verdict
from forensics.report.wording import clean
from forensics.replay.judge.verdict_words import verdict_of


@dataclass(frozen=True)
class SilentFacts:
    """What the replay established about a silent-corruption dump (replay/judge/silent.py)."""

    check: SilentCheck
    step: int
    rank: int
    device: dict
    """The job's device identity (silent.json `device`)."""
    replay_device: dict
    policy: Policy
    comparable: bool = True
    """The replay can compare bits with the job (the same kind of device)."""
    same_device: bool = False
    """The replay ran on the job's own device (same UUID; a CPU replay of a CPU job on the same host)."""
    job_vs_recompute: Difference | None = None
    """Where the job's run and its recompute part (None: they agree)."""
    replay_vs_job: Difference | None = None
    replay_vs_recompute: Difference | None = None
    replay_vs_replay: Difference | None = None
    """Where the replay's two runs part (None: the replay is deterministic, or ran once)."""
    cross_rank: Difference | None = None
    """This rank's run of rank 0's micro-batch against rank 0's (the cross-rank check)."""
    replicas: dict | None = None
    """The replica check: `params` (names that differ), `drifted_rank` (or None), `how`, `confirmed` (the dumped
    states differ on those parameters)."""
    replayed: bool = True
    job_deterministic: bool = False
    """The job ran under torch.use_deterministic_algorithms(True) (or on the CPU): its two runs on one device parting
    is a fault of that device, not a kernel's non-determinism."""
    replay_vs_reference: Difference | None = None
    """The replay of the cross-rank check's micro-batch (rank 0's, from its dump) against rank 0's own digests of it:
    None where they agree (the replay reproduces a healthy device's bits) or where it was not run
    (`reference_replayed`)."""
    reference_replayed: bool = False
    comparison: dict | None = None
    """Module by module, the first rows of the micro-batch where the replay first parts from the job (`comparison`
    in replay/judge/silent.py): what a reader checks a verdict against."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SilentJudgement:
    """The class and what it blames, as the report's `silent` block stores it."""

    kind: SilentClass
    module: str | None
    """Where the computations first part (a module, or 'gradient of <parameter>'), when they do."""
    drain_rank: int | None
    """The rank whose device to drain, when a device is blamed."""
    wrong: str | None
    """Which computation was wrong: 'job' (the step's own run), 'recompute', 'both' or None."""
    evidence: str = "replay"
    """What decided: 'replay' (the replay reproduced the job and sided), 'job' (the job's own runs: the replay could
    not be shown to reproduce the job's numerics) or 'none'."""
    replay_parted: str | None = None
    """Where the replay first differs from the job's computations, when it could not be shown comparable."""


def judge(facts: SilentFacts) -> SilentJudgement:
    """The class of a silent-corruption dump (the module docstring's table, in order)."""
    if facts.check is SilentCheck.REPLICAS:
        drifted = (facts.replicas or {}).get("drifted_rank")
        names = (facts.replicas or {}).get("params") or []
        return SilentJudgement(SilentClass.REPLICA_DRIFT, names[0] if names else None, drifted, None, "job")
    if not facts.replayed:
        return SilentJudgement(
            SilentClass.UNDECIDED, _where(facts.job_vs_recompute or facts.cross_rank), None, None, "none"
        )
    if facts.comparable and facts.replay_vs_replay is not None:
        return SilentJudgement(SilentClass.NOT_HARDWARE, _where(facts.replay_vs_replay), None, None)
    parting = facts.job_vs_recompute
    if parting is not None:
        where = _where(parting)
        if facts.comparable:
            if sides_with(facts.replay_vs_job, parting):
                return SilentJudgement(SilentClass.TRANSIENT, where, facts.rank, "recompute")
            if sides_with(facts.replay_vs_recompute, parting):
                return SilentJudgement(SilentClass.TRANSIENT, where, facts.rank, "job")
            if not (parts_before(facts.replay_vs_job, parting) or parts_before(facts.replay_vs_recompute, parting)):
                return SilentJudgement(SilentClass.PERSISTENT, _where(facts.replay_vs_job), facts.rank, "both")
        parted = _where(facts.replay_vs_job) if facts.comparable else None
        if facts.job_deterministic:  # one device, one input, deterministic kernels, two answers: that device
            return SilentJudgement(SilentClass.TRANSIENT, where, facts.rank, None, "job", parted)
        return SilentJudgement(SilentClass.UNDECIDED, where, None, None, "none", parted)
    if facts.comparable and facts.replay_vs_job is None:
        kind = SilentClass.UNDECIDED if facts.same_device else SilentClass.NOT_HARDWARE
        return SilentJudgement(kind, _where(facts.cross_rank), None, None)
    if facts.comparable and facts.reference_replayed and facts.replay_vs_reference is None:
        return SilentJudgement(SilentClass.PERSISTENT, _where(facts.replay_vs_job), facts.rank, "both")
    parted = _where(facts.replay_vs_job) if facts.comparable else None
    if facts.cross_rank is not None:  # its two runs agree, a healthy rank's run of the same input does not
        return SilentJudgement(SilentClass.UNDECIDED, _where(facts.cross_rank), facts.rank, None, "job", parted)
    return SilentJudgement(SilentClass.UNDECIDED, parted, None, None, "none", parted)


def parts_before(replay_vs_x: Difference | None, parting: Difference) -> bool:
    """The replay differs from computation X strictly before the point where the job's two computations part: where
    the job's runs still agree, the replay does not reproduce them (its device's numerics differ)."""
    if replay_vs_x is None or sides_with(replay_vs_x, parting):
        return False
    same_point = (replay_vs_x.micro_batch, replay_vs_x.where, replay_vs_x.name) == (
        parting.micro_batch,
        parting.where,
        parting.name,
    ) and (parting.where != Phase.FORWARD or replay_vs_x.index == parting.index)
    return not same_point


_PHASE_ORDER = {Phase.FORWARD: 0, "loss": 1, Phase.BACKWARD: 2}


def sides_with(replay_vs_x: Difference | None, parting: Difference) -> bool:
    """The replay agrees with computation X where the job's two computations part, and before: it matches X bit for
    bit, or first differs from X later in the step (a later micro-batch; the loss or the backward after a forward
    parting; a later module call; another gradient) — a difference of the replay device's own numerics downstream,
    not the fault."""
    if replay_vs_x is None:
        return True
    if replay_vs_x.micro_batch != parting.micro_batch:
        return replay_vs_x.micro_batch > parting.micro_batch
    mine, theirs = _PHASE_ORDER.get(replay_vs_x.where, 3), _PHASE_ORDER.get(parting.where, 3)
    if mine != theirs:
        return mine > theirs and theirs < 3
    if parting.where == Phase.FORWARD:
        return replay_vs_x.index > parting.index
    return parting.where == Phase.BACKWARD and replay_vs_x.name != parting.name


def _where(difference: Difference | None) -> str | None:
    if difference is None:
        return None
    if difference.where == Phase.BACKWARD:
        return f"gradient of {clean(difference.name, 200)}"
    if difference.where == "loss":
        return "loss"
    return clean(difference.name, 200) or None


def _device_words(device: dict) -> str:
    parts = [clean(str(device.get("name") or device.get("type") or "device"), 80)]
    if device.get("index") is not None:
        parts.append(f"index {device['index']}")
    for key, label in (("uuid", "UUID"), ("pci_bus_id", "PCI bus")):
        if device.get(key):
            parts.append(f"{label} {clean(str(device[key]), 80)}")
    if device.get("host"):
        parts.append(f"host {clean(str(device['host']), 120)}")
    return ", ".join(parts)


def silent_verdict(facts: SilentFacts) -> tuple[Verdict, SilentJudgement]:
    """The report's verdict (kind `silent_corruption`) and the judgement behind it."""
    judged = judge(facts)
    step, rank, device = facts.step, facts.rank, _device_words(facts.device)
    where = f" (first at `{judged.module}`)" if judged.module else ""
    resume = f"resume from a checkpoint written before step {step}"
    kind = judged.kind
    if kind is SilentClass.REPLICA_DRIFT:
        names = ", ".join(f"`{clean(str(n), 120)}`" for n in (facts.replicas or {}).get("params", [])[:5])
        drifted = judged.drain_rank
        who = f"rank {drifted}'s copy drifted" if drifted is not None else "the ranks cannot tell which copy drifted"
        headline = f"Silent corruption at step {step}: the replicas' weights disagree ({names}); {who}."
        replicas = facts.replicas or {}
        how = replicas.get("how") or ""
        explanation = (
            f"The replica check compared one digest per parameter across the {replicas.get('world_size')} "
            f"replicas: {replicas.get('differing')} parameter(s) differ. "
            + (f"Rank {drifted} was named by {clean(how, 60)}. " if drifted is not None else "")
            + (
                "The dumped pre-step states confirm it: they differ on those parameters. "
                if replicas.get("confirmed")
                else "The other ranks' dumps were not beside this one: the dumped states were not compared. "
            )
            + "Gradients are all-reduced, so a compute fault reaches every replica alike: a drift is the weights' "
            "memory or that rank's optimizer update."
        )
        suggestions = [
            f"Drain rank {drifted}'s node ({device if drifted == rank else 'see its dump: silent.json device'}) "
            "and run a memory test on it."
            if drifted is not None
            else "Replay each rank's dump of this step: "
            "the one whose weights changed outside its update is the one to drain.",
            f"{resume.capitalize()} (the replicas agreed at the previous replica check), or broadcast a healthy "
            "replica's weights before going on.",
        ]
    elif kind is SilentClass.TRANSIENT and judged.evidence == "job":
        headline = (
            f"Silent corruption at step {step}, rank {rank}: a transient fault of the job's device{where} — its two "
            "runs of the step, on one device under deterministic algorithms, disagree."
        )
        explanation = (
            f"The job ran the step twice on {device} with deterministic algorithms; the two runs part{where}: the "
            f"device gave two answers to one computation. {_unreproduced(facts, judged)} Which of the two runs was "
            f"wrong is not known. Policy applied in the job: {facts.policy.value}."
        )
        suggestions = [
            f"Re-run step {step}: the fault did not repeat within the step."
            + (
                f" The policy ({facts.policy.value}) applied the step's gradients, which may be the wrong ones: {resume}."
                if facts.policy is Policy.CONTINUE
                else f" The policy ({facts.policy.value}) kept the step's gradients out."
            ),
            f"Watch rank {rank}'s device ({device}): drain its node if silent corruption recurs there.",
        ]
    elif kind is SilentClass.TRANSIENT:
        hit = "the Guard's recompute" if judged.wrong == "recompute" else "the job's own run"
        headline = (
            f"Silent corruption at step {step}, rank {rank}: a transient fault hit {hit}{where}; "
            f"the replay agrees with the other computation."
        )
        explanation = (
            f"The job ran the step twice on {device}; the two runs part{where}. The replay on "
            f"{_device_words(facts.replay_device)} matches the "
            f"{'job' if judged.wrong == 'recompute' else 'recompute'} bit for bit, so the "
            f"{'recompute' if judged.wrong == 'recompute' else 'job'} was wrong and the fault did not repeat. "
            f"Policy applied in the job: {facts.policy.value}."
        )
        later = facts.replay_vs_job if judged.wrong == "recompute" else facts.replay_vs_recompute
        if later is not None:
            explanation = explanation.replace("bit for bit", "bit for bit through the point where they part") + (
                f" Later in the step the replay's bits differ from it too (first at `{_where(later)}`): the replay "
                "device's own numerics, downstream of the fault."
            )
        suggestions = [
            f"Re-run step {step}: the fault did not repeat."
            + (
                (
                    f" The job's own gradients were wrong and the policy ({facts.policy.value}) applied them: {resume}."
                    if facts.policy is Policy.CONTINUE
                    else f" The job's own gradients were wrong; the policy ({facts.policy.value}) kept them out."
                )
                if judged.wrong == "job"
                else " The step's own gradients were right."
            ),
            f"Watch rank {rank}'s device ({device}): drain its node if silent corruption recurs there.",
        ]
    elif kind is SilentClass.PERSISTENT:
        headline = (
            f"Silent corruption at step {step}, rank {rank}: the job's device computes wrong, reproducibly{where}; "
            f"drain {device}."
        )
        explanation = (
            "The job's computations of the step "
            + ("disagree with each other and " if facts.job_vs_recompute is not None else "agree with each other but ")
            + f"the replay on {_device_words(facts.replay_device)} differs from them{where}: the fault repeats on "
            f"the job's device. Policy applied in the job: {facts.policy.value}."
        )
        suggestions = [
            f"Drain rank {rank}'s node ({device}) and run the vendor's diagnostics on it.",
            f"{resume.capitalize()}: the steps this device computed before may be wrong too (the first bad step is "
            f"at or before {step}).",
        ]
    elif kind is SilentClass.NOT_HARDWARE:
        if facts.replay_vs_replay is not None:
            headline = (
                f"Not the hardware at step {step}: the replay is not deterministic itself, first at `{judged.module}`."
            )
            explanation = (
                "Two replays of the step on the same device part there: an operation of that module is not "
                "deterministic, so the job's two runs may part without any fault."
            )
            suggestions = [
                f"Make `{judged.module}` deterministic (torch.use_deterministic_algorithms(True), a deterministic "
                "kernel) before relying on the recompute check.",
                "Nothing to drain.",
            ]
        else:
            headline = (
                f"Not the hardware on rank {rank} at step {step}: its computations agree with the replay bit for bit."
            )
            other = (
                " The cross-rank check found this rank disagreeing with rank 0 on rank 0's micro-batch: replay rank "
                "0's dump of this step, whose device is then the suspect."
                if facts.cross_rank is not None
                else " Another rank's check fired: replay that rank's dump (the one whose trigger is local)."
            )
            explanation = (
                f"The job's run, its recompute and the replay on {_device_words(facts.replay_device)} agree.{other}"
            )
            suggestions = ["Nothing to drain on this rank.", "Replay the rank whose check fired."]
    elif judged.evidence == "job":  # undecided, the job's own evidence: persistent likely on this rank
        headline = (
            f"Silent corruption at step {step}, rank {rank}{where}: undecided — a persistent fault of rank {rank}'s "
            f"device is likely (its two runs agree, and its run of rank 0's micro-batch disagrees with rank 0's), "
            "but the replay could not be checked against a healthy device."
        )
        explanation = (
            f"{_unreproduced(facts, judged)} The job's own evidence: rank {rank} computed the step twice alike on "
            f"{device}, and its run of the input rank 0 computed gave other bits than rank 0's device. Policy applied "
            f"in the job: {facts.policy.value}."
        )
        suggestions = [
            f"Drain rank {rank}'s node ({device}) to be safe, and run the vendor's diagnostics on it.",
            "Replay this dump with rank 0's dump of the step beside it, on a device of the job's model, to decide.",
            f"{resume.capitalize()} if the diagnostics fail.",
        ]
    else:
        if facts.same_device and facts.replay_vs_job is None:
            headline = (
                f"Silent corruption at step {step}, rank {rank}: undecided — the replay ran on the job's own device "
                "and agrees with it, so a persistent fault cannot be told from a genuine result."
            )
            explanation = "A replay on the device that may be faulty reproduces its fault."
        elif facts.comparable:
            headline = (
                f"Silent corruption at step {step}, rank {rank}{where}: undecided — the replay on "
                f"{_device_words(facts.replay_device)} does not reproduce the job's computations bit for bit."
            )
            explanation = _unreproduced(facts, judged) + (
                " The job's two runs part without deterministic algorithms, which a non-deterministic kernel explains."
                if facts.job_vs_recompute is not None
                else " Nothing computed on a healthy device (the cross-rank check's reference) shows which is right."
            )
        else:
            headline = (
                f"Silent corruption at step {step}, rank {rank}{where}: undecided — the replay device "
                f"({_device_words(facts.replay_device)}) cannot match the job's bits."
            )
            explanation = (
                "A fault of a low bit is smaller than the difference between two kinds of device, so only a replay "
                "on the job's kind of device (the same GPU model) can classify it."
            )
        suggestions = [
            f"Replay this dump on another device of the job's model ({clean(str(facts.device.get('name')), 80)}).",
            f"Until then, treat rank {rank}'s device ({device}) as suspect.",
        ]
    explanation = " ".join([explanation, *facts.notes]).strip()
    _check_consistent(judged, headline)
    return verdict_of(VerdictKind.SILENT_CORRUPTION, headline, explanation, suggestions), judged


def _unreproduced(facts: SilentFacts, judged: SilentJudgement) -> str:
    """Why the replay is not the evidence: where it parted from the job, and what that means."""
    if not facts.comparable:
        return (
            f"The replay device ({_device_words(facts.replay_device)}) is not of the job's kind: its bits cannot be "
            "compared with the job's."
        )
    parts = [
        f"The replay on {_device_words(facts.replay_device)} could not reproduce the job bit for bit"
        + (f": it first differs at `{judged.replay_parted}`" if judged.replay_parted else "")
        + (
            ", before the point where the job's two runs part"
            if facts.job_vs_recompute is not None and judged.replay_parted
            else ""
        )
        + ", so the replay device's numerics differ from the job's and cannot decide by themselves."
    ]
    if facts.reference_replayed and facts.replay_vs_reference is not None:
        parts.append(
            f"It does not reproduce rank 0's healthy run of rank 0's micro-batch either (first at "
            f"`{_where(facts.replay_vs_reference)}`)."
        )
    elif facts.job_vs_recompute is None and not facts.reference_replayed:
        parts.append("Rank 0's dump of the step was not beside this one: no healthy reference to check the replay.")
    return " ".join(parts)


def _check_consistent(judged: SilentJudgement, headline: str) -> None:
    """A verdict that blames no device never tells the user to drain one, and one that does names its rank."""
    if judged.kind.hardware and judged.kind is not SilentClass.REPLICA_DRIFT and judged.drain_rank is None:
        raise ValueError(f"silent verdict {judged.kind} names no rank")
    if not judged.kind.hardware and "drain " in headline.lower():
        raise ValueError(f"silent verdict {judged.kind} tells to drain a device")


def judgement_block(facts: SilentFacts, judged: SilentJudgement) -> dict[str, Any]:
    """The report's `silent` block."""
    return {
        "class": judged.kind.value,
        "check": facts.check.value,
        "module": judged.module,
        "wrong": judged.wrong,
        "drain_rank": judged.drain_rank,
        "rank": facts.rank,
        "device": facts.device,
        "replay_device": facts.replay_device,
        "comparable": facts.comparable,
        "same_device": facts.same_device,
        "policy": facts.policy.value,
        "replicas": facts.replicas,
        "evidence": judged.evidence,
        "replay_parted": judged.replay_parted,
        "job_deterministic": facts.job_deterministic,
        "reference_replayed": facts.reference_replayed,
        "replay_vs_reference": _where(facts.replay_vs_reference),
        "comparison": facts.comparison,
    }


__all__ = ["SilentFacts", "SilentJudgement", "judge", "judgement_block", "parts_before", "sides_with", "silent_verdict"]
