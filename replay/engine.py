"""Orchestrate a replay: load -> reproduce -> localise -> bisect -> precision -> per-sample -> history -> verdict.

`run_replay(dump_or_path, options)` returns the report dict of schema "forensics-report/1"
(/work/notes/REPORT_SCHEMA.md, docs/REPORT_FORMAT.md); writing it to disk is forensics.report's job.
`run_session(session, options)` does the same for a ReplaySession built in memory.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from replay.execute import SampleRef, StepRunner, reproduce
from replay.environment import deterministic_mode, replay_environment
from replay.load import ReplaySession, load_session
from replay.localize import ROOT_MODULE, localize_backward, localize_forward
from replay.localize_update import localize_optimizer, per_layer_stats
from replay.precision import fp32_check

logger = logging.getLogger(__name__)

SCHEMA = "forensics-report/1"
CONFIRM_ROUNDS = 3  # independent culprits looked for before concluding "no sample is to blame"
Progress = Callable[[str], None]


@dataclass
class ReplayOptions:
    """What `run_replay` does and what it may import."""

    device: str | None = None
    """"cuda:0", "cpu"; None: CUDA when present, else CPU."""
    trust: bool = False
    """Import the model factory / loss / optimizer class the dump names (CLI --trust)."""
    factory: str | None = None
    """"module:fn" returning the model, instead of the dump's recipe (CLI --factory)."""
    loss: str | None = None
    """"module:fn" with (model, batch) -> loss, instead of the dump's (CLI --loss)."""
    sys_path: list[str] = field(default_factory=list)
    """Directories put in front of sys.path for the imports above (CLI --path)."""
    rank: int | None = None
    """Rank of a multi-rank step dump; None: the rank whose trigger fired, else the lowest."""
    max_attempts: int = 3
    """Full-step replays before giving up on reproducing (GPU kernels may be non-deterministic)."""
    fp32_check: bool = True
    """Re-run the culprit samples in fp32 to tell precision problems from data / model problems."""
    bisect: bool = True
    """Search for the smallest set of samples that still fails (ddmin)."""
    allow_neg_inf_masks: bool = True
    """-inf made by mask ops (masked_fill / where / full) is not reported as the first bad value."""
    max_per_sample: int = 64
    """At most this many samples get their own loss / grad-norm row (culprits always do)."""
    max_bisect_runs: int | None = 200
    """Hard cap on bisection replays (ddmin is quadratic when samples only fail together)."""
    rng_check: bool = True
    """Once reproduced, re-run the step from a few other seeds (recorded RNG not restored) to tell
    whether the failure needs the dump's random state (a dropout mask); report block `rng`."""

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"ReplayOptions.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_per_sample < 0:
            raise ValueError(f"ReplayOptions.max_per_sample must be >= 0, got {self.max_per_sample}")
        self.sys_path = [str(p) for p in self.sys_path]


def _stage(progress: Progress | None, message: str) -> None:
    logger.info("replay: %s", message)
    if progress is not None:
        try:
            progress(message)
        except Exception:  # noqa: BLE001 - a broken progress callback must not stop the replay
            logger.debug("progress callback failed", exc_info=True)


def run_replay(dump_or_path: Any, options: ReplayOptions | None = None, progress: Progress | None = None) -> dict:
    """Replays a dump's failing step and returns the report dict.

    Args:
        dump_or_path: a forensics.format.Dump, or a path (rank dir, step dir, .tar.zst).
        options: ReplayOptions (device, consent, rank, which analyses run).
        progress: called with a short text before each stage (the CLI prints it).
    Returns:
        The report (schema "forensics-report/1"), JSON-safe (non-finite floats as "nan"/"inf").
    Raises:
        DumpError: the dump is missing / incomplete / tampered.
        RecipeError: the model recipe needs consent (--trust / --factory) or cannot be imported.
        ReplayError: e.g. the device is not available.
    Example:
        >>> report = run_replay("crash_dumps/run/step-000000042", ReplayOptions(device="cpu"))  # doctest: +SKIP
        >>> report["verdict"]["kind"], report["culprit"]["samples"]  # doctest: +SKIP
        ('bad_sample', [{'sample_id': 'doc-17', 'micro_batch': 1, 'index': 2, 'rank': 0}])
    """
    from forensics.format import open_dump, open_step

    options = options or ReplayOptions()
    started = time.monotonic()
    if hasattr(dump_or_path, "manifest"):
        dump, path = dump_or_path, str(getattr(dump_or_path, "path", ""))
    else:
        path = str(dump_or_path)
        _stage(progress, f"opening {path}")
        dump = open_dump(dump_or_path, rank=options.rank)
    missing = list(dump.manifest.get("missing_ranks") or [])
    if not hasattr(dump_or_path, "manifest") and Path(path).is_dir():
        with contextlib.suppress(Exception):  # a rank directory alone: nothing more to learn
            missing = sorted(set(missing) | set(open_step(path)[1]))
    dump_info = {"path": path, "run_id": dump.manifest.get("run_id"), "step": dump.step, "rank": dump.rank,
                 "world_size": dump.world_size, "missing_ranks": missing,
                 "num_micro_batches": dump.num_micro_batches}
    with deterministic_mode(dump.manifest.get("determinism")):
        _stage(progress, f"loading model and step {dump.step} (rank {dump.rank}) on "
                         f"{options.device or 'the default device'}")
        session = load_session(dump, device=options.device, trust=options.trust, factory=options.factory,
                               loss=options.loss, sys_path=options.sys_path)
        return run_session(session, options, progress, dump_info=dump_info, history=dump.history(),
                           started=started)


def run_session(session: ReplaySession, options: ReplayOptions | None = None, progress: Progress | None = None,
                *, dump_info: dict | None = None, history: dict | None = None,
                started: float | None = None) -> dict:
    """The replay pipeline on a ready ReplaySession (in-memory replays and tests; run_replay calls it).

    Returns:
        The report dict (see run_replay).
    """
    options = options or ReplayOptions()
    started = time.monotonic() if started is None else started
    trigger = dict(session.trigger or {})
    kind = trigger.get("kind") or "nonfinite_loss"
    threshold = _float(trigger.get("threshold"))
    rank = int((dump_info or {}).get("rank") or 0)
    runner = StepRunner(session)

    # 1. reproduce ------------------------------------------------------------------------------
    _stage(progress, f"reproducing the step ({len(session.micro_batches)} micro-batch(es), trigger {kind})")
    reproduction = reproduce(runner, options.max_attempts)
    result = reproduction.result
    reproduced = reproduction.reproduced
    optimizer_finding = None
    if kind == "nonfinite_param" and not runner.nonfinite_params:
        _stage(progress, "stepping a fresh copy of the optimizer on the replayed gradients")
        optimizer_finding = localize_optimizer(runner)
        reproduced = optimizer_finding is not None

    # 1b. does the failure need the recorded random state? -------------------------------------
    rng_block = None
    if reproduced and options.rng_check and kind != "nonfinite_param" and not runner.nonfinite_params \
            and optimizer_finding is None:
        if any(state is not None for state in session.rng_states):
            _stage(progress, "re-running the step from other seeds (is the recorded RNG needed?)")
            from replay.rng_dependence import check_rng_dependence

            rng_block = check_rng_dependence(runner, kind, threshold)
        else:
            rng_block = {"checked": False, "seeds": [], "failed": [], "rng_dependent": None}

    # 2. localise -------------------------------------------------------------------------------
    forward = backward = None
    phase = None
    if reproduced:
        if runner.nonfinite_params:
            _stage(progress, f"the pre-step weights are already non-finite ({runner.nonfinite_params[0]} ...)")
        if not result.loss_finite:
            _stage(progress, "localising the first non-finite value in the forward pass")
            forward = localize_forward(runner, allow_neg_inf_masks=options.allow_neg_inf_masks)
            phase = "forward" if forward is not None else None
        elif not result.grads_finite:
            _stage(progress, "localising the first non-finite gradient (anomaly mode)")
            backward = localize_backward(runner)
            phase = "backward" if backward is not None else None
        if optimizer_finding is None and result.loss_finite and result.grads_finite and session.optimizer \
                and not runner.nonfinite_params and kind not in ("loss_spike", "grad_norm_spike"):
            optimizer_finding = localize_optimizer(runner)
        if optimizer_finding is not None and phase is None:
            phase = "optimizer"
    _stage(progress, "per-layer gradient norms and output abs-max")
    per_layer = per_layer_stats(runner)

    # 3. bisect ---------------------------------------------------------------------------------
    refs = session.sample_refs
    bisection = None
    culprits: list[SampleRef] = []
    all_failed = False
    data_independent = kind == "nonfinite_param" or bool(runner.nonfinite_params) or phase == "optimizer"
    if reproduced and options.bisect and not data_independent and refs:
        _stage(progress, f"bisecting {len(refs)} samples")
        culprits, bisection, all_failed = _bisect(runner, refs, kind, threshold, options)
    # 4. precision ------------------------------------------------------------------------------
    precision = None
    if options.fp32_check and reproduced:
        _stage(progress, "re-running in fp32")
        precision = fp32_check(runner, culprits or None, kind=kind, threshold=threshold)
    elif options.fp32_check:
        precision = fp32_check(runner, kind="nonfinite_param")  # dtype facts only, no run
    # 5. per-sample -----------------------------------------------------------------------------
    _stage(progress, "per-sample loss and gradient norm")
    per_sample = _per_sample(runner, refs, culprits, options.max_per_sample)
    # 6. history --------------------------------------------------------------------------------
    history_block, pattern, signals = _history(history)

    # 7. verdict --------------------------------------------------------------------------------
    culprit = _culprit_block(culprits, rank, forward, backward, optimizer_finding, runner)
    if culprit["phase"] is None:
        culprit["phase"] = phase
    fidelity = reproduction.fidelity
    if kind == "nonfinite_param" and optimizer_finding is not None:
        fidelity["optimizer_reproduced"] = True
    facts = _verdict_facts(session, dump_info, trigger, kind, threshold, reproduced, result, fidelity, culprit,
                           bisection, all_failed, precision, optimizer_finding, forward, runner, per_sample,
                           pattern, signals, len(refs), rng_block)
    verdict = _decide(facts)
    report = {
        "schema": SCHEMA,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dump": {"num_micro_batches": len(session.micro_batches),
                 **(dump_info or {"path": None, "run_id": None, "step": 0, "rank": rank,
                                  "world_size": session.world_size, "missing_ranks": []})},
        "trigger": {"kind": kind, "value": trigger.get("value"), "threshold": threshold,
                    "micro_batch": trigger.get("micro_batch"), "detail": trigger.get("detail") or ""},
        "environment": {"capture": session.capture_environment, "replay": replay_environment(session.device),
                        "warnings": list(session.warnings)},
        "reproduced": reproduced,
        "fidelity": fidelity,
        "rng": rng_block,
        "verdict": verdict,
        "culprit": culprit,
        "precision": precision,
        "bisection": bisection,
        "per_sample": per_sample,
        "per_layer": per_layer,
        "history": history_block,
        "history_pattern": pattern,
        "timings": {"total_s": round(time.monotonic() - started, 3), "passes": runner.passes},
    }
    if signals:
        report["history"]["signals"] = signals
    from forensics.report.model import to_json_safe

    return to_json_safe(report)


# --------------------------------------------------------------------------------------------
# stages
# --------------------------------------------------------------------------------------------
def _bisect(runner: StepRunner, refs: list[SampleRef], kind: str, threshold: float | None,
            options: ReplayOptions) -> tuple[list[SampleRef], dict, bool]:
    from replay.bisect import bisect_budget, ddmin

    needs_backward = kind in ("nonfinite_grad", "grad_norm_spike")
    # A NaN/Inf is isolated: the culprit fails on its own. A spike is judged against a threshold set by
    # the whole batch, and a few samples alone are noisier than the batch (the norm of a mean of fewer
    # gradients is larger), so a spike culprit is the smallest set whose REMOVAL ends the spike.
    by_removal = kind in ("loss_spike", "grad_norm_spike")

    def fails(subset: list[SampleRef]) -> bool:
        if by_removal:
            chosen = set(subset)
            rest = [r for r in refs if r not in chosen]
            return not rest or not runner.run(rest, backward=needs_backward).trigger_reproduced(kind, threshold)
        return runner.run(subset, backward=needs_backward).trigger_reproduced(kind, threshold)

    def run_fails(subset: list[SampleRef]) -> bool:
        return runner.run(subset, backward=needs_backward).trigger_reproduced(kind, threshold)

    if len(refs) == 1:
        return list(refs), {"runs": 0, "candidates": 1, "culprit_size": 1, "budget": bisect_budget(1),
                            "confirmed": None, "test": "isolation"}, False
    outcome = ddmin(refs, fails, max_runs=options.max_bisect_runs)
    runs, culprits, confirmed = outcome.runs, [] if outcome.all_failed else list(outcome.culprits), None
    groups = 1
    if culprits and not by_removal:
        # Confirm: without the culprits the step must pass. Several samples may each fail alone; look
        # for up to CONFIRM_ROUNDS of them. More than that, or a micro-batch where any sample fails
        # (a dropout mask, a broken buffer), is no sample's fault.
        for _ in range(CONFIRM_ROUNDS):
            rest = [r for r in refs if r not in set(culprits)]
            runs += 1
            if not rest or not run_fails(rest):
                confirmed = True
                break
            more = ddmin(rest, fails, max_runs=options.max_bisect_runs)
            runs += more.runs
            if more.all_failed:
                break
            culprits += [r for r in more.culprits if r not in set(culprits)]
            groups += 1
        if not confirmed:
            logger.info("the step still fails without samples %s: no sample is to blame",
                        [r.sample_id for r in culprits])
            confirmed, culprits = False, []
    block = {"runs": runs, "candidates": len(refs), "culprit_size": len(culprits),
             "budget": outcome.budget, "all_subsets_fail": outcome.all_failed, "minimal": outcome.minimal,
             "test": "removal" if by_removal else "isolation", "confirmed": confirmed,
             "independent_groups": groups if culprits else 0}
    return culprits, block, outcome.all_failed


def _per_sample(runner: StepRunner, refs: list[SampleRef], culprits: list[SampleRef], limit: int) -> list[dict]:
    from replay.per_sample import per_sample_stats
    from replay.samples import select_samples

    if not refs or limit <= 0:
        return []
    chosen = list(culprits[:limit])
    chosen += [r for r in refs if r not in chosen][:max(0, limit - len(chosen))]
    chosen.sort(key=lambda r: (r.micro_batch, r.index))
    session, model = runner.session, runner.model

    def run_one(ref: SampleRef) -> torch.Tensor:
        batch = select_samples(session.micro_batches[ref.micro_batch], [ref.index])
        with runner.autocast_context():
            return session.loss_fn(model, batch)

    def before_each(ref: SampleRef) -> None:
        runner.restore_rng(ref.micro_batch)

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        with runner.autocast_context():
            return session.loss_fn(m, batch)

    runner.reset()
    model.train()
    try:
        return per_sample_stats(model, chosen, run_one, before_each=before_each,
                                batches=session.micro_batches, loss_fn=loss_fn)
    finally:
        runner.reset()


def _history(history: dict | None) -> tuple[dict | None, str, list[str]]:
    from replay.history_pattern import classify_history, history_signals

    if not history:
        return None, "insufficient_history", []
    block = {"step": list(history.get("step") or []), "loss": list(history.get("loss") or []),
             "grad_norm": list(history.get("grad_norm") or [])}
    try:
        signals = history_signals(history)
    except Exception:  # noqa: BLE001 - signals are an extra; never fail the replay on them
        logger.warning("history signals failed", exc_info=True)
        signals = []
    return block, classify_history(block["loss"]), signals


def _culprit_block(culprits: list[SampleRef], rank: int, forward, backward, optimizer, runner: StepRunner) -> dict:
    block = {"samples": [{"sample_id": r.sample_id, "micro_batch": r.micro_batch, "index": r.index, "rank": rank}
                         for r in culprits],
             "module": None, "op": None, "phase": None, "parameter": None, "optimizer_state": None,
             "stats": {"inputs_absmax": None, "outputs_absmax": None, "params_absmax": None},
             "traceback": None}
    if forward is not None:
        block.update(module=forward.module, op=forward.op, phase="forward", stats=dict(forward.stats),
                     parameter=forward.nonfinite_inputs[0] if forward.nonfinite_inputs else None)
    elif backward is not None:
        block.update(module=backward.module, op=backward.op, phase="backward", parameter=backward.parameter,
                     traceback=backward.traceback)
    elif optimizer is not None:
        block.update(phase="optimizer", parameter=optimizer.parameter, optimizer_state=optimizer.optimizer_state,
                     module=optimizer.parameter.rpartition(".")[0] or ROOT_MODULE if optimizer.parameter else None)
    if runner.nonfinite_params:  # the weights themselves: name the first broken one
        name = runner.nonfinite_params[0]
        block["parameter"] = name
        if block["module"] is None:
            block["module"] = name.rpartition(".")[0] or ROOT_MODULE
    return block


def _verdict_facts(session: ReplaySession, dump_info: dict | None, trigger: dict, kind: str,
                   threshold: float | None, reproduced: bool, result, fidelity: dict, culprit: dict,
                   bisection: dict | None, all_failed: bool, precision: dict | None, optimizer, forward,
                   runner: StepRunner, per_sample: list[dict], pattern: str, signals: list[str],
                   candidates: int, rng_block: dict | None = None):
    from replay.per_sample import rank_by_loss
    from replay.verdict import VerdictFacts

    if kind in ("nonfinite_grad", "grad_norm_spike"):
        replayed_value = result.grad_norm
    elif kind == "nonfinite_loss":
        index = trigger.get("micro_batch")
        replayed_value = result.losses[index] if isinstance(index, int) and index < len(result.losses) \
            else result.step_loss
    elif kind == "loss_spike":
        replayed_value = result.step_loss
    else:
        replayed_value = None
    micro_batch = trigger.get("micro_batch")
    if micro_batch is None and forward is not None:
        micro_batch = forward.micro_batch
    stats = culprit.get("stats") or {}
    return VerdictFacts(
        culprits_each_fail_alone=(bisection or {}).get("independent_groups", 0) > 1,
        trigger_kind=kind, reproduced=reproduced, trigger_local=trigger.get("local", True) is not False,
        step=(dump_info or {}).get("step"), rank=(dump_info or {}).get("rank"),
        micro_batch=micro_batch, num_micro_batches=len(session.micro_batches),
        trigger_value=_float(trigger.get("value")), threshold=threshold, replayed_value=replayed_value,
        bitwise=fidelity.get("bitwise_equal"), replay_device=str(session.device),
        environment_warnings=[w for w in session.warnings],
        phase=culprit.get("phase"), module=culprit.get("module"), op=culprit.get("op"),
        parameter=culprit.get("parameter"), optimizer_state=culprit.get("optimizer_state"),
        optimizer_class=optimizer.optimizer_class if optimizer is not None else None,
        inputs_absmax=stats.get("inputs_absmax"), outputs_absmax=stats.get("outputs_absmax"),
        culprit_samples=[s["sample_id"] for s in culprit["samples"]],
        culprit_subset_size=len(culprit["samples"]), candidates=candidates,
        bisect_runs=(bisection or {}).get("runs"), all_subsets_fail=all_failed,
        weights_nonfinite_at_start=bool(runner.nonfinite_params),
        fp32_reproduces=(precision or {}).get("fp32_reproduces"),
        autocast_dtype=(precision or {}).get("autocast_dtype"),
        param_dtype=str(session.param_dtype).removeprefix("torch."),
        history_pattern=pattern, history_signals=list(signals),
        per_sample_top=rank_by_loss(per_sample)[:3] if per_sample else [],
        rng_dependent=(rng_block or {}).get("rng_dependent"),
        rng_seeds_tried=len((rng_block or {}).get("seeds") or []))


def _decide(facts) -> dict:
    from replay.verdict import decide_verdict

    return decide_verdict(facts)


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


__all__ = ["ReplayOptions", "run_replay", "run_session", "SCHEMA", "CONFIRM_ROUNDS"]
