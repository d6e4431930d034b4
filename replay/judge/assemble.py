"""The one place the report is assembled: from the replay's Findings to the report (forensics/report/tree.py; schema
forensics-report/1, docs/REPORT_FORMAT.md), including the facts the verdict is decided on.
Writing the report to disk is forensics.report's job."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, cast

import torch

from forensics.report.wording import fp32_ran_words
from forensics.format.jsonio import lenient_float
from forensics.format.batch_tree import tensor_leaves
from forensics.core.kinds import HistoryPattern, Phase, TriggerKind, VerdictKind
from forensics.report.model import schema_for, to_json_safe
from forensics.report.tree import Culprit, Report, TriggerBlock, parse_report
from forensics.replay.culprits.per_sample import rank_by_loss
from forensics.replay.culprits.sample_facts import describe
from forensics.replay.judge.findings import Findings
from forensics.replay.judge.remedies import tested_suggestions
from forensics.replay.judge.verdict import VerdictFacts, decide_verdict
from forensics.replay.load.environment import replay_environment
from forensics.replay.load.session import ReplaySession
from forensics.replay.localize.forward_backward import INPUT_MODULE, ROOT_MODULE
from forensics.replay.run.execute import StepRunner
from forensics.replay.run.units import explaining_factor, recorded_factors


def assemble_report(findings: Findings, runner: StepRunner, dump_info: dict | None, started: float) -> Report:
    """The report of one replay, JSON-safe (non-finite floats as "nan"/"inf")."""
    session = runner.session
    rank = int((dump_info or {}).get("rank") or 0)
    culprit = culprit_block(findings, rank, session.positional_ids)
    fidelity = findings.reproduction.fidelity
    if findings.kind is TriggerKind.NONFINITE_PARAM and findings.optimizer is not None:
        fidelity["optimizer_reproduced"] = True
    verdict = decide_verdict(verdict_facts(findings, session, dump_info, culprit))
    if (
        verdict["kind"] != VerdictKind.EXCEPTION.value
        and findings.evidence is not None
        and not findings.evidence.bad_data
    ):
        for sample in culprit.samples:  # named as the first to cross, not as bad data: no blocklist lists them
            sample.trigger = True
    if findings.remedies:  # a tested fix comes before what is only suggested
        diverged = bool(findings.history.diverged) or findings.history.pattern is HistoryPattern.DIVERGED
        blames = verdict["kind"] in (VerdictKind.BAD_SAMPLE.value, VerdictKind.EXCEPTION.value) or (
            verdict["kind"] == VerdictKind.NUMERICAL_PRECISION.value
            and findings.evidence is not None
            and findings.evidence.bad_data
        )
        first, last = tested_suggestions(
            findings.remedies,
            diverged=diverged,
            blames_data=blames,
            trigger=verdict["kind"] == VerdictKind.TRIGGER_SAMPLE.value,
        )
        verdict["suggestions"] = list(dict.fromkeys(first + verdict["suggestions"] + last))
    if findings.margin is not None and findings.margin["at_the_edge"]:
        verdict["explanation"] = (
            (verdict.get("explanation") or "")
            + (
                f" Without the {findings.margin['samples_excluded']} sample(s) bisection isolated, the rest of the step "
                f"still reaches {100 * findings.margin['share']:.0f} % of fp16's max (65,504): the model's state is at "
                "the edge of fp16, and whichever sample crosses first is not to blame."
            )
        ).strip()
    trigger = findings.trigger
    history = findings.history
    report: dict[str, Any] = {
        "schema": schema_for(verdict["kind"]),
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dump": {
            "num_micro_batches": max(len(session.micro_batches), session.step_micro_batches),
            **(
                dump_info
                or {
                    "path": None,
                    "run_id": None,
                    "step": 0,
                    "rank": rank,
                    "world_size": session.world_size,
                    "missing_ranks": [],
                }
            ),
        },
        "trigger": TriggerBlock.of(trigger).as_dict(),
        "environment": {
            "capture": session.capture_environment,
            "replay": replay_environment(session.device),
            "warnings": list(session.warnings),
        },
        "reproduced": findings.reproduced,
        "fidelity": fidelity,
        "rng": findings.rng,
        "verdict": verdict,
        "culprit": culprit.as_dict(),
        "precision": findings.precision,
        "margin": findings.margin,
        "evidence": findings.evidence.as_dict() if findings.evidence is not None else None,
        "bisection": findings.bisection.block,
        "per_sample": findings.per_sample,
        "per_layer": findings.per_layer,
        "history": history.block,
        "history_pattern": history.pattern.value,
        "timings": {"total_s": round(time.monotonic() - started, 3), "passes": runner.passes},
    }
    if history.signals:
        report["history"]["signals"] = history.signals
    if history.diverged and report["history"] is not None:
        report["history"]["diverged"] = history.diverged
    if history.reading.onset is not None and report["history"] is not None:
        report["history"]["shows"] = history.reading.sentences
    if findings.kind is TriggerKind.EXCEPTION:
        report["exception"] = _exception_block(findings, session)
    if findings.corrupted:
        report["weights"] = _weights_block(findings)
    if findings.remedies:
        report["remedies"] = findings.remedies
    return parse_report(to_json_safe(report))


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
    return [r.get("sample_id") for r in rows if r.get("finite") is False], len(rows)


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


def culprit_block(findings: Findings, rank: int, positional: frozenset[int] = frozenset()) -> Culprit:
    """The report's `culprit` block: the samples, and where the first non-finite value appeared; a sample whose
    ID is only its position in the batch (`positional`: micro-batches recorded without IDs) says so."""
    forward, backward, optimizer = findings.forward, findings.backward, findings.optimizer
    samples = []
    for ref in findings.culprits:
        sample = {"sample_id": ref.sample_id, "micro_batch": ref.micro_batch, "index": ref.index, "rank": rank}
        if ref.micro_batch in positional:
            sample["positional"] = True
        if ref in findings.sample_facts:
            sample["description"] = describe(findings.sample_facts[ref])
        samples.append(sample)
    block: dict[str, Any] = {
        "samples": samples,
        "module": None,
        "op": None,
        "phase": None,
        "parameter": None,
        "optimizer_state": None,
        "stats": {"inputs_absmax": None, "outputs_absmax": None, "params_absmax": None},
        "traceback": None,
    }
    if forward is not None:
        from_data = (forward.module or "").startswith(
            INPUT_MODULE + "."
        )  # a batch field, named in `module`, not a parameter
        block.update(
            module=forward.module,
            op=forward.op,
            phase=Phase.FORWARD,
            stats=dict(forward.stats),
            parameter=forward.nonfinite_inputs[0] if forward.nonfinite_inputs and not from_data else None,
        )
    elif backward is not None:
        block.update(
            module=backward.module,
            op=backward.op,
            phase=Phase.BACKWARD,
            parameter=backward.parameter,
            traceback=backward.traceback,
        )
    elif optimizer is not None:
        block.update(
            phase=Phase.OPTIMIZER,
            parameter=optimizer.parameter,
            optimizer_state=optimizer.optimizer_state,
            module=optimizer.parameter.rpartition(".")[0] or ROOT_MODULE if optimizer.parameter else None,
        )
    if findings.exception is not None:
        block.update(module=findings.exception.module, op=findings.exception.op, phase=findings.exception.phase)
    if findings.weights_nonfinite:  # the weights themselves: name the first broken one
        name = findings.weights_nonfinite[0]
        block["parameter"] = name
        if block["module"] is None:
            block["module"] = name.rpartition(".")[0] or ROOT_MODULE
    if block["phase"] is None:
        block["phase"] = findings.phase
    return Culprit.parse(block)


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


def verdict_facts(findings: Findings, session: ReplaySession, dump_info: dict | None, culprit: Culprit) -> VerdictFacts:
    """What the verdict rules (replay/judge/verdict.py) decide on, read from the typed findings."""
    kind, trigger, result = findings.kind, findings.trigger, findings.reproduction.result
    micro_batch = trigger.micro_batch
    if micro_batch is None and findings.forward is not None:
        micro_batch = findings.forward.micro_batch
    precision = cast("dict[str, Any]", findings.precision or {})  # TypedDicts, read as dicts here
    rng = cast("dict[str, Any]", findings.rng or {})
    sizes = findings.sizes
    tested = cast("dict[str, Any]", findings.remedies or {}).get("tested", [])
    remedies = {row["kind"]: row.get("healthy") for row in tested}
    return VerdictFacts(
        remedies=remedies,
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
        inputs_absmax=culprit.stats.inputs_absmax,
        outputs_absmax=culprit.stats.outputs_absmax,
        culprit_samples=[r.sample_id for r in findings.culprits],
        culprit_facts=[fact for r in findings.culprits for fact in findings.sample_facts.get(r, [])],
        culprit_subset_size=len(findings.culprits),
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
        data_kind=_data_kind(session, findings),
        run_diverged=findings.history.diverged,
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
        fp32_ran=fp32_ran_words(precision["fp32_ran"]) if precision.get("fp32_ran") else None,
        fp32_unverified=bool(precision.get("fp32_ran")) and not precision["fp32_ran"].get("verified"),
        grad_norm_overflow=findings.norm_overflow,
        ids_are_positional=any(s.positional for s in culprit.samples)
        or any(o.ref.micro_batch in session.positional_ids for o in (sizes.outliers if sizes is not None else ())),
    )


def _code_low_dtype(precision: dict) -> str | None:
    """A job that recorded no autocast but whose code computed below fp32 (autocast inside its loss, `.half()`):
    the low dtype it used most (replay/judge/precision.py `code_dtypes`)."""
    seen = {k: v for k, v in (precision.get("code_dtypes") or {}).items() if k in ("float16", "bfloat16")}
    return max(seen, key=seen.__getitem__) if seen else None


def _lr(session: ReplaySession) -> float | None:
    """The step's learning rate: the optimizer's first parameter group."""
    groups = getattr(session.optimizer, "param_groups", None) or []
    return lenient_float(groups[0].get("lr")) if groups and isinstance(groups[0], dict) else None


def _data_kind(session: ReplaySession, findings: Findings) -> str | None:
    """'tokens' or 'float': what the culprit's micro-batch holds (see VerdictFacts.data_kind)."""
    index = findings.culprits[0].micro_batch if findings.culprits else 0
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
