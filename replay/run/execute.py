"""Reproduce: re-execute the failing step (all samples or a subset) from the pre-step weights.

`StepRunner.run()` restores each micro-batch's RNG, runs its forward under the recorded autocast
(or fp32), divides the loss by the recorded divisor (scaling it like the job's GradScaler), runs
backward, and measures the result. Every run starts from the pre-step weights: the runner keeps a
copy of the initial state_dict and loads it back before each run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, TypeGuard, TypeVar

import torch

from forensics.core.errors import ForensicsError, ReplayError, is_out_of_memory
from forensics.format.jsonio import lenient_float
from forensics.core.grad_norm import total_grad_norm
from forensics.core.kinds import FidelityMode, Phase, ReplayedQuantity, TriggerKind
from forensics.replay.load.fsdp_precision import fsdp_compute
from forensics.replay.load.samples import SampleRef
from forensics.replay.load.session import ReplaySession, weight_fingerprints
from forensics.replay.run.fp32 import Fp32Count, held_to_fp32
from forensics.replay.run.units import explaining_factor, recorded_factors, to_replay_units

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Relative tolerance when a bitwise match cannot be expected (other GPU / torch / CPU vs GPU):
# reductions in another order move fp32 results by ~1e-6 relative, bf16 autocast by ~1e-2 at worst.
DEFAULT_TOLERANCE = 1e-2


def _finite(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


@dataclass
class StepResult:
    """What one run of the step produced."""

    losses: list[float | None]
    """Per micro-batch loss before division by the divisor; None where the micro-batch was skipped."""
    grad_norm: float | None
    """Total L2 norm of all gradients (as clip_grad_norm_ computes it), unscaled; None without backward."""
    loss_finite: bool
    grads_finite: bool
    params_finite: bool
    """The pre-step weights themselves are finite."""
    nonfinite_grad_params: list[str] = field(default_factory=list)
    """Parameters whose gradient holds NaN/Inf, in named_parameters() order."""
    fp32: bool = False
    samples: list[SampleRef] | None = None
    step_loss: float | None = None
    """sum(losses run) / divisor: the step's objective as the job computed it (whole step only)."""
    micro_batches_run: int = 0
    micro_batches_total: int = 0

    @property
    def comparable_loss(self) -> float | None:
        """The step loss a run of only these micro-batches stands for: mean of the micro-batch losses
        run, times (micro-batches / divisor). Equals step_loss for the whole step."""
        values = [v for v in self.losses if v is not None]
        if not values or self.step_loss is None:
            return None
        return self.step_loss * self.micro_batches_total / len(values)

    @property
    def comparable_grad_norm(self) -> float | None:
        """grad_norm scaled up for skipped micro-batches (equals grad_norm for the whole step)."""
        if self.grad_norm is None or not self.micro_batches_run:
            return self.grad_norm
        return self.grad_norm * self.micro_batches_total / self.micro_batches_run

    error: str | None = None
    """With anomaly=True: the RuntimeError autograd anomaly mode raised (else None)."""
    raised: dict | None = None
    """Replaying a step that raised in the job: what this run raised ({type, message, file, function,
    micro_batch, phase}), or None when it finished."""
    raised_same: bool = False
    """`raised` is the recorded exception: the same type, raised in the same function."""
    unrunnable: bool = False
    """A subset of the samples the model cannot run alone (BatchNorm with one sample per channel, a fixed batch
    size) in a job that did not raise: it shows nothing about the trigger (`raised` says what it raised)."""
    anomaly_warnings: list[str] = field(default_factory=list)

    @property
    def norm_overflow(self) -> bool:
        """Every gradient value is finite but their total norm is not (a diverged state: values past ~1e19 square
        beyond float32's range): the Guard's non-finite grad norm, as clip_grad_norm_ computes it."""
        return self.grads_finite and self.grad_norm is not None and not math.isfinite(self.grad_norm)

    def trigger_reproduced(self, kind: TriggerKind | str, threshold: float | None = None) -> bool:
        """True when this run shows the same kind of failure as the trigger.

        nonfinite_loss: a micro-batch loss is NaN/Inf. nonfinite_grad: a gradient is NaN/Inf, or the gradients'
        total norm is (norm_overflow).
        loss_spike: a loss is non-finite, or the step loss (sum / divisor, as the Guard computes it;
        for a run that skipped micro-batches, `comparable_loss`) is above `threshold`. grad_norm_spike: the
        grad norm is above `threshold` (or non-finite). nonfinite_param: the pre-step weights hold
        NaN/Inf (an update that breaks them is checked by forensics.replay.localize.update.localize_optimizer).
        """
        try:
            trigger = TriggerKind.parse(kind)
        except ValueError as exc:
            raise ReplayError(str(exc)) from None
        if self.unrunnable:
            return False
        if trigger.spike:
            if trigger.replayed is ReplayedQuantity.STEP_LOSS:
                if any(not math.isfinite(v) for v in self.losses if v is not None):
                    return True
                value = self.comparable_loss
            else:
                value = self.comparable_grad_norm
                if value is not None and not math.isfinite(value):
                    return True
            return threshold is not None and value is not None and value > threshold
        if trigger.replayed is ReplayedQuantity.EXCEPTION:
            return self.raised_same
        if trigger.replayed is ReplayedQuantity.MICRO_BATCH_LOSS:
            return not self.loss_finite
        if trigger.replayed is ReplayedQuantity.GRAD_NORM:  # a NaN/Inf value, or finite values whose norm overflows
            return not self.grads_finite or self.norm_overflow
        return not self.params_finite

    def replayed_value(self, kind: TriggerKind, micro_batch: int | None = None) -> float | None:
        """The replayed counterpart of the trigger's recorded value (None: the kind has none)."""
        if kind.replayed is ReplayedQuantity.GRAD_NORM:
            return self.grad_norm
        if (
            kind.replayed is ReplayedQuantity.MICRO_BATCH_LOSS
            and isinstance(micro_batch, int)
            and micro_batch < len(self.losses)
        ):
            return self.losses[micro_batch]
        if kind.replayed in (ReplayedQuantity.MICRO_BATCH_LOSS, ReplayedQuantity.STEP_LOSS):
            return self.step_loss
        return None


def raised_info(exc: BaseException, micro_batch: int, phase: Phase) -> dict:
    """What a replayed step raised: type, message, and the innermost frame (the place compared with the job's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "micro_batch": micro_batch,
        "phase": Phase(phase).value,
        "file": os.path.basename(last.filename) if last else None,
        "function": last.name if last else None,
    }


def same_exception(raised: dict, recorded: dict | None) -> bool:
    """The replayed exception is the recorded one: same type, raised in the same function of the same file
    (by base name: the job ran on another machine). Running out of memory is the same failure wherever it
    happens: the allocation that fails depends on what the allocator still holds. A CUDA error (device-side
    assert) is the same failure as any exception in the same phase: replayed on the CPU, the bad index raises
    the CPU's own error, and CUDA reports its asserts late, at a later op."""
    if not recorded:
        return False
    if is_out_of_memory(recorded.get("type"), recorded.get("message")) and is_out_of_memory(
        raised.get("type"), raised.get("message")
    ):
        return True
    if recorded.get("cuda_error") and _no_later_than(raised.get("phase"), recorded.get("during")):
        return True  # a device-side assert replayed elsewhere raises that device's own error (CPU: IndexError)
    frames = recorded.get("frames") or []
    last = frames[-1] if frames and isinstance(frames[-1], dict) else {}
    same_place = not last or (
        raised.get("function") == last.get("function")
        and raised.get("file") == os.path.basename(str(last.get("file") or ""))
    )
    return raised.get("type") == recorded.get("type") and same_place


def _no_later_than(replayed: object, recorded: object) -> bool:
    """The replayed phase is the recorded one or earlier: a CUDA error is reported at a later API call than the
    op that failed (without CUDA_LAUNCH_BLOCKING a forward's bad index surfaces in the backward, seen on an H100)."""
    order = list(Phase)
    first, then = Phase.parse(replayed, Phase.FORWARD), Phase.parse(recorded, Phase.OPTIMIZER)
    return order.index(first) <= order.index(then)


def any_nonfinite(tensors: Iterable[torch.Tensor]) -> list[bool]:
    """Per tensor: holds a NaN/Inf, exactly (a sum of large finite values can overflow; a NaN-propagating minimum and
    maximum cannot), each tensor read once and no mask of its size made (`nonfinite_flag`), one device sync for the
    lot."""
    tensors = list(tensors)
    if not tensors:
        return []
    return [bool(bad) for bad in torch.stack([nonfinite_flag(t) for t in tensors]).tolist()]


def all_finite(tensor: torch.Tensor) -> bool:
    """Every element of `tensor` finite (`nonfinite_flag`: where isfinite() wrote a mask of a byte per element, 64 MiB
    for a 1 B model's embedding gradient, an FSDP2 1 B replay at its least budget ran out of memory on an H200)."""
    return not bool(nonfinite_flag(tensor))


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on `tensor`'s device, True where it holds a NaN/Inf, computed without a device sync and
    without a mask of its size: the NaN-propagating minimum and maximum (torch.aminmax, one read) are both finite
    exactly when every element is (complex: isfinite's mask)."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    if tensor.is_complex():
        return ~torch.isfinite(tensor).all()
    low, high = torch.aminmax(tensor)
    return ~(torch.isfinite(low) & torch.isfinite(high))


class NonfiniteNames:
    """Names of tensors holding a NaN/Inf, their flags read from the device once, when first asked (`in`, iteration):
    a flag added per gradient (`add_flag`, `nonfinite_flag`) costs no sync where a bool per gradient would stall the
    device once each (a streamed backward measures every block's gradients as the block's backward ends)."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._pending: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str) -> None:
        self._names.add(name)

    def add_flag(self, name: str, flag: torch.Tensor) -> None:
        self._pending.append((name, flag))

    def clear(self) -> None:
        self._names.clear()
        self._pending.clear()

    def _resolve(self) -> set[str]:
        if self._pending:
            by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
            for name, flag in self._pending:
                by_device.setdefault(flag.device, []).append((name, flag))
            for pending in by_device.values():
                values = torch.stack([flag for _, flag in pending]).tolist()
                self._names.update(name for (name, _), bad in zip(pending, values) if bad)
            self._pending.clear()
        return self._names

    def __contains__(self, name: object) -> bool:
        return name in self._resolve()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._resolve()))

    def __len__(self) -> int:
        return len(self._resolve())


RELOAD_MIN_BYTES = 256 << 20
"""A model state above this is reset from the dump rather than from an in-memory copy (StepRunner)."""


def _copy_would_crowd_gpu(need: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except RuntimeError:
        return True
    return need > free // 2


class StepRunner:
    """Re-executes the session's step as often as asked, always from the pre-step weights.

    Args:
        session: what forensics.replay.load.session built.
        keep_initial_on_cpu: keep the pre-step state_dict copy on the CPU (saves GPU memory for big
            models; each reset then copies host -> device). None: on the CPU when a device copy would
            take more than half of the GPU's free memory.
    """

    def __init__(self, session: ReplaySession, keep_initial_on_cpu: bool | None = None):
        self.session = session
        self.model = session.model
        state_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        crowded = _copy_would_crowd_gpu(state_bytes, session.device)
        self._reload = (
            session.pre_step_weights
            if session.pre_step_weights is not None and (crowded or state_bytes > RELOAD_MIN_BYTES)
            else None
        )
        """Large model replayed from a dump: every reset re-reads the pre-step weights from the dump (pread)
        (page cache, disk speed) instead of keeping a second copy of the model in memory."""
        self._initial: dict[str, torch.Tensor] | None = None
        if self._reload is None:
            where = torch.device("cpu") if (crowded if keep_initial_on_cpu is None else keep_initial_on_cpu) else None
            self._initial = {
                k: (v.detach().to(where, copy=True) if where else v.detach().clone())
                for k, v in self.model.state_dict().items()
            }
        self.param_names = [n for n, _ in self.model.named_parameters()]
        self._dtypes = {n: t.dtype for n, t in self._live_tensors()}
        flags = any_nonfinite(p.detach() for _, p in self.model.named_parameters())
        self.nonfinite_params = [n for n, bad in zip(self.param_names, flags) if bad]
        self.passes = 0
        self._untouched: dict[str, tuple] | None = session.loaded_weights if self._reload is not None else None
        """Large model reset from the dump: each parameter's fingerprint (forensics.replay.load.session.weight_fingerprints)
        as the load or the last reset() left it, by name; None: reload everything (weights_changed())."""
        self._warned_autocast = False
        self.fp32_count = Fp32Count()
        """What the last fp32 pass ran (replay/run/fp32.py): the precision triage reports it and trusts it only
        when no compute op ran below float32."""
        self._warned_unrunnable = False

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Pre-step weights and buffers back in place, gradients cleared, param dtype as recorded."""
        model = self.model
        for name, tensor in self._live_tensors():  # after an fp32 run: each tensor back to its dtype
            dtype = self._dtypes.get(name)
            if dtype is not None and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
        with torch.no_grad():
            if self._reload is not None:
                live = model.state_dict()
                stale = self._stale(live)
                for name, tensor in self._reload(names=stale) if stale else ():
                    if name in live:
                        live[name].copy_(tensor)
            elif self._initial is not None:
                model.load_state_dict(self._initial, strict=False)
        for p in model.parameters():
            p.grad = None
        self._untouched = self._fingerprints()

    def weights_changed(self) -> None:
        """Code outside run() that may have written the weights without a trace (an optimizer of the dump's class
        stepping the model through `.data`, which no version counter sees) calls this: the next reset() re-reads
        every parameter."""
        self._untouched = None

    def _fingerprints(self) -> dict[str, tuple] | None:
        return weight_fingerprints(self.model) if self._reload is not None else None

    def _stale(self, live: dict[str, torch.Tensor]) -> set[str]:
        """What reset() must re-read from the dump: every buffer (a forward in train mode moves BatchNorm's
        statistics) and each parameter unless it is provably as the load or the last reset left it (a 7B model's
        weights are 27 GB to re-read otherwise): its storage, dtype, shape and in-place version counter are
        unchanged. Passes, their gradients and the optimizer checks (which step copies of the parameters:
        forensics.replay.localize.update.step_each_parameter) leave the weights alone; an fp32 pass's casts change the
        storage; code that steps the model itself calls weights_changed()."""
        untouched, now = self._untouched or {}, weight_fingerprints(self.model)
        return {name for name in live if name not in now or untouched.get(name) != now[name]}  # buffers: not in now

    def _live_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters()) + list(self.model.named_buffers())

    # -- gradients, as the stages that read them see them (a streamed runner, replay/run/streamed_runner.py, answers these
    # block by block) ---------------------------------------------------------------------------
    def gradient_names(self) -> list[str]:
        """The parameters holding a gradient after the last run(keep_grads=True), in named_parameters() order."""
        return [n for n, p in self.model.named_parameters() if p.grad is not None]

    def gradients(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Those parameters, each with its weights and `.grad` in place while the caller holds it."""
        return ((n, p) for n, p in self.model.named_parameters() if p.grad is not None)

    def own_grad_norms(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The fp32 gradient norm of each of `module`'s own parameters (not its children's) holding one."""
        return [
            torch.linalg.vector_norm(p.grad.float()) for p in module.parameters(recurse=False) if p.grad is not None
        ]

    def keeping_gradients(self) -> ContextManager:
        """Within: run(keep_grads=True) keeps the gradients themselves for `gradients()` (a streamed runner otherwise
        keeps only their norms: the optimizer checks ask for them, the other stages need the numbers)."""
        return contextlib.nullcontext()

    def clip_gradients(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ over the model's gradients."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def close(self) -> None:
        """Frees what the runner holds beyond the model (nothing here)."""

    block_major = False
    """Several forward-only passes cost about one when run together (`run_forwards`): a streamed runner's, which
    brings each block to the device once for all of them. A stage may then run passes it might not need."""

    def run_forwards(self, jobs: list[Callable[[], T]]) -> list[T]:
        """Each job's result, in order; each job runs one forward-only pass (`run(..., backward=False)`) and nothing
        else that depends on the passes before it (a streamed runner runs them together, block by block)."""
        return [job() for job in jobs]

    def autocast_context(self, fp32: bool = False) -> ContextManager:
        """The job's autocast on the replay device (none when the job used none); with fp32=True, float32 whatever
        the user's code enters or casts to (replay/run/fp32.py), counted in `fp32_count`."""
        dtype = self.session.autocast_dtype
        if fp32:  # held there whatever autocast or casts the user's code asks for; what ran is counted
            return held_to_fp32(self.fp32_count)
        if dtype is None:
            return contextlib.nullcontext()
        device_type = self.session.device.type
        try:
            return torch.autocast(device_type=device_type, dtype=dtype)
        except RuntimeError as exc:  # e.g. a dtype this device's autocast does not support
            if not self._warned_autocast:
                self.session.warnings.append(
                    f"autocast({device_type}, {dtype}) is not available here ({exc}); replaying with bfloat16 autocast"
                )
                self._warned_autocast = True
            return torch.autocast(device_type=device_type, dtype=torch.bfloat16)

    def job_precision(self, fp32: bool = False) -> ContextManager:
        """Within: the model computes in the dtypes the job's FSDP2 units did (replay/load/fsdp_precision.py); nothing
        for a job without FSDP2 mixed precision, or with fp32=True. Autocast is autocast_context's."""
        if fp32 or not self.session.fsdp_units:
            return contextlib.nullcontext()
        return fsdp_compute(self.model, self.session.fsdp_units)

    def restore_rng(self, index: int) -> None:
        """Puts back the RNG state recorded right before micro-batch `index`'s forward."""
        from forensics.core.rng import restore_rng

        states = self.session.rng_states
        if index >= len(states) or states[index] is None:
            return
        device = self.session.device
        if device.type == "cuda" and self.session.source_cuda_device is not None:
            restore_rng(
                states[index], source_device=int(self.session.source_cuda_device), target_device=device.index or 0
            )
        else:
            restore_rng(states[index])

    def batch_for(self, micro_batch: int, indices: list[int] | None) -> Any:
        """Micro-batch `micro_batch`, or only its samples at `indices`."""
        batch = self.session.micro_batches[micro_batch]
        if indices is None:
            return batch
        from forensics.replay.load.samples import select_samples

        return select_samples(batch, indices)

    @contextlib.contextmanager
    def speculating(self) -> Iterator[None]:
        """Within: runs whose results a stage may never use (block-major look-ahead, `run_forwards`) leave no warning
        in the report; the stage tells what a result it uses would have told (`note_unrunnable`)."""
        warnings, warned = list(self.session.warnings), (self._warned_unrunnable, self._warned_autocast)
        try:
            yield
        finally:
            self.session.warnings[:] = warnings
            self._warned_unrunnable, self._warned_autocast = warned

    def note_unrunnable(self, raised: dict) -> None:
        """Tells the report, once, that some subsets of the samples could not run on their own."""
        if self._warned_unrunnable:
            return
        self._warned_unrunnable = True
        self.session.warnings.append(
            f"some subsets of the samples cannot run without the rest of their micro-batch ({raised['type']}: "
            f"{str(raised['message'])[:160]}; e.g. BatchNorm needs more than one sample): those runs count as "
            "healthy in bisection and show no loss in the per-sample table"
        )

    # -- running -------------------------------------------------------------------------------
    def run(
        self,
        samples: list[SampleRef] | None = None,
        *,
        fp32: bool = False,
        anomaly: bool = False,
        restore_rng: bool = True,
        backward: bool = True,
        forward_context: Callable[[int], ContextManager] | None = None,
        on_loss: Callable[[int, torch.Tensor], None] | None = None,
        keep_grads: bool = False,
        anomaly_check_nan: bool = True,
    ) -> StepResult:
        """Runs the step once from the pre-step weights.

        Args:
            samples: run only these samples (None: all). Micro-batches with none selected are skipped;
                the others are divided by the recorded divisor, as in the job.
            fp32: no autocast, no FSDP2 mixed precision, no loss scaling, model in float32.
            anomaly: run under torch.autograd.detect_anomaly(check_nan=True); its error is returned
                in StepResult.error, its forward traceback in anomaly_warnings.
            restore_rng: put each micro-batch's recorded RNG back before its forward.
            backward: also run backward and measure gradients.
            forward_context: per micro-batch context around the forward (localisation hooks).
            on_loss: called with (micro_batch, loss) before backward.
            keep_grads: leave the gradients on the model afterwards (for the optimizer check); the
                next run() resets them anyway.
            anomaly_check_nan: with anomaly=True, abort backward at the first NaN (anomaly mode's
                check); False only records forward tracebacks on the autograd nodes.
        Returns:
            StepResult.
        """
        session = self.session
        self.reset()
        self._start_pass(fp32)
        scale = None
        if session.loss_scale is not None and not fp32:
            scale = torch.tensor(session.loss_scale, dtype=torch.float32, device=session.device)
        options = _PassOptions(fp32, anomaly, restore_rng, backward, forward_context, on_loss, anomaly_check_nan)
        done = self._run_micro_batches(_selection(samples), scale, options)
        grad_norm, bad_grads = self._measured_grads(scale, backward)
        losses = done.losses
        result = StepResult(
            losses=losses + [None] * (len(session.micro_batches) - len(losses)),
            grad_norm=grad_norm,
            loss_finite=all(_finite(v) for v in losses if v is not None),
            grads_finite=not bad_grads,
            params_finite=not self.nonfinite_params,
            nonfinite_grad_params=bad_grads,
            fp32=fp32,
            samples=list(samples) if samples is not None else None,
            step_loss=sum(v for v in losses if v is not None) / session.loss_divisor if losses else None,
            micro_batches_run=sum(v is not None for v in losses),
            micro_batches_total=len(session.micro_batches),
            error=done.error,
            anomaly_warnings=done.anomaly_text,
            raised=done.raised,
            raised_same=done.raised is not None and same_exception(done.raised, session.exception),
            unrunnable=done.unrunnable,
        )
        if not keep_grads:
            for p in self.model.parameters():
                p.grad = None
        if fp32:  # the weights back in their dtype; the gradients kept (an update from them is measured next)
            grads = {name: p.grad for name, p in self.model.named_parameters()} if keep_grads else {}
            self.reset()
            for name, p in self.model.named_parameters():
                grad = grads.get(name)
                p.grad = None if grad is None else grad.to(p.dtype)
        return result

    def forward_measured(self, mode: ContextManager, samples: list[SampleRef] | None, what: str) -> bool:
        """One forward of the step (or `samples`) with each micro-batch's forward under `mode` (a dispatch mode that
        measures); False, with `what` could not be measured logged, when the run raised. A measurement never stops the
        replay."""

        @contextlib.contextmanager
        def measured(_micro_batch: int) -> Iterator[None]:
            with mode:
                yield

        try:
            self.run(samples, backward=False, forward_context=measured)
        except Exception:  # a measurement: the stage goes on without it
            logger.warning("%s could not be measured", what, exc_info=True)
            return False
        return True

    def _start_pass(self, fp32: bool) -> None:
        """Counts the pass, puts the model in train mode and, for fp32, casts its floating-point tensors."""
        self.passes += 1
        self.model.train()
        if fp32:
            self.fp32_count = Fp32Count()
        if fp32:  # floating-point tensors only: Module.to(float32) would also make complex buffers (rotary
            for _, tensor in self._live_tensors():  # freqs_cis) real, dropping their imaginary parts for good
                if tensor.is_floating_point() and tensor.dtype != torch.float32:
                    tensor.data = tensor.data.to(torch.float32)

    def _run_micro_batches(
        self, selected: dict[int, list[int]] | None, scale: torch.Tensor | None, options: _PassOptions
    ) -> _PassOutcome:
        """Forward (and backward) of each micro-batch in order, under anomaly mode / the FSDP2 compute dtypes when
        asked; stops at the first exception of a step that raised (or of a subset the model cannot run alone)."""
        done = _PassOutcome()
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as stack:
                warnings.simplefilter("always")
                if options.anomaly:  # its "Anomaly Detection has been enabled" warning is expected here
                    stack.enter_context(torch.autograd.detect_anomaly(check_nan=options.anomaly_check_nan))
                stack.enter_context(self.job_precision(options.fp32))
                self._micro_batch_loop(selected, scale, options, done)
        finally:
            done.anomaly_text = [
                str(w.message)
                for w in caught
                if "anomaly" in str(w.message).lower() or "Traceback of forward call" in str(w.message)
            ]
            for w in caught:  # re-emit what was not ours to swallow
                if str(w.message) not in done.anomaly_text:
                    logger.debug("warning during replay: %s", w.message)
        return done

    def _micro_batch_loop(
        self,
        selected: dict[int, list[int]] | None,
        scale: torch.Tensor | None,
        options: _PassOptions,
        done: _PassOutcome,
    ) -> None:
        """Each selected micro-batch in order (None in `done.losses` for the others), until one stops the pass (a
        streamed runner may run several of them together, block by block)."""
        for i in range(len(self.session.micro_batches)):
            if selected is not None and i not in selected:
                done.losses.append(None)
                continue
            if not self._run_micro_batch(i, None if selected is None else selected[i], scale, options, done):
                break

    def _run_micro_batch(
        self, i: int, indices: list[int] | None, scale: torch.Tensor | None, options: _PassOptions, done: _PassOutcome
    ) -> bool:
        """Micro-batch `i` (only `indices`, when given): its loss appended to `done`; False when the pass stops here
        (anomaly mode's error in backward, or an exception recorded in `done.raised`)."""
        session, model = self.session, self.model
        phase = Phase.FORWARD
        try:
            batch = self.batch_for(i, indices)
            if options.restore_rng:
                self.restore_rng(i)
            extra = options.forward_context(i) if options.forward_context is not None else contextlib.nullcontext()
            with extra, self.autocast_context(options.fp32), self._forward_scope(i, indices):
                loss = session.loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ReplayError(
                    f"the loss function returned {type(loss).__name__} "
                    f"{getattr(loss, 'shape', '')}, not a scalar tensor"
                )
            done.losses.append(float(loss.detach().float().reshape(())))
            if options.on_loss is not None:
                options.on_loss(i, loss)
            if options.backward and loss.requires_grad:
                phase = Phase.BACKWARD
                scaled = loss.reshape(()) / session.loss_divisor
                if scale is not None:
                    scaled = scaled * scale
                try:
                    self._backward(scaled)
                except RuntimeError as exc:
                    if not options.anomaly:
                        raise
                    done.error = str(exc)
                    return False
            return True
        except Exception as exc:  # replaying a step that raised in the job
            if isinstance(exc, ForensicsError) or self._raises(exc) or (session.exception is None and indices is None):
                raise
            done.raised = raised_info(exc, i, phase)
            if session.exception is None:  # a subset the model cannot run alone
                done.unrunnable = True
                self.note_unrunnable(done.raised)
            return False

    def _forward_scope(self, micro_batch: int, indices: list[int] | None) -> ContextManager:
        """Entered around each micro-batch's forward (a streamed runner measures the activations it keeps)."""
        return contextlib.nullcontext()

    def _raises(self, exc: Exception) -> bool:
        """An exception of a micro-batch that stops the run instead of being recorded as the step's (a streamed
        runner's passes run together: running out of memory there is the schedule's, not the step's)."""
        return False

    def _backward(self, scaled: torch.Tensor) -> None:
        """A micro-batch's backward (a streamed runner may run it together with other passes')."""
        scaled.backward()

    def _measured_grads(self, scale: torch.Tensor | None, backward: bool) -> tuple[float | None, list[str]]:
        """The gradients unscaled (GradScaler's 1/scale), their total norm and the parameters whose are non-finite."""
        grads = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        if scale is not None:
            inv = scale.double().reciprocal().float()  # GradScaler.unscale_ multiplies by 1/scale (fp32)
            with torch.no_grad():
                for _, g in grads:
                    g.mul_(inv.to(g.device))
        if not (backward and grads):
            return None, []
        norm = total_grad_norm([g for _, g in grads])
        flags = any_nonfinite(g for _, g in grads)
        return (float(norm) if norm is not None else None), [n for (n, _), bad in zip(grads, flags) if bad]


@dataclass(frozen=True)
class _PassOptions:
    """StepRunner.run's options for one pass over the micro-batches (see its Args)."""

    fp32: bool
    anomaly: bool
    restore_rng: bool
    backward: bool
    forward_context: Callable[[int], ContextManager] | None
    on_loss: Callable[[int, torch.Tensor], None] | None
    anomaly_check_nan: bool


@dataclass
class _PassOutcome:
    """What one pass over the micro-batches left: the losses run so far, and why it stopped early."""

    losses: list[float | None] = field(default_factory=list)
    error: str | None = None
    """Anomaly mode's error in backward."""
    raised: dict | None = None
    """The exception the step raised (raised_info)."""
    unrunnable: bool = False
    anomaly_text: list[str] = field(default_factory=list)


def _selection(samples: list[SampleRef] | None) -> dict[int, list[int]] | None:
    """Micro-batch -> the sorted indices of `samples` in it (None: every sample)."""
    if samples is None:
        return None
    selected: dict[int, list[int]] = {}
    for ref in samples:
        selected.setdefault(int(ref.micro_batch), []).append(int(ref.index))
    return {mb: sorted(ix) for mb, ix in selected.items()}


# --------------------------------------------------------------------------------------------
# fidelity
# --------------------------------------------------------------------------------------------
def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b


def _close(a: float | None, b: float | None, tol: float) -> bool:
    if _same(a, b):
        return True
    if not (_finite(a) and _finite(b)):
        return False
    return abs(a - b) <= tol * max(1.0, abs(a))


@dataclass
class Reproduction:
    """Outcome of reproducing the step (the report's `reproduced` and `fidelity`)."""

    reproduced: bool
    result: StepResult
    fidelity: dict
    attempts: int
    per_layer: list | None = None
    """The per-layer table read from the last attempt's pass (`reproduce(watch=...)`), None without a watch."""


def reproduce(
    runner: StepRunner, max_attempts: int = 3, tolerance: float = DEFAULT_TOLERANCE, watch: Any = None
) -> Reproduction:
    """Runs the whole step until the trigger reproduces (at most `max_attempts` times).

    `watch`: a context (replay/localize/update.LayerWatch) entered around each attempt's pass, whose `rows()` are read
    right after it, its gradients still in place: the per-layer table without a pass of its own.

    Compares replayed per-micro-batch losses and grad norm with the recorded ones: bitwise when the
    replay machine matches the capture (session.expect_bitwise), else within `tolerance` (relative).
    Returns:
        Reproduction; fidelity follows the report schema's "fidelity" block.
    """
    session = runner.session
    kind, threshold = session.trigger.kind, session.trigger.threshold
    attempts, result, reproduced, rows = 0, None, False, None
    for attempts in range(1, max(1, max_attempts) + 1):
        with watch if watch is not None else contextlib.nullcontext():
            result = runner.run(keep_grads=True)
        rows = watch.rows() if watch is not None else None
        if attempts == 1 and to_replay_units(session, result.grad_norm):
            threshold = session.trigger.threshold
        reproduced = result.trigger_reproduced(kind, threshold)
        if reproduced or session.device.type == "cpu":  # CPU kernels are deterministic: same answer again
            break
        logger.info("attempt %d did not reproduce %s; retrying", attempts, kind)
    if result is None:  # the loop above runs at least once
        raise ReplayError("no replay attempt ran")
    recorded = [lenient_float(v) for v in session.recorded_losses]
    replayed = result.losses
    diffs = [abs(a - b) for a, b in zip(recorded, replayed) if _finite(a) and _finite(b)]
    recorded_norm = lenient_float(session.recorded_grad_norm)
    # With several ranks the job's norm covers every rank's gradients (all-reduced, or over all ZeRO
    # shards); one rank replayed alone cannot produce it, so only the losses are compared.
    norm_reason = None
    if session.world_size > 1:
        norm_reason = (
            f"the recorded grad norm covers all {session.world_size} ranks' gradients; a one-rank "
            "replay computes this rank's only, so fidelity compares the per-micro-batch losses"
        )
    unit = explaining_factor(recorded_norm, result.grad_norm, recorded_factors(session))
    if norm_reason is None and unit is not None:
        norm_reason = (
            f"{unit.words()}: the job measured it in other units, so fidelity compares the per-micro-batch losses"
        )
    norm_compared = recorded_norm is not None and norm_reason is None
    compared = any(a is not None for a in recorded) or norm_compared
    bitwise = (
        compared
        and all(_same(a, b) for a, b in zip(recorded, replayed) if a is not None)
        and (not norm_compared or _same(recorded_norm, result.grad_norm))
    )
    mode = FidelityMode.BITWISE if session.expect_bitwise else FidelityMode.TOLERANCE
    fidelity = {
        "mode": mode.value,
        "tolerance": None if mode is FidelityMode.BITWISE else tolerance,
        "attempts": attempts,
        "recorded_losses": recorded,
        "replayed_losses": replayed,
        "max_abs_diff": max(diffs) if diffs else None,
        "recorded_grad_norm": recorded_norm,
        "replayed_grad_norm": result.grad_norm,
        "bitwise_equal": bitwise,
        "grad_norm_compared": norm_compared,
        "grad_norm_reason": norm_reason
        if norm_reason is not None
        else (None if norm_compared else "the job recorded no grad norm"),
    }
    if mode is FidelityMode.TOLERANCE:
        fidelity["within_tolerance"] = all(_close(a, b, tolerance) for a, b in zip(recorded, replayed) if a is not None)
    if not reproduced:
        logger.warning(
            "the %s trigger did not reproduce in %d attempt(s); recorded losses %s, replayed %s",
            kind,
            attempts,
            recorded,
            replayed,
        )
    elif mode is FidelityMode.BITWISE and not bitwise and any(a is not None for a in recorded):
        logger.warning("reproduced, but not bitwise: recorded %s, replayed %s", recorded, replayed)
    return Reproduction(reproduced=reproduced, result=result, fidelity=fidelity, attempts=attempts, per_layer=rows)


__all__ = [
    "SampleRef",
    "StepResult",
    "StepRunner",
    "Reproduction",
    "reproduce",
    "any_nonfinite",
    "all_finite",
    "nonfinite_flag",
    "NonfiniteNames",
    "DEFAULT_TOLERANCE",
]
