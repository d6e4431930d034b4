"""Run, streamed: the StepRunner of a model whose blocks stay in the dump (ReplaySession.stream).

replay/load/stream_plan.py left each block parameter as a one-element placeholder; replay/run/stream_blocks.py
materialises the blocks a few at a time while a pass runs and recomputes each for its backward. `StreamedStepRunner`
runs the same passes as the StepRunner over such a model, so every stage of the engine runs through it unchanged,
except where a stage reads gradients or weights itself (`gradients`, `gradient_names`, `own_grad_norms`,
`clip_gradients`, `keeping_gradients`; the engine's per-sample rows: `per_sample_rows`), which it answers block by
block. `runner_for(session)` picks the runner a session needs.

Fewer walks over the blocks (replay/run/lockstep.py): the per-sample rows' one-sample passes run together, their
forwards block by block and their backwards in one engine call (`run_with_backwards`), in groups whose kept
activations fit (`joint_group_size`: measured per sample in the forwards, `_forward_scope`; the room is half the
plan's share for activations, or what a pass already kept at once and ran through), each pass's gradients outside
the blocks measured and freed as its backward makes them (`_measure_resident`: one pass's on the device, not one per
pass); and a pass of several micro-batches with a backward runs them together (`_micro_batch_loop`, `_run_group`):
2 walks instead of 2 a micro-batch, their gradients summed on the device in the order the micro-batches run one after
another (stream_blocks.MicroBatchFold), taken off once. Both stay bitwise what running them one after another gives;
a group that runs out of memory runs again in halves (then alone); where equality cannot be shown (anomaly mode,
per-micro-batch hooks, no recorded RNG, a step that raised, a parameter outside the blocks used inside them, a forward
writing the model's buffers, a block run twice in one micro-batch, an autocast the code enters in the fp32 re-run)
one after another. The stage log
and the report's `stream.joint_groups` say the groups and why, `stream.joint_backward_errors` what raised.

Why not FSDP2 on a world of one with CPUOffloadPolicy: it keeps the whole sharded model (and its gradients) in
pinned host memory, a second host copy of the model, which the dump already is; torch.utils.checkpoint alone cannot
materialise weights inside its recomputation nor say when a block's backward is over.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import gc
import itertools
import logging
import math
import weakref
from typing import Any, Callable, ContextManager, Iterator, Sequence, TypeVar

import torch

from forensics.core.errors import ReplayError, is_out_of_memory
from forensics.core.grad_norm import total_grad_norm
from forensics.core.sizes import words
from forensics.core.thirdparty import foreach_norm
from forensics.replay.load.fsdp_precision import fsdp_compute, parameter_units
from forensics.replay.load.samples import SampleRef
from forensics.replay.load.session import ReplaySession
from forensics.replay.load.stream_plan import ACTIVATION_SHARE
from forensics.replay.run.execute import NonfiniteNames, StepRunner, any_nonfinite, nonfinite_flag
from forensics.replay.run.fp32 import autocasts_entered_disabled, held_to_fp32_in_thread
from forensics.replay.run.lockstep import Lockstep
from forensics.replay.run.stream_blocks import BlockStreamer, MicroBatchFold, PassGradStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

STREAMED_PER_SAMPLE = 8
"""Streamed, each per-sample row is a pass of its own (run together with the others, a micro-batch's worth at a
time): culprits and at most this many rows."""


class StreamedStepRunner(StepRunner):
    """The StepRunner of a streamed session (ReplaySession.stream): the same passes, the blocks materialised a few at
    a time; the stages' own reads of gradients go through `gradients` / `own_grad_norms` / `clip_gradients`."""

    def __init__(self, session: ReplaySession):
        if session.stream is None or session.pre_step_weights is None:
            raise ReplayError("a streamed replay needs a session loaded from a dump with a stream plan")
        self.session, self.model, self.plan = session, session.model, session.stream
        for module in self.model.modules():  # a KV cache (Hugging Face) would grow again in each recomputation
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "use_cache", False):
                config.use_cache = False
        self.streamer = BlockStreamer(self.model, self.plan, session.pre_step_weights, session.device)
        self.streamer.install()
        self._streamed = set(self.streamer.params)
        self._reload = session.pre_step_weights
        self._initial = None
        self.param_names = [n for n, _ in self.model.named_parameters()]
        self._dtypes = {n: t.dtype for n, t in self._live_tensors()}
        resident = [(n, p) for n, p in self.model.named_parameters() if n not in self._streamed]
        flags = dict(zip([n for n, _ in resident], any_nonfinite(p.detach() for _, p in resident)))
        bad = set(self.plan.nonfinite) | {n for n, f in flags.items() if f}
        self.nonfinite_params = [n for n in self.param_names if n in bad]
        self.passes = 0
        self.lockstep_waits = 0
        self.joint_backwards = 0
        self.joint_groups: list[str] = []
        """How the passes run together were grouped, and why (the plan's room for activations against a pass's,
        a group split after it ran out of memory), for the stage log and the report's `stream` block."""
        self._notes_said = 0
        self.sample_activation_bytes = 0
        self._fp32_sample_bytes = 0
        """The same in the fp32 re-run's forwards."""
        self.held_activation_bytes = 0
        """The most activation bytes a pass (or the passes and micro-batches of a group) kept at once and ran
        through within the budget (measured): a group keeping no more fits as that one did."""
        self._group_forwards: list[int] | None = None
        """The most bytes a micro-batch's forward kept for its backward per sample (measured: `_forward_scope`),
        the weights outside the blocks not counted: what sizes the groups of passes run together."""
        self._measured: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        """While passes with a backward run together: each pass's gradients outside the blocks, measured (norm, a
        non-finite flag on the device) and freed as soon as its backward made them (`_measure_resident`)."""
        self._scales: dict[int, torch.Tensor | None] = {}
        self._joint_cap: int | None = None
        self._micro_cap: int | None = None
        """At most this many micro-batches of a pass run together (a group of twice as many ran out of memory)."""
        self._micro_together = False
        self._one_after_another = False
        self._apart: set[str] = set()
        """Passes whose micro-batches run one after another for good, a group having told why ("every pass": a
        block ran twice in a micro-batch's forward; "fp32": the fp32 re-run's code entered an autocast)."""
        self._writes_buffers = False
        inside = {id(p) for module in self.streamer.modules for p in module.parameters()}
        self._tied_into_blocks = any(
            id(p) in inside and p.requires_grad for n, p in self.model.named_parameters() if n not in self._streamed
        )
        self.last_joint_error: BaseException | None = None
        self.joint_backward_errors: list[str] = []
        """Why an engine call of several passes' backwards raised (the passes then ran alone): the first three, each
        its exception's type and repr-quoted message, cut (a GPU run's stage log says why the schedule fell back)."""
        self._resident_units: dict[str, Any] = {}
        """While passes with a backward run together under FSDP2 mixed precision: each parameter outside the blocks
        that its unit casts -> the unit (`_cast_resident_grads`)."""
        """Engine calls that ran the backwards of several passes together (run_with_backwards)."""
        self._fsdp_users = 0
        self._together = False
        self._fsdp_exit = contextlib.ExitStack()
        """Times a pass run block-major waited for a block (run_forwards)."""
        self._untouched = session.loaded_weights
        self._warned_autocast = False
        self._warned_unrunnable = False
        self.last_grad_norm: float | None = None
        self._last = 0
        self._keep_next = False
        self._wanted = False
        weakref.finalize(self, self.streamer.remove)

    def close(self) -> None:
        """Puts the blocks' own forwards back and frees what the streamer holds."""
        self.streamer.remove()

    block_major = True

    def run_forwards(self, jobs: list[Callable[[], T]]) -> list[T]:
        """The jobs' forward-only passes (in the job's precision, not fp32) together, each block materialised once for
        all of them (replay/run/lockstep.py). The weights are put back once, before the first: a buffer a forward
        writes (BatchNorm's running statistics, which a forward in train mode does not read) is shared."""
        if len(jobs) < 2:
            return [job() for job in jobs]
        lockstep = Lockstep(self.session.device)
        self.reset()  # once for all: a pass's own reset would undo the compute dtypes of the passes under way
        self.streamer.lockstep, self._together = lockstep, True
        try:
            with self.job_precision():  # entered once for all (each pass's own enter and exit only count)
                return lockstep.run(jobs)
        finally:
            self.streamer.lockstep, self._together = None, False
            self.lockstep_waits += lockstep.waits

    def run_with_backwards(self, jobs: Sequence[Callable[[], T]]) -> list[T] | None:
        """The jobs' passes, each ONE micro-batch with its backward and no kept gradients (the per-sample rows),
        together: their forwards block-major, then one engine call for all their backwards, each block materialised
        once for all of them (replay/run/lockstep.py); each pass keeps its own gradients (`_PassStates`): the blocks'
        measured as each block's backward ends, those outside the blocks as soon as the pass's backward made them
        (`_measure_resident`: one pass's worth on the device at a time, not one per pass). None when they must run
        alone or in smaller groups: fewer than two, or the engine call (or a pass, out of memory) raised; its error
        is no one pass's (`last_joint_error`: the caller splits the group on running out of memory, else runs the
        passes alone, and tells what those runs tell). FSDP2 mixed precision: set up once for all (run_forwards), so
        each pass's gradients outside the blocks are cast as its own precision context's end would cast them
        (`_resident_units`)."""
        self.last_joint_error = None
        if len(jobs) < 2:
            return None
        units = parameter_units(self.model, self.session.fsdp_units) if self.session.fsdp_units else {}
        self._resident_units = {
            n: units[id(p)]
            for n, p in self.model.named_parameters()
            if n not in self._streamed and id(p) in units and p.is_floating_point()
        }
        warnings = list(self.session.warnings)
        switch = _PassStates(self, len(jobs))
        lockstep = Lockstep(self.session.device, switch)
        self.reset()  # once for all, as run_forwards
        self.streamer.lockstep, self.streamer.as_pass, self._together = lockstep, switch.during, True
        raised: BaseException | None = None
        kept: list[int] = []
        self._group_forwards = kept
        try:
            with self.job_precision():
                results = lockstep.run(jobs, grad=True)
        except Exception as exc:  # out of memory in a pass's forward: the group's, not the pass's
            if not out_of_memory(exc):
                raise
            raised = exc
        finally:
            self.streamer.lockstep, self.streamer.as_pass, self._together = None, None, False
            self._group_forwards = None
            self._resident_units = {}
            self._measured.clear()
            self._scales.clear()
            switch.close()
            self.lockstep_waits += lockstep.waits
            self.joint_backwards += lockstep.backwards
        error = lockstep.backward_error or raised
        if error is not None:
            self.session.warnings[:] = warnings
            _forget(raised, lockstep.backward_error)
            self.last_joint_error = error
            if len(self.joint_backward_errors) < 3:
                self.joint_backward_errors.append(f"{type(error).__name__}: {str(error)[:300]!r}")
                logger.info("passes run together fell back: %s", self.joint_backward_errors[-1])
            return None
        self.held_activation_bytes = max(self.held_activation_bytes, sum(kept))
        return results

    def _measure_resident(self, number: int, name: str, leaf: torch.Tensor) -> None:
        """Pass `number`'s gradient of `name` (a parameter outside the blocks, on the pass's own leaf), as its
        backward accumulated it: measured as `_measured_grads` measures it (cast as FSDP2's end of the pass casts
        it, unscaled, its norm and non-finite flag) and freed. A second gradient of one leaf in one backward (a
        loss that runs a backward of its own) cannot be measured so: the engine call fails, the passes run alone."""
        measured = self._measured.setdefault(number, {})
        if name in measured:
            raise RuntimeError(f"a second gradient of {name!r} in one backward: the passes run alone")
        grad = leaf.grad
        if grad is None:
            return
        unit, master = self._resident_units.get(name), self._dtypes.get(name)
        if unit is not None and master is not None and unit.param_dtype not in (None, master):
            grad = grad.to(unit.reduce_dtype or master).to(master)
        scale = self._scales.get(number)
        if scale is not None:
            grad = grad * scale.double().reciprocal().float().to(grad.device)  # GradScaler.unscale_, as alone
        measured[name] = (foreach_norm([grad], 2.0)[0], nonfinite_flag(grad))  # no sync inside the engine's call
        leaf.grad = None

    def _backward(self, scaled: torch.Tensor) -> None:
        if self.streamer.lockstep is not None:  # run together: one engine call for every pass (lockstep.backward)
            self.streamer.lockstep.backward(scaled)
        else:
            scaled.backward()

    # -- the base runner's state, without the streamed parameters --------------------------------
    def _live_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in super()._live_tensors() if n not in self._streamed]

    def _stale(self, live: dict[str, torch.Tensor]) -> set[str]:
        return super()._stale({k: v for k, v in live.items() if k not in self._streamed})

    def reset(self) -> None:
        if self._together:  # passes run together start from the state run_forwards put back once
            return
        self.streamer.fp32 = False
        super().reset()
        self.streamer.new_pass(keep=self._keep_next)

    def _start_pass(self, fp32: bool) -> None:
        super()._start_pass(fp32)
        self.streamer.fp32 = fp32

    def job_precision(self, fp32: bool = False) -> ContextManager:
        if fp32 or not self.session.fsdp_units:
            return contextlib.nullcontext()
        return self._shared_fsdp()

    @contextlib.contextmanager
    def _shared_fsdp(self) -> Iterator[None]:
        """`_streamed_fsdp`, set up by the first of the passes run together (run_forwards) to enter and torn down by
        the last to leave: each enters and leaves at its own time, while the others are still computing."""
        if self._fsdp_users == 0:
            self._fsdp_exit.enter_context(self._streamed_fsdp())
        self._fsdp_users += 1
        try:
            yield
        finally:
            self._fsdp_users -= 1
            if self._fsdp_users == 0:
                self._fsdp_exit.close()

    @contextlib.contextmanager
    def _streamed_fsdp(self) -> Iterator[None]:
        """FSDP2's mixed precision with the blocks cast as they are materialised (replay/load/fsdp_precision.py)."""
        units = parameter_units(self.model, self.session.fsdp_units)
        streamer = self.streamer
        for name, param in streamer.params.items():
            unit = units.get(id(param))
            if unit is not None and unit.param_dtype is not None and param.is_floating_point():
                streamer.unit_dtype[name] = unit.param_dtype
                streamer.reduce_dtype[name] = unit.reduce_dtype
        try:
            with fsdp_compute(self.model, self.session.fsdp_units, skip={id(p) for p in streamer.params.values()}):
                yield
        finally:
            streamer.unit_dtype.clear()
            streamer.reduce_dtype.clear()

    # -- a pass ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def keeping_gradients(self) -> Iterator[None]:
        self._wanted = True
        try:
            yield
        finally:
            self._wanted = False

    def run(self, samples: list[SampleRef] | None = None, **kwargs: Any):
        # kept gradients (a pass's worth of bytes written to the host) only for a caller that steps the optimizer
        self._keep_next = bool(kwargs.get("keep_grads")) and self._wanted  # the base run() resets first
        session = self.session
        try:
            while True:
                said, warned = list(session.warnings), (self._warned_unrunnable, self._warned_autocast)
                try:
                    result = super().run(samples, **kwargs)
                    break
                except _OneAfterAnother as redo:  # the pass again from the start (run() resets), as told
                    session.warnings[:] = said
                    self._warned_unrunnable, self._warned_autocast = warned
                    self.joint_groups.append(f"{redo.size} micro-batches: {redo.why}")
                    if redo.out_of_memory and redo.size > 2:
                        self._micro_cap = redo.size // 2
                    else:
                        self._micro_cap = 1 if redo.out_of_memory else self._micro_cap
                        self._one_after_another = not redo.out_of_memory
                    if redo.lasting is not None:  # the later passes it holds for: not tried together again
                        self._apart.add(redo.lasting)
                _free_failed_group()  # (outside the handler: `redo`'s traceback held the group's frames)
        finally:
            self._keep_next = False
            self._one_after_another = False
        self.last_grad_norm = result.grad_norm
        return result

    def _run_micro_batches(self, selected, scale, options):
        self._last = max(selected) if selected else len(self.session.micro_batches) - 1
        self.streamer.inv_scale = None if scale is None else scale.double().reciprocal().float()
        self.streamer.scan_only = not options.backward
        if self._together and self.streamer.pass_number is not None:
            self._scales[self.streamer.pass_number] = scale  # what `_measure_resident` unscales by
        return super()._run_micro_batches(selected, scale, options)

    @contextlib.contextmanager
    def _forward_scope(self, micro_batch: int, indices: list[int] | None) -> Iterator[None]:
        """Counts the bytes the forward keeps for its backward (each storage once; the model's weights and buffers
        not counted), per sample of the micro-batch: `sample_activation_bytes`, which sizes the groups of passes
        run together. The hook hands autograd a detached view of what it saves (the same storage: nothing copied;
        an output saved as itself would hold its own graph in a cycle)."""
        weights = {_storage_key(t)[0] for t in itertools.chain(self.model.parameters(), self.model.buffers())}
        seen: set[int] = set()
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            key, size = _storage_key(tensor)
            if key not in weights and key not in seen:
                seen.add(key)
                total += size
            return tensor.detach()

        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _unpacked))
            except RuntimeError:  # saved-tensor hooks disabled here (torch.autograd.graph.disable_saved_tensors_hooks)
                total = -1
            yield
        if total < 0:
            return
        samples = len(indices) if indices is not None else self._samples_in(micro_batch)
        per = -(-total // max(1, samples))
        if self.streamer.fp32:
            self._fp32_sample_bytes = max(self._fp32_sample_bytes, per)
        else:
            self.sample_activation_bytes = max(self.sample_activation_bytes, per)
        if self._group_forwards is not None:  # kept together with the group's other forwards until their backwards
            self._group_forwards.append(total)
        else:  # one micro-batch's, freed by its backward before the next forward
            self.held_activation_bytes = max(self.held_activation_bytes, total)

    def _samples_in(self, micro_batch: int) -> int:
        return sum(1 for ref in self.session.sample_refs if ref.micro_batch == micro_batch)

    def autocast_context(self, fp32: bool = False) -> ContextManager:
        if fp32 and self._micro_together:  # the process-wide part is the group's (_run_group)
            return held_to_fp32_in_thread(self.fp32_count)
        return super().autocast_context(fp32)

    def _raises(self, exc: Exception) -> bool:
        return (self._together or self._micro_together) and out_of_memory(exc)

    def _run_micro_batch(self, i, indices, scale, options, done) -> bool:
        self.streamer.final = i == self._last
        return super()._run_micro_batch(i, indices, scale, options, done)

    # -- micro-batches of one pass, block-major ----------------------------------------------------
    def _micro_batch_loop(self, selected, scale, options, done) -> None:
        """The pass's micro-batches in groups run together (`_run_group`: their forwards block by block, then their
        backwards in one engine call, each block's gradients summed on the device in the micro-batch order): two
        walks over the blocks a group instead of two a micro-batch, and no gradient off the device and back between
        them. One after another where the schedule cannot be shown to give the same numbers (`_micro_batch_group`)."""
        count = len(self.session.micro_batches)
        chosen = [i for i in range(count) if selected is None or i in selected]
        size, why = self._micro_batch_group(chosen, selected, options)
        if size < 2:
            super()._micro_batch_loop(selected, scale, options, done)
            return
        self.joint_groups.append(f"{size} micro-batches of {len(chosen)} ({why})")
        at = 0
        for start in range(0, len(chosen), size):
            group = chosen[start : start + size]
            done.losses.extend([None] * (group[0] - at))  # the micro-batches not selected
            at = group[-1] + 1
            if len(group) == 1:
                if not self._run_micro_batch(
                    group[0], None if selected is None else selected[group[0]], scale, options, done
                ):
                    return
                continue
            outcomes = self._run_group(group, selected, scale, options, final=group[-1] == self._last)
            done.losses.extend(o.losses[0] for o in outcomes)
        done.losses.extend([None] * (count - at))

    def activation_room(self) -> tuple[int, str]:
        """Bytes a group's kept activations may take, and whence: half the plan's share of the budget for
        activations (the other half for the block that computes and the gradients it makes), or what a pass or group
        kept at once and ran through already, if more (every pass keeps a whole micro-batch's)."""
        planned = int(self.plan.budget * ACTIVATION_SHARE / 2)
        if self.held_activation_bytes > planned:
            return self.held_activation_bytes, f"{words(self.held_activation_bytes)} kept at once by a pass that ran"
        return planned, f"room for activations {words(planned)}"

    def _micro_batch_group(self, chosen: list[int], selected, options) -> tuple[int, str]:
        """How many of the pass's micro-batches run together, and why: as many as their kept activations
        (`sample_activation_bytes` a sample) fit in the room for them; all of them while nothing was measured (the first
        pass: a group that runs out of memory runs the pass again in halves); never more than such a split left. One
        (one after another) where the schedule could compute something else: a pass without a backward (those run
        block-major as passes: run_forwards), in anomaly mode, with per-micro-batch hooks, without each micro-batch's
        recorded RNG (the next one's RNG is the last one's end), a step that raised, a parameter outside the blocks used
        inside them (its gradient is summed across blocks within a micro-batch), or a model that wrote its buffers in an
        earlier such pass. The activation room: `activation_room`."""
        session, streamer = self.session, self.streamer
        states = session.rng_states
        if (
            len(chosen) < 2
            or not self.block_major
            or self._together
            or self._one_after_another
            or "every pass" in self._apart
            or (options.fp32 and "fp32" in self._apart)
            or self._micro_cap == 1
            or self._writes_buffers
            or self._tied_into_blocks
            or not options.backward
            or options.anomaly
            or not options.restore_rng
            or options.forward_context is not None
            or options.on_loss is not None
            or session.exception is not None
            or streamer.recompute_context is not None
            or streamer.after_recompute is not None
            or any(i >= len(states) or states[i] is None for i in chosen)
        ):
            return 1, "one after another"
        room, whence = self.activation_room()
        samples = max(len(selected[i]) if selected is not None else self._samples_in(i) for i in chosen)
        sample = self.sample_activation_bytes
        if options.fp32:  # what an fp32 pass kept, else twice a pass in the job's precision (bf16: half the bytes)
            sample = self._fp32_sample_bytes or 2 * sample
        per = sample * max(1, samples)
        if per > 0:
            size, why = int(room // per), f"{whence}, {words(per)} a micro-batch"
        else:
            size, why = len(chosen), "nothing measured yet: all of them"
        if self._micro_cap is not None and size > self._micro_cap:
            size, why = self._micro_cap, f"{why}; at most {self._micro_cap} since a group ran out of memory"
        return min(size, len(chosen)), why

    def _run_group(self, group: list[int], selected, scale, options, final: bool) -> list:
        """Micro-batches `group` of the pass, together (replay/run/lockstep.py): each on leaves of its own for the
        parameters outside the blocks, their gradients and each block's summed in the micro-batch order
        (stream_blocks.MicroBatchFold), the blocks' measured (`final`: the pass's last micro-batch is in the group) or
        held off the device once. Each micro-batch's outcome; raises _OneAfterAnother where the group could have
        computed something else than the micro-batches one after another (or ran out of memory)."""
        from forensics.replay.run.execute import _PassOutcome

        streamer = self.streamer
        fold = MicroBatchFold(len(group), final)
        switch = _MicroBatchLeaves(self, fold)
        lockstep = Lockstep(self.session.device, switch)
        outcomes = [_PassOutcome() for _ in group]
        versions = [b._version for b in self.model.buffers()]
        jobs = [
            functools.partial(
                self._run_micro_batch, i, None if selected is None else selected[i], scale, options, outcomes[k]
            )
            for k, i in enumerate(group)
        ]
        streamer.lockstep, streamer.as_pass, streamer.fold, self._micro_together = lockstep, switch.during, fold, True
        raised: BaseException | None = None
        kept: list[int] = []
        self._group_forwards = kept
        # the fp32 re-run: the process-wide part of its hold entered once for the group, each micro-batch entering its
        # thread's own (autocast_context); an autocast the code enters while it is held (in a forward, or in a
        # recomputation, which one micro-batch alone runs after its hold) makes the group's numbers unsure
        hold = autocasts_entered_disabled(self.fp32_count) if options.fp32 else contextlib.nullcontext()
        autocasts = self.fp32_count.held_autocasts if options.fp32 else 0  # (a pass in fp32 made its count)
        try:
            with hold:
                ran = lockstep.run(jobs, grad=torch.is_grad_enabled())
        except Exception as exc:  # out of memory in a micro-batch's forward: the group's
            if not out_of_memory(exc):
                raise
            raised, ran = exc, []
        finally:
            streamer.lockstep, streamer.as_pass, streamer.fold, self._micro_together = None, None, None, False
            self._group_forwards = None
            switch.close()
            self.lockstep_waits += lockstep.waits
            self.joint_backwards += lockstep.backwards
        error = raised or lockstep.backward_error
        if error is not None:
            kind, oom = type(error).__name__, out_of_memory(error)
            if len(self.joint_backward_errors) < 3:
                self.joint_backward_errors.append(f"{kind}: {str(error)[:300]!r}")
            _forget(raised, lockstep.backward_error)
            error = raised = lockstep.backward_error = None
            if oom:
                raise _OneAfterAnother(len(group), f"ran out of memory ({kind})", True)
            raise _OneAfterAnother(len(group), f"the engine call raised {kind}: one after another")
        if fold.unsure:
            why = "a block ran twice in one micro-batch's forward: one after another"
            raise _OneAfterAnother(len(group), why, lasting="every pass")
        if options.fp32 and self.fp32_count.held_autocasts != autocasts:
            why = "the fp32 re-run held an autocast the code entered: one after another"
            raise _OneAfterAnother(len(group), why, lasting="fp32")
        if versions != [b._version for b in self.model.buffers()]:
            self._writes_buffers = True
            raise _OneAfterAnother(len(group), "the forwards wrote the model's buffers: one after another")
        if not all(ran) or any(o.raised is not None or o.error is not None for o in outcomes):
            raise _OneAfterAnother(len(group), "a micro-batch stopped the pass: one after another")
        self.held_activation_bytes = max(self.held_activation_bytes, sum(kept))
        params = dict(self.model.named_parameters())

        def held(name: str) -> torch.Tensor | None:
            return streamer._held_on_device(name) if name in self._streamed else params[name].grad

        for name, grad in fold.rest(held).items():  # the parameters outside the blocks, summed in order
            if name not in self._streamed:
                params[name].grad = grad
            elif final:
                streamer._finish(name, grad)
            else:
                streamer.grads.put(name, grad)
        return outcomes

    def _measured_grads(self, scale, backward):
        streamer = self.streamer
        streamer.finish_pass()
        if self._together:  # FSDP2's end of a pass run alone: gradients reduced in reduce_dtype onto the master dtype
            self._cast_resident_grads()
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None and n not in self._streamed}
        measured = self._measured.get(streamer.pass_number, {}) if self._together else {}
        if scale is not None:
            inv = scale.double().reciprocal().float()
            with torch.no_grad():
                for g in grads.values():
                    g.mul_(inv.to(g.device))
        if not (backward and (grads or streamer.norms or measured)):
            return None, []
        # each tensor's norm on its own, as `_measure_resident` takes it while passes run together
        resident = {n: foreach_norm([g], 2.0)[0] for n, g in grads.items()}
        flags = dict(zip(grads, any_nonfinite(grads.values())))
        measured_bad = NonfiniteNames()  # read with the streamed ones' flags, once
        for name, (_, flag) in measured.items():
            measured_bad.add_flag(name, flag)
        norms, bad = [], []
        for name in self.param_names:
            if name in streamer.norms:
                norms.append(streamer.norms[name][0])
                if name in streamer.nonfinite:
                    bad.append(name)
            elif name in measured:
                norms.append(measured[name][0])
                if name in measured_bad:
                    bad.append(name)
            elif name in resident:
                norms.append(resident[name])
                if flags[name]:
                    bad.append(name)
        norm = total_grad_norm(norms)
        return (float(norm) if norm is not None else None), bad

    def _cast_resident_grads(self) -> None:
        """What fsdp_compute's exit does to each gradient outside the blocks (replay/load/fsdp_precision.py), for a
        pass run together with others, whose shared precision context ends only after the last of them."""
        for name, param in self.model.named_parameters():
            unit = self._resident_units.get(name)
            master = self._dtypes.get(name)
            if unit is None or param.grad is None or master is None or unit.param_dtype in (None, master):
                continue
            grad = param.grad.to(unit.reduce_dtype or master).to(master)
            # the pass's own leaf back in the master dtype, as the exit puts the master weights back (its values are
            # not read again: the pass is over and its leaf goes with it), so that it takes a gradient of that dtype
            param.grad = None
            param.data = param.data.to(master)
            param.grad = grad

    # -- what the stages read themselves ---------------------------------------------------------
    def own_grad_norms(self, module: torch.nn.Module) -> list[torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = []
        for param in module.parameters(recurse=False):
            name = names.get(id(param))
            if name in self.streamer.norms:
                out.append(self.streamer.norms[name][1])
            elif param.grad is not None:
                out.append(torch.linalg.vector_norm(param.grad.float()))
        return out

    def gradient_names(self) -> list[str]:
        kept = self.streamer.grads.kept
        return [
            n for n, p in self.model.named_parameters() if ((n in kept) if n in self._streamed else p.grad is not None)
        ]

    def gradients(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Each parameter holding a gradient, its block materialised and its kept gradient on the device while the
        caller holds it (until the next one)."""
        streamer = self.streamer
        for name, param in list(self.model.named_parameters()):
            if name not in self._streamed:
                if param.grad is not None:
                    yield name, param
                continue
            held = streamer.grads.get(name) if name in streamer.grads.kept else None
            if held is None:
                continue
            streamer.direction = 1
            streamer.acquire(streamer.block_of[name])
            grad = held.to(param.device, dtype=param.dtype, copy=True)  # the caller may scale it in place
            if streamer.grad_factor != 1.0:
                grad.mul_(streamer.grad_factor)
            param.grad = grad
            try:
                yield name, param
            finally:
                param.grad = None

    def clip_gradients(self, max_norm: float) -> None:
        """clip_grad_norm_ over the whole model: the resident gradients scaled now, the streamed ones as they are
        handed out (`gradients`)."""
        total = self.last_grad_norm
        if total is None:
            return
        coef = min(1.0, float(max_norm) / (total + 1e-6))
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name not in self._streamed and param.grad is not None:
                    param.grad.mul_(coef)
        self.streamer.grad_factor = coef

    def per_sample_rows(self, refs: list[SampleRef]) -> list[dict]:
        """Each sample's loss and gradient norm alone (the sample's own loss, not divided): one pass per sample,
        run together (run_with_backwards) in groups whose kept activations fit the plan's room for them
        (`joint_group_size`); a group that runs out of memory runs again as two halves (then alone), and the groups
        after it are no larger than the halves."""
        if not self.block_major:  # the schedule before issue 53: one pass after another
            alone = [self._sample_row(ref, self.run([ref])) for ref in refs]
            self.reset()
            return alone
        rows: list[dict | None] = [None] * len(refs)
        queue: list[tuple[list[int], str]] = []
        start = 0
        while start < len(refs) or queue:
            if not queue:
                size, why = self.joint_group_size(len(refs) - start)
                queue.append((list(range(start, start + size)), why))
                start += size
            group, why = queue.pop(0)
            jobs = [functools.partial(self.run, [refs[i]]) for i in group]
            results = self.run_with_backwards(jobs)  # None for a group of one (its last_joint_error reset)
            error = self.last_joint_error
            if error is not None:
                _free_failed_group()
            if results is None and error is not None and out_of_memory(error) and len(group) > 1:
                half = (len(group) + 1) // 2
                self._joint_cap = half
                self.joint_groups.append(
                    f"{len(group)} ({why}) ran out of memory ({type(error).__name__}): again as {half} + "
                    f"{len(group) - half}"
                )
                split = "halves of a group that ran out of memory"
                queue[:0] = [(group[:half], split), (group[half:], split)]
                continue
            if results is None:
                if error is not None:
                    why = f"alone: the group of {len(group)} raised {type(error).__name__}"
                results = [job() for job in jobs]
            else:
                self.last_grad_norm = results[-1].grad_norm  # as after the last pass run alone
            self.joint_groups.append(f"{len(group)} ({why})")
            for i, result in zip(group, results):
                rows[i] = self._sample_row(refs[i], result)
        self.reset()
        return [row for row in rows if row is not None]

    def joint_group_size(self, remaining: int) -> tuple[int, str]:
        """How many of `remaining` one-sample passes run together, and why: as many as their kept activations
        (`sample_activation_bytes`, measured in the forwards so far) fit in half the plan's share of the budget
        for activations (the other half for the block that computes and the gradients it makes), never more than a
        group that ran out of memory was split into; a micro-batch's samples while nothing was measured."""
        room, whence = self.activation_room()
        per = self.sample_activation_bytes
        if per > 0:
            size = int(room // per)
            why = f"{whence}, {words(per)} a pass"
        else:
            size = max(2, self._samples_per_micro_batch())
            why = "a micro-batch's samples: no forward measured yet"
        if self._joint_cap is not None and size > self._joint_cap:
            size, why = self._joint_cap, f"{why}; at most {self._joint_cap}, a group that ran out of memory split"
        return max(1, min(size, remaining)), why

    def _samples_per_micro_batch(self) -> int:
        counts: dict[int, int] = {}
        for ref in self.session.sample_refs:
            counts[ref.micro_batch] = counts.get(ref.micro_batch, 0) + 1
        return max(counts.values(), default=1)

    def _sample_row(self, ref: SampleRef, result: Any) -> dict:
        loss = result.losses[ref.micro_batch] if ref.micro_batch < len(result.losses) else None
        norm = None if result.grad_norm is None else result.grad_norm * self.session.loss_divisor
        if result.raised is not None:
            return {
                "sample_id": ref.sample_id,
                "micro_batch": ref.micro_batch,
                "index": ref.index,
                "loss": None,
                "grad_norm": None,
                "finite": False,
                "error": f"{result.raised['type']}: {result.raised['message']}",
            }
        finite = loss is not None and math.isfinite(loss) and (norm is None or math.isfinite(norm))
        return {
            "sample_id": ref.sample_id,
            "micro_batch": ref.micro_batch,
            "index": ref.index,
            "loss": loss,
            "grad_norm": norm,
            "finite": finite,
        }

    def traffic(self) -> dict[str, int]:
        """What the replay moved so far: passes, block reads (from the dump or the host cache), bytes read from the
        dump (the load's read of every block included) and copied host to device, and the floor (each block once)."""
        reader, load = self.streamer.reader, self.plan.streamed_bytes
        cuda = self.session.device.type == "cuda"
        return {
            "passes": self.passes,
            "walks": self.streamer.walks,
            "block_reads": reader.reads,
            "block_reads_from_storage": reader.storage_reads,
            "bytes_from_storage": load + reader.storage_bytes,
            "bytes_host_to_device": (load if cuda else 0) + reader.host_to_device_bytes,
            "bytes_floor": load,
        }

    def metered(self, progress: Callable[[str], None] | None) -> Callable[[str], None] | None:
        """`progress` with a line before each stage's saying what the stage before it did: passes, walks over the
        blocks, block reads, bytes moved; nothing moved is said too (a stage that reads what another pass measured).
        stream_plan's lines and other indented ones pass through."""
        if progress is None:
            return None
        last: dict[str, int] | None = None

        def report(message: str) -> None:
            nonlocal last
            if not message.startswith(("  ", "streamed replay:")):
                now = self.traffic()
                if last is not None:
                    progress(f"  {traffic_words(now, last)}")
                notes = self.joint_groups[self._notes_said :]
                for note, times in _runs(notes):
                    progress(f"  (passes run together: a group of {note}{f', {times} times' if times > 1 else ''})")
                self._notes_said = len(self.joint_groups)
                last = now
            progress(message)

        return report

    def traffic_summary(self) -> str:
        """The replay's traffic against the floor, one line for the stage log."""
        now = self.traffic()
        moved = (
            f", {words(now['bytes_host_to_device'])} host→device"
            if self.session.device.type == "cuda"
            else " (the CPU: nothing crosses a bus)"
        )
        cache = self.plan.cache
        kept = f"; host cache {words(cache.held_bytes)} of {words(self.plan.streamed_bytes)}" if cache else ""
        return (
            f"streamed replay, in all: {now['passes']} passes, {now['walks']} walks over the blocks, "
            f"{now['block_reads']} block reads "
            f"({now['block_reads_from_storage']} from the dump); {words(now['bytes_from_storage'])} read from the "
            f"dump{moved}; the floor, each block once: {words(now['bytes_floor'])}{kept}"
        )

    def stream_report(self) -> dict:
        """The report's `stream` block: the plan and what the replay did with it."""
        traffic = self.traffic()
        return {
            **self.plan.as_dict(),
            "peak_blocks_materialised": self.streamer.peak,
            "walks": self.streamer.walks,
            "joint_backwards": self.joint_backwards,
            "joint_backward_errors": list(self.joint_backward_errors),
            "joint_groups": list(self.joint_groups),
            "block_reads": self.streamer.reader.reads,
            "block_reads_from_storage": traffic["block_reads_from_storage"],
            "bytes_from_storage": traffic["bytes_from_storage"],
            "bytes_host_to_device": traffic["bytes_host_to_device"],
            "bytes_floor": traffic["bytes_floor"],
            "host_cache_bytes": self.plan.cache.held_bytes if self.plan.cache is not None else 0,
            "read_ahead_used": self.streamer.reader.hits,
            "blocks_cast_not_read": self.streamer.casts,
            "evicted_for_memory": self.streamer.memory_evictions,
            "gradient_host_bytes": self.streamer.store.host_bytes,
            "gradient_pinned_bytes": self.streamer.store.pinned_bytes,
            "gradient_host_alloc_seconds": round(self.streamer.store.alloc_seconds, 3),
        }


class _Switch(abc.ABC):
    """A PassSwitch (replay/run/lockstep.py) whose `during` puts one pass's (or micro-batch's) state in place for a
    block's backward in the engine call of all of them, and the one that was in place back after."""

    streamer: Any
    slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]]
    """Where each parameter outside the blocks sits in the model's modules (`resident_slots`)."""
    leaves: list[dict[int, torch.nn.Parameter]]
    """Each pass's (micro-batch's) own leaves for them, by the model parameter's id."""

    @staticmethod
    def resident_slots(runner: StreamedStepRunner) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        resident = {id(p) for n, p in runner.model.named_parameters() if n not in runner._streamed}
        return [
            (module, key, param)
            for module in runner.model.modules()
            for key, param in module._parameters.items()
            if param is not None and id(param) in resident
        ]

    def put_leaves(self, number: int) -> None:
        """`number`'s own leaves in the model's modules: Parameters sharing the model's storage, made on first use,
        with the post-accumulate hook `_hook` gives (so that one engine call accumulates each one's gradients apart)."""
        leaves = self.leaves[number]
        for module, key, param in self.slots:
            leaf = leaves.get(id(param))
            if leaf is None:
                leaf = leaves[id(param)] = torch.nn.Parameter(param.data, requires_grad=param.requires_grad)
                hook = self._hook(number, param)
                if hook is not None:
                    leaf.register_post_accumulate_grad_hook(hook)
            module._parameters[key] = leaf

    def put_back(self) -> None:
        """The model's own parameters back in its modules; no pass's state in place."""
        for module, key, param in self.slots:
            module._parameters[key] = param
        self.streamer.pass_number = None

    def _hook(self, number: int, param: torch.nn.Parameter) -> Callable[[torch.Tensor], None] | None:
        return None

    @abc.abstractmethod
    def enter(self, number: int) -> None: ...

    @abc.abstractmethod
    def leave(self, number: int) -> None: ...

    @contextlib.contextmanager
    def during(self, number: int) -> Iterator[None]:
        """Within: `number`'s state in place."""
        before = self.streamer.pass_number
        if before is not None:
            self.leave(before)
        self.enter(number)
        try:
            yield
        finally:
            self.leave(number)
            if before is not None:
                self.enter(before)


class _PassStates(_Switch):
    """What each pass run together with others keeps as its own (run_with_backwards; replay/run/lockstep.PassSwitch):
    the streamer's gradients and norms, and its own leaves for the parameters outside the blocks (Parameters sharing
    the model's storage, put in the model's modules while the pass runs), so that the one engine call of all the
    passes' backwards accumulates each pass's gradients apart, as each pass alone would."""

    def __init__(self, runner: StreamedStepRunner, count: int):
        self.runner, self.streamer = runner, runner.streamer
        self.slots = self.resident_slots(runner)
        names = {id(p): n for n, p in runner.model.named_parameters()}
        inside = {id(p) for module in self.streamer.modules for p in module.parameters()}
        self.measured = {
            id(param): names[id(param)]
            for _, _, param in self.slots
            if id(param) in names and id(param) not in inside and param.requires_grad
        }
        """Leaves whose gradient `_measure_resident` takes as soon as it is made: those used outside the blocks only
        (one used inside a block takes a gradient in each block's recomputed backward)."""
        self.base = self.streamer.grad_state()
        self.states: list[tuple] = [
            (PassGradStore(), {}, NonfiniteNames(), False, True, self.base[5], 1.0) for _ in range(count)
        ]
        self.lasts = [runner._last] * count
        self.leaves: list[dict[int, torch.nn.Parameter]] = [{} for _ in range(count)]

    def _hook(self, number: int, param: torch.nn.Parameter) -> Callable[[torch.Tensor], None] | None:
        name = self.measured.get(id(param))
        return None if name is None else functools.partial(self.runner._measure_resident, number, name)

    def enter(self, number: int) -> None:
        self.put_leaves(number)
        self.streamer.set_grad_state(self.states[number])
        self.runner._last = self.lasts[number]
        self.streamer.pass_number = number

    def leave(self, number: int) -> None:
        self.states[number] = self.streamer.grad_state()
        self.lasts[number] = self.runner._last
        self.close()

    def close(self) -> None:
        """The model's own parameters and the streamer's state back (each pass has left already)."""
        self.put_back()
        self.streamer.set_grad_state(self.base)


class _OneAfterAnother(Exception):
    """A pass whose micro-batches ran together must run again from the start: with fewer of them together
    (`out_of_memory`), else one after another; `lasting`: the reason holds for every later pass ("every pass": the
    model's structure) or every later fp32 re-run ("fp32"), which then run one after another without trying."""

    def __init__(self, size: int, why: str, out_of_memory: bool = False, lasting: str | None = None):
        super().__init__(why)
        self.size, self.why, self.out_of_memory, self.lasting = size, why, out_of_memory, lasting


class _MicroBatchLeaves(_Switch):
    """What each micro-batch of a pass run together keeps as its own (replay/run/lockstep.PassSwitch): leaves of its
    own for the parameters outside the blocks (sharing the model's storage), whose gradients go to the fold as soon
    as the engine made them (one a parameter and micro-batch: a second fails the engine call); and the micro-batch
    number that the blocks' forwards record for their backwards (its gradients of the block, to the fold)."""

    def __init__(self, runner: StreamedStepRunner, fold: MicroBatchFold):
        self.streamer, self.fold = runner.streamer, fold
        self.names = {id(p): n for n, p in runner.model.named_parameters() if n not in runner._streamed}
        self.params = dict(runner.model.named_parameters())
        self.slots = self.resident_slots(runner)
        self.leaves: list[dict[int, torch.nn.Parameter]] = [{} for _ in range(fold.count)]
        self._seen: set[tuple[int, str]] = set()

    def _hook(self, number: int, param: torch.nn.Parameter) -> Callable[[torch.Tensor], None] | None:
        return functools.partial(self._accumulated, number, self.names[id(param)]) if param.requires_grad else None

    def enter(self, number: int) -> None:
        self.put_leaves(number)
        self.streamer.pass_number = number

    def leave(self, number: int) -> None:
        self.put_back()

    def close(self) -> None:
        self.put_back()

    def _accumulated(self, number: int, name: str, leaf: torch.Tensor) -> None:
        if (number, name) in self._seen:
            raise RuntimeError(f"a second gradient of {name!r} in one micro-batch's backward: one after another")
        self._seen.add((number, name))
        grad, leaf.grad = leaf.grad, None
        if grad is not None:
            self.fold.add(number, name, grad, self._held)

    def _held(self, name: str) -> torch.Tensor | None:
        return self.params[name].grad


def _forget(*errors: BaseException | None) -> None:
    """The errors' tracebacks dropped: their frames hold the passes' graphs (and activations) alive, in a cycle
    (the frame of Lockstep.run holds the error that holds the frame) that only the cyclic collector would free."""
    for error in errors:
        if error is not None:
            error.__traceback__ = None
            error.__context__ = error.__cause__ = None


def _free_failed_group() -> None:
    """What a group that raised left in reference cycles (its passes' graphs and activations, the gradients summed
    so far) freed now, before its passes run again in halves or alone: left to the cyclic collector, which runs when
    Python objects pile up (not device memory), they stayed on the device beside the passes run again, which then
    ran out of memory in their turn (a row of an error instead of its numbers; seen on the CPU as a flaky test)."""
    gc.collect()


def out_of_memory(exc: BaseException) -> bool:
    """The exception is running out of memory (CUDA's caching allocator, or the host's)."""
    return isinstance(exc, torch.OutOfMemoryError) or is_out_of_memory(type(exc).__name__, str(exc))


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """A tensor's storage (its address) and bytes; a tensor without one (sparse, nested) counts by itself."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(tensor), tensor.numel() * tensor.element_size()


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _runs(notes: list[str]) -> list[tuple[str, int]]:
    """Each note with how many times it came in a row."""
    runs: list[tuple[str, int]] = []
    for note in notes:
        if runs and runs[-1][0] == note:
            runs[-1] = (note, runs[-1][1] + 1)
        else:
            runs.append((note, 1))
    return runs


def traffic_words(now: dict[str, int], before: dict[str, int]) -> str:
    """What moved between two `traffic()` readings, in words."""
    delta = {k: now[k] - before.get(k, 0) for k in now}
    return (
        f"(that stage: {delta['passes']} pass{'' if delta['passes'] == 1 else 'es'}, "
        f"{delta['walks']} walk{'' if delta['walks'] == 1 else 's'} over the blocks, {delta['block_reads']} block reads, "
        f"{delta['block_reads_from_storage']} of them from the dump, {words(delta['bytes_from_storage'])} read, "
        f"{words(delta['bytes_host_to_device'])} host→device)"
    )


def runner_for(session: ReplaySession) -> StepRunner:
    """The runner a session needs: streamed when its state did not fit the device (`session.stream`)."""
    return StreamedStepRunner(session) if session.stream is not None else StepRunner(session)


def expected_passes(
    session: ReplaySession,
    *,
    bisect: bool = True,
    rng_check: bool = True,
    fp32_check: bool = True,
    remedies: bool = True,
) -> int:
    """About how many passes a replay of this session takes: reproduce (the per-layer table read from it) and
    localise (2), other seeds (3), bisection (about 2 log2(samples) + 2), the fp32 re-run, the per-sample rows, the
    remedies (about 7). The plan's estimate: a step that does not reproduce stops earlier, one whose samples fail
    only together bisects longer."""
    samples = max(1, len(session.sample_refs))
    return (
        2
        + 3 * rng_check
        + (2 * samples.bit_length() + 2) * bisect
        + fp32_check
        + min(samples, STREAMED_PER_SAMPLE)
        + 7 * remedies
    )


__all__ = ["StreamedStepRunner", "expected_passes", "runner_for", "STREAMED_PER_SAMPLE"]
