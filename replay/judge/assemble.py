"""The one place the report is assembled: from the replay's Findings to the report (forensics/report/tree.py; schema
forensics-report/1, docs/REPORT_FORMAT.md), including the facts the verdict is decided on.
Writing the report to disk is forensics.report's job."""

from __future__ import annotations

import dataclasses
import math
import time
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence, cast

import torch

from forensics.report.wording import fmt_id, fp32_ran_words
from forensics.format.jsonio import lenient_float
from forensics.format.batch_tree import tensor_leaves
from forensics.core.kinds import Phase, TriggerKind
from forensics.report.model import schema_for, to_json_safe
from forensics.report.tree import (
    N,
    Bisection,
    CaptureEnv,
    Culprit,
    CulpritSample,
    DumpInfo,
    Environment,
    ExceptionBlock,
    Fidelity,
    History,
    LayerRow,
    Precision,
    Remedies,
    ReplayEnv,
    Report,
    RngCheck,
    SampleRow,
    Stats,
    Timings,
    TriggerBlock,
)
from forensics.replay.culprits.per_sample import rank_by_loss
from forensics.replay.culprits.sample_facts import describe
from forensics.replay.judge.findings import Findings
from forensics.replay.judge.verdict import (
    VerdictFacts,
    blamed_samples,
    decide_verdict,
    marks_triggers,
    refutations,
)
from forensics.replay.judge.verdict_context import NO_CONTEXT, VerdictContext
from forensics.replay.judge.verdict_facts import diverged_here
from forensics.replay.load.environment import replay_environment
from forensics.replay.load.session import ReplaySession
from forensics.replay.load.shared_ids import SharedId, id_key, positions_words, shared_ids, shared_ids_warning
from forensics.replay.localize.forward_backward import INPUT_MODULE, ROOT_MODULE
from forensics.replay.run.execute import SampleRef, StepRunner
from forensics.replay.run.units import explaining_factor, recorded_factors


def assemble_report(
    findings: Findings,
    runner: StepRunner,
    dump_info: dict | None,
    started: float,
    context: VerdictContext = NO_CONTEXT,
) -> Report:
    """The report of one replay, built as the tree its renderers read; JSON-safe (non-finite floats as "nan"/"inf").
    `context`: what the verdict says around the replayed step (replay/judge/verdict_context.py)."""
    session = runner.session
    rank = int((dump_info or {}).get("rank") or 0)
    blamed = blamed_samples(findings)  # the bisection block keeps what was found; the culprit, whom the verdict blames
    shared = shared_ids(session.sample_ids, session.positional_ids)
    culprit = culprit_block(findings, rank, session.positional_ids, blamed, shared)
    fidelity = findings.reproduction.fidelity
    if findings.kind is TriggerKind.NONFINITE_PARAM and findings.optimizer is not None:
        fidelity["optimizer_reproduced"] = True
    facts = verdict_facts(findings, session, dump_info, culprit, blamed)
    if findings.evidence is not None:  # evidence the replay's own findings contradict counts for nothing
        findings.evidence.refuted = refutations(facts)
        facts = dataclasses.replace(facts, evidence_bad_data=findings.evidence.bad_data)
    verdict = decide_verdict(facts, context)
    if (diverged := diverged_here(facts)) is not None:  # what the rule that decided model_state read (verdict.py)
        fidelity = {**fidelity, "diverged": diverged.as_dict()}
    if marks_triggers(verdict, findings):
        for sample in culprit.samples:
            sample.trigger = True
    unknown: dict[str, Any] = {
        "path": None,
        "run_id": None,
        "step": 0,
        "rank": rank,
        "world_size": session.world_size,
        "missing_ranks": [],
    }
    dump = {"num_micro_batches": max(len(session.micro_batches), session.step_micro_batches), **(dump_info or unknown)}
    history = findings.history
    report = Report.built(
        schema=schema_for(str(verdict.kind)),
        created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        dump=DumpInfo.parse(to_json_safe(dump)),
        trigger=TriggerBlock.of(findings.trigger),
        environment=Environment.built(
            capture=CaptureEnv.parse(to_json_safe(session.capture_environment)),
            replay=ReplayEnv.parse(to_json_safe(replay_environment(session.device))),
            warnings=to_json_safe([*session.warnings, *filter(None, [shared_ids_warning(shared)])]),
        ),
        reproduced=findings.reproduced,
        fidelity=Fidelity.parse(to_json_safe(fidelity)),
        rng=_block(RngCheck, findings.rng),
        verdict=verdict,
        culprit=culprit,
        precision=_block(Precision, findings.precision),
        margin=to_json_safe(findings.margin),
        evidence=to_json_safe(findings.evidence.as_dict()) if findings.evidence is not None else None,
        bisection=_block(Bisection, findings.bisection.block),
        per_sample=[SampleRow.parse(row) for row in to_json_safe(findings.per_sample)],
        per_layer=[LayerRow.parse(row) for row in to_json_safe(findings.per_layer)],
        history=_block(History, history.block),
        history_pattern=history.pattern.value,
        timings=Timings(total_s=round(time.monotonic() - started, 3), passes=runner.passes),
    )
    if report.history is not None:
        if history.signals:
            report.history.signals = to_json_safe(history.signals)
        if history.diverged:
            report.history.diverged = history.diverged
        if history.reading.onset is not None:
            report.history.shows = to_json_safe(history.reading.sentences)
    if findings.kind is TriggerKind.EXCEPTION:
        report.exception = ExceptionBlock.parse(to_json_safe(_exception_block(findings, session)))
    if findings.corrupted:
        report.weights = to_json_safe(_weights_block(findings))
    if findings.remedies:
        report.remedies = _block(Remedies, findings.remedies)
    return report


def _block(cls: type[N], found: Mapping | None) -> N | None:
    """A stage's finding whose keys are its report block's (a TypedDict, replay/judge/findings.py) as that block,
    JSON-safe; None: the stage did not run."""
    return cls.parse(to_json_safe(found)) if found is not None else None


def _weights_block(findings: Findings) -> dict:
    """The report's `weights` block: the parameters non-finite before the step, and who meets them."""
    failing, checked = _per_sample_failures(findings)
    return {
        "parameters": [c.as_dict() for c in findings.corrupted],
        "touching": {name: [r.sample_id for r in refs] for name, refs in (findings.touching or {}).items()},
        "samples_failing": failing,
        "samples_checked": checked,
    }


def _per_sample_failures(findings: Findings) -> tuple[list, int]:
    rows = [r for r in findings.per_sample if isinstance(r, dict)]
    # a sample that raised alone (a BatchNorm cannot take one sample) did not fail: it could not run
    return [r.get("sample_id") for r in rows if r.get("finite") is False and not r.get("error")], len(rows)


def _exception_block(findings: Findings, session: ReplaySession) -> dict:
    """The report's `exception` block: what the job raised, and where the replay raised it."""
    recorded = session.exception or {}
    found = findings.exception
    return {
        "type": recorded.get("type"),
        "message": recorded.get("message"),
        "during": recorded.get("during"),
        "replayed_type": found.type if found else None,
        "module": found.module if found else None,
        "op": found.op if found else None,
        "micro_batch": found.micro_batch if found else None,
        "detail": found.detail if found else None,
        "bad_values": found.bad_values if found else [],
        "memory": recorded.get("memory"),
        "sizes": findings.sizes.as_dict() if findings.sizes is not None else None,
        "traceback": recorded.get("traceback"),
    }


def culprit_block(
    findings: Findings,
    rank: int,
    positional: frozenset[int] = frozenset(),
    blamed: list[SampleRef] | None = None,
    shared: list[SharedId] | None = None,
) -> Culprit:
    """The report's `culprit` block: the samples the verdict blames (`blamed`; default: every one found), and where
    the first non-finite value appeared; a sample whose ID is only its position in the batch (`positional`:
    micro-batches recorded without IDs) says so, and one whose ID other samples of the step carry too (`shared`:
    replay/load/shared_ids.py) names their positions (`shared_with`), which keeps that ID out of any blocklist."""
    forward, backward, optimizer = findings.forward, findings.backward, findings.optimizer
    chosen = findings.culprits if blamed is None else blamed
    at = {(r.micro_batch, r.index) for r in chosen}
    carried = {id_key(s.sample_id): [p for p in s.positions if p not in at] for s in shared or []}
    samples = []
    for ref in chosen:
        sample = CulpritSample.built(
            sample_id=to_json_safe(ref.sample_id), micro_batch=ref.micro_batch, index=ref.index, rank=rank
        )
        if ref.micro_batch in positional:
            sample.positional = True
        elif carried.get(id_key(ref.sample_id)):
            sample.shared_with = [{"micro_batch": mb, "index": i} for mb, i in carried[id_key(ref.sample_id)]]
        if ref in findings.sample_facts:
            sample.description = describe(findings.sample_facts[ref])
        samples.append(sample)
    block = Culprit(samples=samples, stats=Stats(), phase=None)
    if forward is not None:
        from_data = (forward.module or "").startswith(INPUT_MODULE + ".")  # a batch field, named in `module`
        block.module, block.op, block.phase = forward.module, forward.op, Phase.FORWARD
        block.stats = Stats.parse(to_json_safe(forward.stats))
        block.parameter = forward.nonfinite_inputs[0] if forward.nonfinite_inputs and not from_data else None
    elif backward is not None:
        block.module, block.op, block.phase = backward.module, backward.op, Phase.BACKWARD
        block.parameter, block.traceback = backward.parameter, backward.traceback
    elif optimizer is not None:
        block.phase, block.parameter = Phase.OPTIMIZER, optimizer.parameter
        block.optimizer_state = optimizer.optimizer_state
        block.module = optimizer.parameter.rpartition(".")[0] or ROOT_MODULE if optimizer.parameter else None
    if findings.exception is not None:
        block.module, block.op, block.phase = findings.exception.module, findings.exception.op, findings.exception.phase
    if findings.weights_nonfinite:  # the weights themselves: name the first broken one
        name = findings.weights_nonfinite[0]
        block.parameter = name
        if block.module is None:
            block.module = name.rpartition(".")[0] or ROOT_MODULE
    if block.phase is None:
        block.phase = findings.phase
    return block


def _unit_words(findings: Findings, session: ReplaySession) -> str | None:
    """A step not reproduced whose recorded value is the replayed one times a recorded factor (loss scale, world
    size, accumulation count): that factor, in words (replay/run/units.py); None otherwise."""
    if findings.reproduced:
        return None
    trigger, result = findings.trigger, findings.reproduction.result
    what = trigger.kind.replayed.words if trigger.kind.replayed is not None else "loss"
    unit = explaining_factor(
        trigger.value, result.replayed_value(trigger.kind, trigger.micro_batch), recorded_factors(session)
    )
    return unit.words(what) if unit is not None else None


def verdict_facts(
    findings: Findings, session: ReplaySession, dump_info: dict | None, culprit: Culprit, blamed: list[SampleRef]
) -> VerdictFacts:
    """What the verdict rules (replay/judge/verdict.py) decide on, read from the typed findings; `blamed`: the samples
    the verdict blames (replay/judge/verdict.blamed_samples), of those found."""
    kind, trigger, result = findings.kind, findings.trigger, findings.reproduction.result
    micro_batch = trigger.micro_batch
    if micro_batch is None and findings.forward is not None:
        micro_batch = findings.forward.micro_batch
    precision = cast("dict[str, Any]", findings.precision or {})  # TypedDicts, read as dicts here
    rng = cast("dict[str, Any]", findings.rng or {})
    sizes = findings.sizes
    tested = cast("dict[str, Any]", findings.remedies or {}).get("tested", [])
    remedies = {row["kind"]: row.get("healthy") for row in tested}
    stats = findings.forward.stats if findings.forward is not None else {}  # as measured (the culprit's are JSON-safe)
    margin = findings.margin
    edge = margin if margin is not None and margin["at_the_edge"] else None
    return VerdictFacts(
        remedies=remedies,
        tested_remedies=findings.remedies,
        culprits_each_fail_alone=findings.bisection.independent_groups > 1,
        trigger_kind=kind,
        reproduced=findings.reproduced,
        trigger_local=trigger.local,
        step=(dump_info or {}).get("step"),
        rank=(dump_info or {}).get("rank"),
        micro_batch=micro_batch,
        num_micro_batches=max(len(session.micro_batches), session.step_micro_batches),
        trigger_value=trigger.value,
        threshold=findings.threshold,
        replayed_value=result.replayed_value(kind, trigger.micro_batch),
        unit_factor=_unit_words(findings, session),
        bitwise=findings.reproduction.fidelity.get("bitwise_equal"),
        replay_device=str(session.device),
        environment_warnings=list(session.warnings),
        phase=Phase.parse(culprit.phase) if culprit.phase else None,
        module=culprit.module,
        op=culprit.op,
        parameter=culprit.parameter,
        optimizer_state=culprit.optimizer_state,
        optimizer_class=findings.optimizer.optimizer_class if findings.optimizer is not None else None,
        norm_eps=_norm_eps(session.model, culprit.module),
        inputs_absmax=stats.get("inputs_absmax"),
        outputs_absmax=stats.get("outputs_absmax"),
        culprit_samples=[r.sample_id for r in blamed],
        culprit_facts=[fact for r in blamed for fact in findings.sample_facts.get(r, [])],
        culprit_subset_size=len(blamed),
        candidates=len(session.sample_refs),
        bisect_runs=findings.bisection.runs,
        all_subsets_fail=findings.bisection.all_failed,
        weights_nonfinite_at_start=bool(findings.weights_nonfinite),
        fp32_reproduces=precision.get("fp32_reproduces"),
        autocast_dtype=precision.get("autocast_dtype") or _code_low_dtype(precision),
        param_dtype=str(session.param_dtype).removeprefix("torch."),
        history_pattern=findings.history.pattern,
        history_signals=list(findings.history.signals),
        per_sample_top=cast("list[dict]", rank_by_loss(findings.per_sample)[:3]) if findings.per_sample else [],
        rng_dependent=rng.get("rng_dependent"),
        rng_seeds_tried=len(rng.get("seeds") or []),
        data_kind=_data_kind(session, blamed),
        run_diverged=findings.history.diverged,
        edge_share=edge["share"] if edge is not None else None,
        edge_excluded=edge["samples_excluded"] if edge is not None else 0,
        corrupted_weights=[c.as_dict() for c in findings.corrupted],
        touching_samples=sorted({r.sample_id for refs in (findings.touching or {}).values() for r in refs}, key=str)
        if findings.touching is not None
        else None,
        samples_failing=_per_sample_failures(findings)[0] if findings.per_sample else None,
        samples_checked=_per_sample_failures(findings)[1],
        exception_type=findings.exception.type
        if findings.exception
        else (findings.reproduction.result.raised or {}).get("type"),
        exception_message=findings.exception.message if findings.exception else None,
        exception_detail=findings.exception.detail if findings.exception else None,
        out_of_memory=findings.sizes is not None,
        size_outliers=[o.as_dict() for o in sizes.outliers] if sizes is not None else [],
        median_size=sizes.median if sizes is not None else None,
        unblamed_group=findings.bisection.unblamed_group,
        history_reading=findings.history.reading.sentences if findings.history.reading.onset is not None else [],
        update_change=lenient_float(trigger.update_change),
        lr=_lr(session),
        record_evidence=[e.words for e in findings.evidence.against] if findings.evidence is not None else [],
        ordinary_record=findings.evidence.ordinary if findings.evidence is not None else None,
        earlier_state=findings.evidence.earlier if findings.evidence is not None else None,
        earlier_state_healthy=findings.evidence.earlier_healthy if findings.evidence is not None else None,
        evidence_set_aside=list(findings.evidence.set_aside) if findings.evidence is not None else [],
        fp32_ran=fp32_ran_words(precision["fp32_ran"]) if precision.get("fp32_ran") else None,
        fp32_unverified=bool(precision.get("fp32_ran")) and not precision["fp32_ran"].get("verified"),
        grad_norm_overflow=findings.norm_overflow,
        shared_ids=[shared_id_words(s) for s in culprit.samples if s.shared_with],
        ids_are_positional=any(s.positional for s in culprit.samples)
        or any(o.ref.micro_batch in session.positional_ids for o in (sizes.outliers if sizes is not None else ())),
        replayed_grad_norm=result.grad_norm,
        recorded_step_loss=_recorded_step_loss(session),
        replayed_step_loss=result.step_loss,
        healthy_grad_norm=findings.history.reading.healthy_grad_norm,
        healthy_loss_ceiling=findings.history.reading.healthy_loss_ceiling,
        healthy_steps=findings.history.reading.healthy_steps,
        sample_grad_norms=_sample_grad_norms(findings.per_sample),
        sample_losses=_sample_losses(findings.per_sample),
        earlier_state_source=findings.earlier_rows.source if findings.earlier_rows is not None else None,
        earlier_sample_grad_norms=_sample_grad_norms(findings.earlier_rows.rows) if findings.earlier_rows else None,
        earlier_sample_losses=_sample_losses(findings.earlier_rows.rows) if findings.earlier_rows else None,
    )


def _recorded_step_loss(session: ReplaySession) -> float | None:
    """The step loss the job recorded, as the replay computes its own (sum of the micro-batch losses / divisor); None
    when a micro-batch's loss was not recorded."""
    losses = [lenient_float(v) for v in session.recorded_losses]
    if not losses or any(v is None for v in losses):
        return None
    return sum(v for v in losses if v is not None) / session.loss_divisor


def _sample_rows(rows: Sequence[Any]) -> list[dict]:
    return [r for r in rows if isinstance(r, dict)]


def _sample_grad_norms(rows: Sequence[Any]) -> list[float] | None:
    """Each sample's own gradient norm from a per-sample table (NaN where its step is non-finite, where the row raised
    or has no norm: verdict_facts.diverged_here reads those with `_sample_losses`); None when the table was not made.
    A row's norm is the gradient of that sample's own loss, not divided by the step's loss_divisor
    (verdict_facts.step_units puts it in the step's units)."""
    kept = _sample_rows(rows)
    if not kept:
        return None
    norms = [
        lenient_float(r.get("grad_norm")) if r.get("finite") is not False and not r.get("error") else None for r in kept
    ]
    return [math.nan if v is None else v for v in norms]


def _sample_losses(rows: Sequence[Any]) -> list[float | None] | None:
    """Each sample's own loss, in the order of `_sample_grad_norms` (None where the row raised or has none)."""
    kept = _sample_rows(rows)
    if not kept:
        return None
    return [None if r.get("error") else lenient_float(r.get("loss")) for r in kept]


def shared_id_words(sample: CulpritSample) -> str:
    """ "'x' (micro-batch 1, sample 3): its ID also names micro-batch 1 samples 1 and 5, which the replay does not
    blame" — why the blocklist leaves that ID out."""
    others = [(int(p["micro_batch"]), int(p["index"])) for p in sample.shared_with or []]
    micro_batch = "?" if sample.micro_batch is None else sample.micro_batch + 1  # counted from 1, as the report does
    return (
        f"{fmt_id(sample.sample_id, 80)} (micro-batch {micro_batch}, sample {sample.index}): its ID also names "
        f"{positions_words(others)}, which the replay does not blame"
    )


def _norm_eps(model: torch.nn.Module | None, name: str | None) -> float | None:
    """The eps of the module `name` of `model` when it has one (LayerNorm / RMSNorm `eps`, Hugging Face's
    `variance_epsilon`); None otherwise."""
    if model is None or not name:
        return None
    try:
        module = model.get_submodule(name)
    except (AttributeError, TypeError):
        return None
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = lenient_float(getattr(module, attr, None))
        if value is not None:
            return value
    return None


def _code_low_dtype(precision: dict) -> str | None:
    """A job that recorded no autocast but whose code computed below fp32 (autocast inside its loss, `.half()`):
    the low dtype it used most (replay/judge/precision.py `code_dtypes`)."""
    seen = {k: v for k, v in (precision.get("code_dtypes") or {}).items() if k in ("float16", "bfloat16")}
    return max(seen, key=seen.__getitem__) if seen else None


def _lr(session: ReplaySession) -> float | None:
    """The step's learning rate: the optimizer's first parameter group."""
    groups = getattr(session.optimizer, "param_groups", None) or []
    return lenient_float(groups[0].get("lr")) if groups and isinstance(groups[0], dict) else None


def _data_kind(session: ReplaySession, blamed: list[SampleRef]) -> str | None:
    """'tokens' or 'float': what the culprit's micro-batch holds (see VerdictFacts.data_kind)."""
    index = blamed[0].micro_batch if blamed else 0
    return batch_data_kind(session.micro_batches[index]) if session.micro_batches else None


def batch_data_kind(batch: Any) -> str | None:
    """'tokens' when the batch holds token ids: integer sequences (a tensor of two dimensions or more, labels aside);
    'float' when it holds floating-point features (images, sensor rows, embeddings), with or without integer class
    labels or indices beside them: text advice (base64, control characters) means nothing for such records."""
    leaves = list(tensor_leaves(batch))
    integers = [(path, t) for path, t in leaves if not t.is_floating_point() and t.dtype != torch.bool]
    if any(t.dim() >= 2 and "label" not in path.lower() for path, t in integers):
        return "tokens"
    if any(t.is_floating_point() for _, t in leaves):
        return "float"
    return "tokens" if integers else None
