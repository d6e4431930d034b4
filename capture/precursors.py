"""The precursor monitor (GuardConfig.precursors): per-layer statistics that announce a divergence before the loss.

Large runs announce their spikes: attention logits and output logits drift up (Wortsman et al. 2023), one layer's
gradient norm or update/weight ratio grows for tens of steps, Adam's second moment vanishes so that updates jump
(Molybog et al. 2023). The monitor measures, for each repeated block of the model (found generically:
`find_blocks`, the largest nn.ModuleList of one class) and each step (forensics.kinds.PrecursorStatistic):

* block output RMS and abs-max (a forward hook on the block; max over the step's micro-batches);
* attention-logit bound: max|q| x max|k| / sqrt(head_dim), from hooks on the block's query and key projections
  (`q_proj` / `k_proj`, `query` / `key`, or GPT-2's fused `c_attn`). It is an upper bound of max |q.k|/sqrt(d) —
  rotary embeddings keep each head's norm, so it holds for RoPE models too — and not the logit itself;
* output-logit abs-max (a hook on the model's output embedding, `get_output_embeddings()`);
* gradient norm of the block's parameters (at check(), before the optimizer step);
* update/weight ratio ||lr x update|| / ||W|| and the Adam second-moment floor (min of exp_avg_sq) after each
  optimizer step: the update is Adam's bias-corrected m / (sqrt(v) + eps) (weight decay left out) or SGD's
  momentum buffer / gradient; other optimizers give neither. They describe the state a step starts from: the row
  of step s holds the update of step s - 1.

No host sync per step on the hot path: every value is a device scalar written into one preallocated device
accumulator; at check() the step's row is copied into a device ring of `read_every` rows, and the ring is read to
the host once it is full (`read_every=1`: right after check()'s own transfer, when the queue is already drained,
so the extra copy waits for no kernel). `RobustTrend` judges each statistic on the host: its log against the
running median of the recent healthy values, in robust standard deviations (1.4826 x MAD), sustained for a few
steps (forensics/trend.py, which replay uses to rank them too). When one fires, the Guard dumps the step (TriggerKind.PRECURSOR, policy 'continue') and the job goes on;
the statistics of the last `history` steps travel in the dump as `precursors.json` (capture/window.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from capture.incident import Incident, StepRecord, Trigger
from forensics.kinds import Policy, PrecursorStatistic, TriggerKind
from forensics.thirdparty import foreach_norm
from forensics.trend import TINY, RobustTrend

log = logging.getLogger(__name__)

FORWARD_STATS = (PrecursorStatistic.BLOCK_RMS, PrecursorStatistic.BLOCK_ABSMAX)
# (query name, key name, part): the projections whose outputs bound the attention logits; part None: the whole
# output, 0 / 1: the first / second third of a fused q|k|v projection (GPT-2's c_attn).
QK_PROJECTIONS = (("q_proj", "k_proj", None), ("query", "key", None), ("c_attn", "c_attn", (0, 1)))


@dataclass
class PrecursorConfig:
    """Opt-in precursor monitor: GuardConfig(precursors=PrecursorConfig()).

    Defaults are conservative: a statistic fires only after `warmup` measured steps, when its log stays more than
    `z_threshold` robust standard deviations above the median of the last `window` healthy values AND at least
    `min_growth` x that median, for `sustained` consecutive steps. Noise in a healthy run rarely moves a per-layer
    statistic 2x its recent median for 4 steps in a row once warm-up is over. Runs with a long learning-rate
    warm-up should set `warmup` to its length.
    """

    window: int = 32
    """Healthy values per statistic in the running median / MAD."""
    warmup: int = 64
    """Measured steps before a statistic may fire: early training moves every statistic (a randomly initialised
    model's attention logits grow tens of times while it learns to attend), and that is not a precursor."""
    sustained: int = 4
    """Consecutive steps above the baseline before it fires: one noisy step never does."""
    z_threshold: float = 6.0
    """Robust z of log(value) against the baseline that counts as 'above'."""
    min_growth: float = 2.0
    """And the value must be at least this many times the baseline median (for the Adam floor: this many times
    below it): the z test alone fires on a near-constant series."""
    read_every: int = 1
    """Steps between two reads of the device ring (one small device->host copy each). 1: every check(), right
    after its own transfer; K > 1: the ring holds K rows, a growth is seen up to K - 1 steps later."""
    attention: bool = True
    """Measure the attention-logit bound where the blocks have recognisable query / key projections."""
    optimizer: bool = True
    """Measure the update/weight ratio and the Adam floor after each optimizer step (one extra elementwise pass
    over the blocks' parameters and optimizer state: the largest cost of the monitor; scripts/bench/)."""
    max_dumps: int = 1
    """Precursor dumps per run (they count against GuardConfig.max_dumps too: keep one slot for the crash)."""
    min_gap: int = 200
    """Steps before the same (layer, statistic) may fire again."""
    history: int = 64
    """Steps of statistics kept in the flight recorder and written into every dump (`precursors.json`)."""

    def __post_init__(self):
        if self.window < 4 or self.warmup < 4:
            raise ValueError(f"PrecursorConfig needs window >= 4 and warmup >= 4, got window={self.window}, "
                             f"warmup={self.warmup}")
        if self.sustained < 1 or self.read_every < 1 or self.max_dumps < 0 or self.min_gap < 0:
            raise ValueError("PrecursorConfig needs sustained >= 1, read_every >= 1, max_dumps >= 0, min_gap >= 0")
        if self.z_threshold <= 0 or self.min_growth <= 1:
            raise ValueError(f"PrecursorConfig needs z_threshold > 0 and min_growth > 1, got "
                             f"{self.z_threshold}, {self.min_growth}")
        if self.history < self.window:
            raise ValueError(f"PrecursorConfig.history ({self.history}) must be >= window ({self.window}): the dump "
                             "must show the baseline the growth left")


@dataclass
class Firing:
    """One statistic that left its baseline for `sustained` steps."""

    layer: str
    statistic: PrecursorStatistic
    step: int
    started: int
    """The first step of the excursion."""
    value: float
    baseline: float
    """The median of the healthy values before it."""
    z: float

    def as_dict(self) -> dict:
        return {"layer": self.layer, "statistic": self.statistic.value, "step": self.step, "started": self.started,
                "value": self.value, "baseline": self.baseline, "z": self.z}

    @property
    def detail(self) -> str:
        direction = "above" if self.statistic.rising else "below"
        ratio = self.value / self.baseline if self.statistic.rising else self.baseline / max(self.value, TINY)
        return (f"{self.statistic.words} of {self.layer} has stayed {direction} its baseline since step "
                f"{self.started}: {self.value:.4g} vs median {self.baseline:.4g} ({ratio:.3g}x, robust z {self.z:.1f})")


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks, by qualified name: the children of its largest nn.ModuleList (by parameter
    count) whose children are all of one class (`transformer.h`, `model.layers`, `encoder.layer` ...); [] when it
    has none."""
    best: tuple[int, str, torch.nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(c) for c in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size and (best is None or size > best[0]):
                best = (size, name, module)
    if best is None:
        return []
    _, name, blocks = best
    return [(f"{name}.{i}" if name else str(i), block) for i, block in enumerate(blocks)]


def head_dim(model: torch.nn.Module) -> int | None:
    """The attention head size a Hugging Face config states (head_dim, else hidden / heads), else None."""
    config = getattr(model, "config", None)
    value = getattr(config, "head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(config, k)), None)
    heads = next((getattr(config, k) for k in ("num_attention_heads", "n_head", "num_heads") if hasattr(config, k)),
                 None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "logits", None) if not isinstance(output, (tuple, list)) else None


def _absmax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 device scalar, with two reductions and no |t| copy."""
    return torch.maximum(t.amax(), -t.amin()).float()


class PrecursorMonitor:
    """Hooks, the device accumulator and ring, and the host-side trends of one Guard (GuardConfig.precursors)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: PrecursorConfig):
        self.config, self.optimizer = config, optimizer
        self.blocks = find_blocks(model)
        if not self.blocks:
            log.warning("forensics: precursors: the model has no nn.ModuleList of repeated blocks; only the output "
                        "logits are watched")
        self.handles: list[Any] = []
        self.columns: list[tuple[str, PrecursorStatistic]] = []
        """What each value of a row is: (layer, statistic)."""
        param = next(iter(model.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        self._qk: list[tuple[int, int]] = []  # per block with projections: (q slot, k slot) in self._acc
        self._attention_cols: list[int] = []
        self._grad_cols: list[tuple[int, list[torch.nn.Parameter]]] = []
        for name, block in self.blocks:
            for stat in FORWARD_STATS:
                self.columns.append((name, stat))
            first = len(self.columns) - len(FORWARD_STATS)
            self.handles.append(block.register_forward_hook(self._block_hook(first)))
        self._add_attention(model)
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(output, torch.nn.Module):
            label = next((n for n, m in model.named_modules() if m is output), "output")
            self.columns.append((label, PrecursorStatistic.OUTPUT_LOGIT))
            self.handles.append(output.register_forward_hook(self._max_hook(len(self.columns) - 1)))
        for name, block in self.blocks:
            self.columns.append((name, PrecursorStatistic.GRAD_NORM))
            self._grad_cols.append((len(self.columns) - 1, [p for p in block.parameters() if p.requires_grad]))
        self._n_forward = len(self.columns)
        self._acc = torch.full((self._n_forward + 2 * len(self._qk),), -math.inf, device=device)
        self._post_cols = 0
        if config.optimizer and self.blocks:
            for name, _ in self.blocks:
                self.columns += [(name, PrecursorStatistic.UPDATE_RATIO), (name, PrecursorStatistic.ADAM_V_FLOOR)]
            self._post_cols = 2 * len(self.blocks)
            self.handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        self._post = torch.full((self._post_cols,), -math.inf, device=device)
        self._ring = torch.empty((config.read_every, len(self.columns)), device=device)
        self._ring_steps: list[int] = []
        self.trends = [RobustTrend(config.window, config.warmup, config.sustained, config.z_threshold,
                                   config.min_growth, stat.rising) for _, stat in self.columns]
        self._fired: dict[tuple[str, PrecursorStatistic], int] = {}
        self.recorder: Any = None
        """The Guard's flight recorder (capture/window.py), which keeps the rows read from the device."""
        self.dumps = 0
        self.firings: list[Firing] = []
        """Every firing of the run, dumped or not."""

    # -- hooks (hot path: device ops only) ----------------------------------------------------------
    def _note(self, slot: int, value: torch.Tensor) -> None:
        self._acc[slot] = torch.maximum(self._acc[slot], value.to(self._acc.device))

    def _block_hook(self, first: int):
        def hook(module, args, output):
            t = _first_tensor(output)
            if t is None or not t.is_floating_point() or not t.numel():
                return
            t = t.detach()
            rms = torch.linalg.vector_norm(t, dtype=torch.float32) / math.sqrt(t.numel())
            self._note(first, rms)
            self._note(first + 1, _absmax(t))
        return hook

    def _max_hook(self, slot: int):
        def hook(module, args, output):
            t = _first_tensor(output)
            if t is not None and t.is_floating_point() and t.numel():
                self._note(slot, _absmax(t.detach()))
        return hook

    def _row_norm_hook(self, offset: int, size: int, part: int | None):
        """Max per-head row norm of a query / key projection's output, kept after the columns (`offset`)."""
        def hook(module, args, output):
            t = _first_tensor(output)
            if t is None or not t.is_floating_point() or not t.numel():
                return
            t = t.detach()
            if part is not None:
                t = t.chunk(3, dim=-1)[part]
            if t.shape[-1] % size:
                return
            norms = torch.linalg.vector_norm(t.reshape(-1, size), dim=-1, dtype=torch.float32)
            self._note(self._n_forward + offset, norms.amax())
        return hook

    def _add_attention(self, model: torch.nn.Module) -> None:
        size = head_dim(model) if self.config.attention else None
        if size is None:
            return
        for name, block in self.blocks:
            modules = dict(block.named_modules())
            for q_name, k_name, parts in QK_PROJECTIONS:
                q = next((m for n, m in modules.items() if n.rpartition(".")[2] == q_name), None)
                k = next((m for n, m in modules.items() if n.rpartition(".")[2] == k_name), None)
                if q is None or k is None:
                    continue
                self.columns.append((name, PrecursorStatistic.ATTENTION_LOGIT))
                self._attention_cols.append(len(self.columns) - 1)
                q_slot, k_slot = 2 * len(self._qk), 2 * len(self._qk) + 1  # offsets after the columns
                self._qk.append((q_slot, k_slot))
                self._head_dim = size
                self.handles.append(q.register_forward_hook(self._row_norm_hook(q_slot, size, parts and parts[0])))
                self.handles.append(k.register_forward_hook(self._row_norm_hook(k_slot, size, parts and parts[1])))
                break

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Update/weight ratio and Adam floor per block (device ops; a failure turns them off, never the job)."""
        try:
            groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
            values = []
            for _, params in self._grad_cols:
                update, floor = self._update_and_floor(params, groups)
                weights = torch.linalg.vector_norm(torch.stack(foreach_norm(params)).float()) if params \
                    else None
                ratio = update / weights if update is not None and weights is not None else None
                values += [ratio, floor]
            device = self._post.device
            row = [v.reshape(()).to(device) if v is not None else torch.tensor(-math.inf, device=device)
                   for v in values]
            self._post.copy_(torch.stack(row))
        except Exception:  # noqa: BLE001 - a statistic is a convenience; the job goes on
            log.exception("forensics: precursors: the update statistics failed; they are off for this run")
            self.optimizer_stats_off()

    def optimizer_stats_off(self) -> None:
        self._post.fill_(-math.inf)
        for handle in self.handles[-1:]:
            handle.remove()

    def _update_and_floor(self, params: list[torch.nn.Parameter], groups: dict) -> tuple[Any, Any]:
        squares, floors = [], []
        for p in params:
            state, group = self.optimizer.state.get(p) or {}, groups.get(id(p))
            if group is None:
                continue
            lr = group.get("lr", 0.0)
            lr = float(lr) if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu" else lr
            if "exp_avg_sq" in state and "exp_avg" in state:
                beta1, beta2 = group.get("betas", (0.9, 0.999))
                step = state.get("step", 1)
                step = float(step) if not isinstance(step, torch.Tensor) or step.device.type == "cpu" else step
                v = state["exp_avg_sq"]
                update = (state["exp_avg"] / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + group["eps"])
                floors.append(v.amin().float())
            elif state.get("momentum_buffer") is not None:
                update = state["momentum_buffer"]
            elif p.grad is not None and "momentum_buffer" in state:
                update = p.grad
            else:
                continue
            squares.append((torch.linalg.vector_norm(update, dtype=torch.float32) * lr) ** 2)
        update_norm = torch.stack(squares).sum().sqrt() if squares else None
        return update_norm, torch.stack(floors).amin() if floors else None

    # -- at check() -------------------------------------------------------------------------------
    def end_step(self, step: int) -> list[Firing]:
        """Closes the step's row (gradient norms, attention bounds) into the device ring; when the ring is full,
        reads it (one device->host copy) and returns the statistics that fired."""
        acc = self._acc
        for slot, params in self._grad_cols:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                acc[slot] = torch.linalg.vector_norm(torch.stack(foreach_norm(grads)).float())
        for column, (q_slot, k_slot) in zip(self._attention_cols, self._qk):
            acc[column] = acc[self._n_forward + q_slot] * acc[self._n_forward + k_slot] / math.sqrt(self._head_dim)
        row = torch.cat([acc[:self._n_forward], self._post])
        self._ring[len(self._ring_steps)].copy_(row)
        self._ring_steps.append(step)
        acc.fill_(-math.inf)
        if len(self._ring_steps) < self.config.read_every:
            return []
        steps, self._ring_steps = self._ring_steps, []
        rows = self._ring[:len(steps)].tolist()  # the read
        return [f for s, values in zip(steps, rows) for f in self._judge(s, values)]

    def _judge(self, step: int, values: list[float]) -> list[Firing]:
        clean = [v if math.isfinite(v) else None for v in values]
        if self.recorder is not None:
            self.recorder.note_precursors(step, clean)
        fired = []
        for (layer, stat), trend, value in zip(self.columns, self.trends, clean):
            found = trend.observe(step, value)
            if found is not None:
                fired.append(Firing(layer, stat, step, found.started, found.value, found.baseline, found.z))
        fired.sort(key=lambda f: (f.started, -f.z))
        self.firings += fired
        return fired

    def describe(self) -> dict:
        """The columns and settings `precursors.json` states (docs/DUMP_FORMAT.md)."""
        return {"columns": [{"layer": layer, "statistic": stat.value} for layer, stat in self.columns],
                "config": {"window": self.config.window, "warmup": self.config.warmup,
                           "sustained": self.config.sustained, "z_threshold": self.config.z_threshold,
                           "min_growth": self.config.min_growth, "read_every": self.config.read_every}}

    def to_dump(self, firings: list[Firing], step: int) -> Firing | None:
        """The firing to dump at `step` (None: none may): the earliest-starting one whose (layer, statistic) did
        not fire within min_gap steps, within max_dumps. Every firing of the step is marked as seen."""
        chosen = None
        for firing in firings:
            key = (firing.layer, firing.statistic)
            last = self._fired.get(key)
            if last is not None and step - last < self.config.min_gap:
                continue
            self._fired[key] = step
            if chosen is None:
                chosen = firing
        if chosen is None or self.dumps >= self.config.max_dumps:
            return None
        self.dumps += 1
        return chosen


def watch(guard: Any, record: StepRecord, decision: bool, sync_free: bool) -> None:
    """Guard.check()'s precursor step (only the Guard's public members): ends the step's statistics and, when one
    fired on a healthy step no other trigger dumped, dumps it under policy 'continue'. Never raises."""
    monitor = guard.precursors
    if sync_free:
        return  # attach() refused the sync-free mode already
    try:
        firings = monitor.end_step(guard.step)
        if not firings:
            return
        for firing in firings:
            log.warning("forensics: step %d: precursor: %s", guard.step, firing.detail)
        chosen = monitor.to_dump(firings, guard.step)
        for firing in firings:
            guard.window.note_precursor_firing({**firing.as_dict(), "dumped": firing is chosen})
        if chosen is None or not decision or guard.last_incident_step == guard.step:
            return
        if guard.multi_rank and guard.state_is_collective:
            log.warning("forensics: precursor at step %d not dumped: this rank alone cannot gather a sharded state",
                        guard.step)
            return
        trigger = Trigger(TriggerKind.PRECURSOR, chosen.value, chosen.baseline, None, chosen.detail)
        losses = [float(v.float().mean()) if isinstance(v, torch.Tensor) else float(v)
                  for v in record.losses]  # a few scalars, read only when a precursor fires
        norm = guard.history.to_dict()["grad_norm"][-1] if len(guard.history) else None
        guard.handle_incident(Incident(trigger, guard.step, record, losses, norm,
                                       record.divisor(guard.config.loss_divisor), Policy.CONTINUE))
    except Exception:  # noqa: BLE001 - capture must never stop a healthy job
        log.exception("forensics: precursors: step %d could not be judged", guard.step)


def attach(guard: Any, config: PrecursorConfig | None) -> PrecursorMonitor | None:
    """The Guard's monitor for GuardConfig.precursors (None: off, or refused with a warning); its hooks are the
    Guard's to remove."""
    if config is None:
        return None
    if guard.config.sync_free:
        log.warning("forensics: precursors are off in the sync_free mode (their statistics are read at check())")
        return None
    try:
        monitor = PrecursorMonitor(guard.model, guard.optimizer, config)
    except Exception:  # noqa: BLE001
        log.exception("forensics: precursors: the monitor could not be set up; it is off")
        return None
    for handle in monitor.handles:
        guard.add_hook(handle)
    monitor.recorder = guard.window
    guard.window.watch_precursors(monitor.describe(), config.history)
    return monitor
