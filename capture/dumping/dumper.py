"""The Guard's dump path: one `Incident` in, one dump directory out (within the run's caps).

`Dumper.dump(incident)` asks the run's dump budgets (capture/dumping/budget.py: the crash's own reserve, the
spike dumps kept, min_spike_gap), collects the pre-step
state from the state source (`StateSource.collect`) (or takes the one the Incident already holds), builds the
manifest (docs/DUMP_FORMAT.md), and writes — in the background for a spike the job goes on after. A step
whose CUDA context is unusable gets what the host still holds. Everything about the step comes from the
Incident; the rest is what the Dumper is built from (configuration, state source, recorders), never the Guard.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable

import torch

from forensics.capture.config import DumpConfig
from forensics.capture.dumping import deadline, destination, environment
from forensics.capture.dumping.budget import Admission, DumpBudget, spike_size
from forensics.capture.dumping.main_script import MainScript
from forensics.capture.dumping.signals import deferred_termination
from forensics.capture.dumping.uploads import send_dump
from forensics.capture.dumping.writer_thread import BackgroundWriter
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident, json_ids, leading_dim
from forensics.capture.recording.run_log import RunLog
from forensics.capture.recording.window import FlightRecorder
from forensics.capture.state import buddy, snapshot
from forensics.capture.state.host_snapshots import HostSnapshots
from forensics.capture.state.recipe import replay_needs
from forensics.capture.state.source import StateSource
from forensics.core.errors import CaptureError
from forensics.format.batch_tree import map_tensors
from forensics.format.location import Location
from forensics.format.run_log import EventKind
from forensics.format.sample_ids import written_ids
from forensics.format.writer import DumpContent, dump_path, remove_rank_dump
from forensics.core.kinds import Policy, TriggerKind
from forensics.recipes import default_loss
from forensics.core.rng import capture_rng, restore_rng
from forensics.core.trigger import Trigger

log = logging.getLogger(__name__)


class Dumper:
    """Writes the dumps of one Guard and keeps their outcome (`dumps`, `errors`).

    Args:
        dumping: GuardConfig.dumping; dump_dir: reads GuardConfig.dump_dir (at each dump: the job may change it).
        run_id: the run's dump folder.
        state: the state source: the objects whose state is dumped, the state, recipe and distribution.
        history, window, snapshots: the recorders whose contents go into every dump.
        budget: the run's dump budgets (shared with the sync-free check, which asks it before a step is applied).
        sample_id_key: GuardConfig.recording.sample_id_key (the in-job re-check reads the batch's IDs with it).
        max_grad_norm: GuardConfig.detection.max_grad_norm (the flight recorder's clip, in the manifest's window).
        run_log: GuardConfig.recording.run_log (write the run log beside the dumps).
        on_device_lost: called when a dump finds the CUDA context unusable (sync_free's buffers are then never
            reused).
    """

    def __init__(
        self,
        dumping: DumpConfig,
        dump_dir: Callable[[], str],
        run_id: str,
        state: StateSource,
        history: History,
        window: FlightRecorder,
        snapshots: HostSnapshots,
        budget: DumpBudget,
        *,
        sample_id_key: str,
        max_grad_norm: float | None,
        run_log: bool,
        on_device_lost: Callable[[], None] = lambda: None,
    ):
        self.dumping, self.dump_dir, self.run_id, self.state = dumping, dump_dir, run_id, state
        self.sample_id_key, self.max_grad_norm = sample_id_key, max_grad_norm
        self._root = (dump_dir(), destination.dump_root(dump_dir(), dumping))  # ValueError: unusable
        self.history, self.window, self.snapshots = history, window, snapshots
        self.on_device_lost = on_device_lost
        recipe = state.recipe()
        self.script = MainScript(recipe)
        """The training script's source, for a recipe naming a function of it (capture/dumping/main_script.py)."""
        self.needs = replay_needs(
            state.model, recipe, dumping.recipe, self.script.name if self.script.source is not None else None
        )
        """What a replay of this job's dumps needs beyond the dump (--trust, --factory, --loss)."""
        needs = self.needs.words()
        if needs and state.ranks.rank == 0:  # said now, at the start of the job, not when a dump is made
            log.warning("forensics: %s", needs)
        environment.environment()  # versions, git commit: read now, not while a fault is being dumped
        self.dumps: list[Location] = []
        self.errors: list[str] = []
        self.last_incident_step: int | None = None  # the last step reported (report), dumped or not
        self.last_dumped_step: int | None = None  # the last step report() was let dump
        self.budget = budget
        """The run's dump budgets (capture/dumping/budget.py): a place is taken when a dump starts (background writes land
        later), identically on every rank; one process gives it back when its write fails."""
        self._writer = BackgroundWriter(self._store)
        self.run_log = (
            RunLog(self.root, run_id, state.ranks.rank, state.ranks.world_size, self._writer.call) if run_log else None
        )
        """Every step's scalars (from the history) and every trigger and dump outcome (capture/recording/run_log.py),
        beside the dumps (the fallback directory when the store does not answer)."""
        if self.run_log is not None:
            history.listener = self.run_log.step

    @property
    def root(self) -> Location:
        """Where the dumps go: dump_dir, checked when the Guard is built (capture/dumping/destination.py: ValueError
        for one that can never work) and again when the job changes it, or DumpConfig.fallback_dir when its store
        does not answer."""
        dump_dir = self.dump_dir()
        if self._root[0] != dump_dir:
            self._root = (dump_dir, destination.dump_root(dump_dir, self.dumping))
        return self._root[1]

    def admit(self, incident: Incident) -> Admission:
        """Whether the budget lets the incident be dumped; one that is not is counted (and logged once per
        window: dump_budget.NotDumped)."""
        trigger = incident.trigger
        if incident.undumpable is not None:  # counted unless 'raise' stops the job, which says why itself
            undumpable = incident.undumpable
            if incident.policy is not Policy.RAISE:
                self.not_dumped(trigger, incident.step, undumpable.why, undumpable.reason)
            return Admission(undumpable.error, undumpable.reason)
        try:
            admission = self.budget.admit(trigger.kind, incident.step, trigger.value, trigger.threshold)
        except Exception as exc:  # never decides the policy: the Guard applies it whatever this says
            log.exception("forensics: the dump budget failed for step %d", incident.step)
            return Admission(f"no dump written: the dump budget failed ({type(exc).__name__})", "error")
        if admission.why_not is not None:
            self.not_dumped(trigger, incident.step, admission.why_not, admission.reason)
        return admission

    def report(self, incident: Incident) -> tuple[Location | None, str | None]:
        """An incident the Guard reports (its policy is the Guard's to apply), dumped within the budgets and logged
        when it is. Notes its step as `last_incident_step`, and as `last_dumped_step` when the budget admits it (a
        precursor dumps neither step: it waits for the next)."""
        self.last_incident_step = incident.step
        admission = self.admit(incident)  # one not dumped is counted and logged once per window there
        # a step the budget does not dump is counted and logged once per window by the budget (docs/GUIDE.md
        # "Dump budgets"): never a line per step, whatever the policy; 'raise' says it in its error
        if incident.undumpable is None and admission.why_not is None:
            rank, trigger = self.state.ranks.rank, incident.trigger
            log.warning(
                "forensics: step %d rank %d: %s (policy: %s)", incident.step, rank, trigger.message, incident.policy
            )
        dumped = self.dump(incident, admission)
        if admission.why_not is None:
            self.last_dumped_step = incident.step
        return dumped

    def reported(self, step: int) -> bool:
        """The last incident reported (report) was of `step`."""
        return self.last_incident_step == step

    def dumped(self, step: int) -> bool:
        """The last incident report() was let dump was of `step`."""
        return self.last_dumped_step == step

    def not_dumped(self, trigger: Trigger, step: int, why: str, reason: str) -> None:
        """Counts a trigger at `step` that is not dumped because `why` (`reason`: its key in the manifest's
        `dump_budget.not_dumped`); logged once, then once per window with a count (dump_budget.NotDumped)."""
        size = spike_size(trigger.value, trigger.threshold) if trigger.kind.spike else None
        self.budget.not_dumped.note(trigger.kind, step, why, reason, trigger.message, size)

    def dump(self, incident: Incident, admission: Admission | None = None) -> tuple[Location | None, str | None]:
        """Dumps the incident unless its budget says no (`admission`: admit()'s answer, asked now when None).
        Returns (path, None) or (None, why there is no dump). Never raises: what the Guard then does to the step
        (its policy) must not depend on whether the dump could be written."""
        try:
            admission = self.admit(incident) if admission is None else admission
            if admission.why_not is not None:
                self._log_trigger(incident, None, admission.why_not)
                return None, admission.why_not
            background = (
                incident.trigger.kind.spike and incident.policy is Policy.CONTINUE and self.dumping.background_write
            )
            with deferred_termination():
                outcome = self._write(incident, admission, background=background)
            self._log_trigger(incident, outcome[0], outcome[1])
            if background:
                self._writer.hook_sigterm()
            return outcome
        except Exception as exc:  # a fault inside forensics: logged, and the policy still applies
            log.exception("forensics: dumping step %d failed inside forensics", incident.step)
            why = f"no dump written: forensics failed ({type(exc).__name__}: {str(exc)[:300]})"
            self.errors.append(why)
            return None, why

    def _log_trigger(self, incident: Incident, path: Location | None, why_not: str | None) -> None:
        """The trigger's outcome in the run log; a failure there is logged and never reaches the step."""
        if self.run_log is None:
            return
        try:
            self.run_log.trigger(incident, path is not None, why_not)
        except Exception:
            log.exception("forensics: the run log could not note step %d's trigger", incident.step)

    def _store(self, content: DumpContent, root: Location) -> Location:
        """Writes one dump; to object storage under the stall deadline (capture/dumping/deadline.py)."""
        return deadline.store(content, root, self.dumping.write_stall_timeout)

    def join(self, timeout: float | None = None) -> None:
        """Waits for the background writes (Guard.close()) and logs what was not dumped since the last line."""
        self._writer.join(timeout)
        self.budget.not_dumped.flush()
        if self.run_log is not None:
            self.run_log.close(self.budget.manifest())

    def _write(self, incident: Incident, admission: Admission, background: bool) -> tuple[Location | None, str | None]:
        kind = incident.trigger.kind
        written = functools.partial(self._written, admission=admission, step=incident.step)
        failed = functools.partial(self._failed, kind=kind, admission=admission, step=incident.step)
        unusable = (
            "the CUDA context is unusable after a CUDA error" if (incident.exception or {}).get("cuda_error") else None
        )
        try:
            content = (
                self._host_content(incident, unusable, device_usable=False)
                if unusable
                else self._content(incident, background)
            )
        except Exception as exc:  # noqa: BLE001
            unusable = f"collecting the state failed ({type(exc).__name__}: {str(exc)[:300]})"
            content = self._host_content(incident, unusable) if incident.exception is not None else None
        if content is None:
            failed(f"no dump written: {unusable}")
            return None, f"no dump written: {unusable}"
        if background:
            path = self._writer.submit(content, self.root, written, failed)
            return path, None
        try:
            path = self._store(content, self.root)
        except CaptureError as exc:
            failed(str(exc))
            return None, str(exc)
        written(path)
        return path, None

    def _written(self, path: Location, admission: Admission | None = None, step: int | None = None) -> None:
        dumping = self.dumping
        self.dumps.append(path)
        if self.run_log is not None and step is not None:
            self.run_log.event(EventKind.DUMP_WRITTEN, step)
        log.warning("forensics: dump written to %s — replay it with: %s", path, self.needs.command(path))
        if admission is not None and admission.replaces is not None:
            self._remove_spike_dump(admission.replaces.step, path)
        if dumping.upload:
            send_dump(path, dumping.upload, dumping.tensorboard_dir)
        if dumping.on_dump is not None:
            try:
                dumping.on_dump(path)
            except Exception:  # the user's hook must not stop the job either
                log.exception("forensics: GuardConfig.dumping.on_dump raised for %s", path)

    def _failed(
        self,
        message: str,
        kind: TriggerKind | None = None,
        admission: Admission | None = None,
        step: int | None = None,
    ) -> None:
        if self.run_log is not None and step is not None:
            self.run_log.event(EventKind.DUMP_FAILED, step, error=message[:500])
        if kind is not None and admission is not None:  # several ranks: the attempt counts (dump_budget)
            self.budget.failed(kind, admission, self.state.ranks.multi_rank)
        self.errors.append(message)
        log.error("forensics: %s", message)

    def _remove_spike_dump(self, step: int, larger: Location) -> None:
        """Deletes this rank's spike dump of `step`, replaced by the larger one at `larger`, with its packed archive,
        and the step directory once no rank's dump is left in it. After the writes queued before it (the
        old dump may still be in the background writer's queue). Never raises."""
        old = dump_path(self.root, self.run_id, step, self.state.ranks.rank)

        def remove() -> None:
            try:
                remove_rank_dump(old)
                if old in self.dumps:
                    self.dumps.remove(old)
                log.warning(
                    "forensics: spike dump of step %d deleted: replaced by the larger spike at %s "
                    "(GuardConfig.dumping.max_spike_dumps keeps the first and the largest)",
                    step,
                    larger,
                )
            except Exception as exc:  # noqa: BLE001 - a dump left on disk costs space, never the job
                log.error("forensics: could not delete the replaced spike dump %s: %s", old, exc)

        self._writer.after_queued(remove)

    def _content(self, incident: Incident, background: bool) -> DumpContent:
        source = self.state
        copy = snapshot.HostCopy(enabled=background)
        state = incident.state if incident.state is not None else source.collect(copy)
        batches = [copy_tree(b, copy) for b in incident.record.batches]
        if incident.state is not None:  # collected earlier, live tensors: fence their devices too
            copy.cover(state)
        for group, hyper in zip(state["optimizer"]["param_groups"], incident.hyper or ()):
            group.update({k: snapshot.plain(v) for k, v in hyper.items()})  # the step's, saved at its check
        copy.finish()
        manifest = self._manifest(incident)
        held, release = self._lend_snapshot(incident.step, manifest) if "layout" not in state else (None, None)
        content = DumpContent(
            manifest=manifest,
            snapshot=held,
            done=release,
            model=state["model"],
            optimizer=state["optimizer"],
            rng=list(incident.record.rng),
            micro_batches=batches,
            history=self.history.to_dict(),
            scheduler=incident.scheduler or snapshot.scheduler_state(source.scheduler),
            scaler=snapshot.scaler_state(source.scaler),
            layout=state.get("layout"),
            copies=self._buddy_copies(state, incident),
            extra_files={**self._extra_files(incident.step), **incident.files},
        )
        content.ready = copy.wait  # the writer waits for the device copies before touching them
        return content

    def _extra_files(self, step: int) -> dict[str, bytes]:
        """The flight recorder's files and the training script's source (when the recipe names it)."""
        return {**self.window.files(step), **self.script.files()}

    def _buddy_copies(self, state: dict, incident: Incident) -> list:
        """Sharded layout with GuardConfig.dumping.shard_replicas >= 2: the shards only other ranks hold, received from
        them (capture/state/buddy.py) — only in a dump every rank makes, before any rank writes."""
        ranks, replicas = self.state.ranks, self.dumping.shard_replicas
        if "layout" not in state or replicas < 2 or not incident.agreed:
            return []
        return buddy.exchange(buddy.sole_shards(state), ranks.rank, ranks.world_size, replicas)

    def _lend_snapshot(self, step: int, manifest: dict, device_usable: bool = True) -> tuple[dict | None, Any]:
        """The oldest host snapshot the flight recorder covers for a dump of `step` (noted in its manifest), and
        the function that gives it back once the dump is written; (None, None) when there is none."""
        earlier = self.window.steps_before(step)
        held, release = self.snapshots.lend_oldest(earlier[0], device_usable) if earlier else (None, None)
        if held is not None:
            manifest["snapshot"] = {"step": held["step"]}
        return held, release

    def _host_content(self, incident: Incident, why: str, device_usable: bool = True) -> DumpContent | None:
        """A step that raised and left the state unreadable (a CUDA error kills the context): what the host still
        holds — sample IDs, host-side batch tensors, RNG, history, the flight recorder, the optimizer's class and
        hyper-parameters and the last host snapshot — with `state_missing` saying why the rest is absent. None
        when even that fails."""
        source = self.state
        try:
            manifest = self._manifest(incident)
            manifest["state_missing"] = why
            held, release = self._lend_snapshot(incident.step, manifest, device_usable)
            if not device_usable:
                self.on_device_lost()
            try:
                scheduler = incident.scheduler or snapshot.scheduler_state(source.scheduler)
            except Exception:  # noqa: BLE001 - a scheduler state on the device
                scheduler = None
            log.error(
                "forensics: step %d: %s; writing what the host holds (no pre-step state%s)",
                incident.step,
                why,
                f"; the host snapshot of step {held['step']}" if held else "",
            )
            return DumpContent(
                manifest=manifest,
                model={},
                optimizer=snapshot.optimizer_hyper(source.optimizer, source.model),
                rng=list(incident.record.rng),
                micro_batches=[snapshot.host_only(b) for b in incident.record.batches],
                history=self.history.to_dict(),
                scheduler=scheduler,
                snapshot=held,
                done=release,
                extra_files={**self._extra_files(incident.step), **incident.files},
            )
        except Exception:  # the job is failing already
            log.exception("forensics: even the host-side dump of step %d failed", incident.step)
            return None

    def _manifest(self, incident: Incident) -> dict:
        source, dumping, ranks = self.state, self.dumping, self.state.ranks
        record, losses, step = incident.record, incident.losses, incident.step
        micro_batches = []
        for index, batch in enumerate(record.batches):
            recorded = json_ids(record.sample_ids[index])
            size = leading_dim(batch) or (len(recorded) if recorded else None)
            ids, positional = written_ids(recorded, step, index, size, ranks.rank)
            micro_batches.append(
                {
                    "index": index,
                    "sample_ids": ids,
                    "batch_size": size,
                    "loss": losses[index] if index < len(losses) else None,
                    "ids_are_positional": positional,
                }
            )
        param = next(iter(source.model.parameters()), None)
        manifest = {
            "run_id": self.run_id,
            "trigger": incident.trigger.as_dict(),
            "step": step,
            "rank": ranks.rank,
            "world_size": ranks.world_size,
            "local_rank": ranks.local_rank,
            "grad_accum": incident.accumulation or len(record.batches),
            "micro_batches": micro_batches,
            "loss": {
                "per_micro_batch": losses,
                "divisor": incident.divisor,
                "grad_norm": incident.grad_norm,
                "grad_norm_unscaled_by": incident.grad_norm_unscaled_by,
                "step_loss": incident.step_loss,
            },
            "precision": {
                "param_dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
                "autocast": record.autocast or {"enabled": False, "device_type": None, "dtype": None},
                "grad_scaler": _scaler_state(source.scaler),
                **({"fsdp": source.fsdp_units} if source.fsdp_units else {}),
            },
            "determinism": environment.determinism_flags(),
            "environment": environment.environment(),
            "recipe": self.script.describe(source.recipe()),
            "recheck": recheck(source.model, source.loss_fn, self.sample_id_key, incident)
            if dumping.recheck
            else {"performed": False},
            "missing_ranks": [],
            "dump_budget": self.budget.manifest(),
        }
        window = self.window.steps_before(step)
        if window:
            manifest["window"] = {
                "first_step": window[0],
                "last_step": window[-1],
                "steps": len(window),
                "max_grad_norm": self.max_grad_norm,
            }
        if dumping.data_recipe:
            manifest["data_recipe"] = dict(dumping.data_recipe)
        distribution = source.distribution()
        if distribution is not None:
            manifest["distributed"] = distribution
        if incident.exception is not None:
            manifest["exception"] = incident.exception
        return manifest


def copy_tree(node: Any, copy: snapshot.HostCopy) -> Any:
    """The batch tree with every tensor passed through `copy` (`forensics.format.batch_tree.map_tensors`)."""
    return map_tensors(node, copy)


def _scaler_state(scaler: Any) -> dict | None:
    try:
        return snapshot.scaler_state(scaler)
    except Exception:  # noqa: BLE001 - its scale lives on a device that may be unusable (a CUDA error)
        return None


def recheck(model: torch.nn.Module, loss_fn: Callable | None, sample_id_key: str, incident: Incident) -> dict:
    """Megatron-style in-job re-check (GuardConfig.dumping.recheck): recompute the failing micro-batch's loss with its
    RNG; `loss_fn` None: the default loss, which drops the batch's `sample_id_key`."""
    record, index = incident.record, incident.trigger.micro_batch
    if index is None or index >= len(record.batches) or incident.exception:
        return {"performed": False}
    saved = capture_rng()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]  # BatchNorm stats move in a forward
    try:
        restore_rng(record.rng[index])
        autocast = record.autocast or {}
        with (
            torch.no_grad(),
            torch.autocast(
                autocast.get("device_type") or "cpu",
                dtype=getattr(torch, autocast.get("dtype") or "bfloat16"),
                enabled=bool(autocast.get("enabled")),
            ),
        ):
            if loss_fn is not None:
                value = float(loss_fn(model, record.batches[index]))
            else:
                value = float(default_loss(model, record.batches[index], [sample_id_key]))
    except Exception as exc:  # noqa: BLE001
        return {"performed": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        restore_rng(saved)
        with torch.no_grad():
            for buffer, kept in buffers:
                buffer.copy_(kept)
    original = incident.losses[index]
    same = (value == original) or (not math.isfinite(value) and not math.isfinite(original))
    return {
        "performed": True,
        "micro_batch": index,
        "original": original,
        "recomputed": value,
        "reproduced": bool(
            same
            or (
                math.isfinite(value)
                and math.isfinite(original)
                and abs(value - original) <= 1e-3 * max(1.0, abs(original))
            )
        ),
    }
