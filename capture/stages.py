"""The Guard's stages, built from their inputs and wired to one another; none of them holds the Guard.

`build` makes them in the order they hook the model and the optimizer: the recorders (history, flight recorder, host
snapshots), the precursor monitor, the step check, the Dumper (its budgets shared with the sync-free check), the step
recorder, the optimizer's step hooks, the loop's calls to check() (recording/misuse.CheckCalls), the silent-corruption
watch and the update check. What they report goes to `report` (the Guard's `handle_incident`), their hooks to
`add_hook` (the Guard removes them at close()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from forensics.capture import silent
from forensics.capture.config import GuardConfig
from forensics.capture.detection.step import StepCheck
from forensics.capture.detection.update import UpdateCheck
from forensics.capture.dumping.budget import DumpBudget
from forensics.capture.dumping.dumper import Dumper
from forensics.capture.precursors import monitor
from forensics.capture.raised.optimizer_steps import OptimizerSteps
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident
from forensics.capture.recording.misuse import CheckCalls
from forensics.capture.recording.recorder import StepRecorder
from forensics.capture.recording.window import FlightRecorder
from forensics.capture.silent import SilentWatch
from forensics.capture.state.host_snapshots import HostSnapshots
from forensics.capture.state.source import StateSource


@dataclass
class Stages:
    """What the Guard runs (docs/ARCHITECTURE.md, "Capture")."""

    history: History
    window: FlightRecorder  # the flight recorder (capture/recording/window.py)
    snapshots: HostSnapshots
    precursors: monitor.PrecursorMonitor | None
    checks: StepCheck
    dumper: Dumper
    recorder: StepRecorder
    optimizer_steps: OptimizerSteps  # stepped since the last check()?
    calls: CheckCalls  # the first check()'s warnings, a check() misplaced or repeated
    silent: SilentWatch | None


def build(
    state: StateSource,
    wrapped: torch.nn.Module,
    run_id: str,
    report: Callable[[Incident], bool],
    add_hook: Callable[[Any], None],
    step: Callable[[], int],
) -> Stages:
    """The stages of a Guard on the state source's model (`wrapped`: as the loop calls it), optimizer, scaler, loss
    function, ranks and configuration.

    Args:
        report: the Guard's handle_incident (the precursor monitor's and the update check's incidents go to it).
        add_hook: keeps a removable hook handle.
        step: the Guard's step counter (the update check reads the step checked last: the one before).
    """
    model, optimizer, scaler, loss_fn, ranks = state.model, state.optimizer, state.scaler, state.loss_fn, state.ranks
    config: GuardConfig = state.config
    history = History(config.recording.history_size)
    window = FlightRecorder(config.recording.window_steps)
    snapshots = HostSnapshots(config.recording.snapshot_every, config.recording.snapshot_count)
    precursors = monitor.attach(
        model,
        optimizer,
        scaler,
        config.precursors,
        window=window,
        sync_free=config.detection.sync_free is True,
        add_hook=add_hook,
    )  # or None
    budget = DumpBudget(config.dumping)  # shared: the sync-free check asks it before a step is applied
    checks = StepCheck(config, state, history, window, snapshots, precursors, budget.spike_floor, add_hook)
    dumper = Dumper(
        config.dumping,
        lambda: config.dump_dir,  # the job may change it (read at each dump)
        run_id,
        state,
        history,
        window,
        snapshots,
        budget,
        sample_id_key=config.recording.sample_id_key,
        max_grad_norm=config.detection.max_grad_norm,
        run_log=config.recording.run_log,
        on_device_lost=checks.device_lost,
    )
    recorder = StepRecorder(config.recording.sample_id_key, state.buffers.take_before_forward)
    add_hook(model.register_forward_pre_hook(recorder.note_autocast))
    optimizer_steps = OptimizerSteps(optimizer, add_hook)
    calls = CheckCalls(model, config.recording.sample_id_key, type(state).grad_norm is StateSource.grad_norm)
    watch = silent.attach(model, wrapped, optimizer, scaler, loss_fn, config, ranks, add_hook)  # or None
    if config.detection.verify_update:
        UpdateCheck(config.detection, state, history, lambda: (step() - 1, calls.last_step), report, add_hook)
    return Stages(history, window, snapshots, precursors, checks, dumper, recorder, optimizer_steps, calls, watch)
