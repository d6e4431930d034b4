"""The flight recorder: what a replay of each of the last N steps needs besides the weights.

Per checked step: the sample IDs of every micro-batch (references, converted to JSON only when a dump is
written), the RNG state taken right before each micro-batch's forward (host memory, already captured by
record_batch), the learning rate, loss scale, divisor, step loss and grad norm. Bounded: the last
GuardConfig.recording.window_steps steps (about 12 KB per micro-batch: the torch CPU and Python RNG states).

With a data recipe (GuardConfig.dumping.data_recipe: how to rebuild a micro-batch from its sample IDs) and an earlier
checkpoint, `forensics replay DUMP --from CHECKPOINT` re-executes those steps to find the one whose update
broke the weights (replay/run/window.py). Written to the dump as `window.json` and `window-rng.safetensors`
(docs/DUMP_FORMAT.md "Flight recorder").

With GuardConfig.precursors it also keeps the precursor monitor's per-layer statistics of the last
PrecursorConfig.history steps (host numbers, read from the device by capture/precursors/monitor.py) and what fired,
written as `precursors.json`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from forensics.capture.recording.incident import json_ids
from forensics.format import jsonio, spec
from forensics.format.tensors import safetensors_bytes
from forensics.core.rng import RngState


MAX_FIRINGS = 32  # precursor firings kept (the newest): a long unstable run must not grow the dump


@dataclass
class WindowStep:
    step: int
    sample_ids: list[Any]  # per micro-batch, as recorded (converted at dump time)
    rng: list[RngState]
    lr: float | None
    loss_scale: float | None
    divisor: float
    loss: float | None
    grad_norm: float | None
    clipped: bool | None


class FlightRecorder:
    def __init__(self, steps: int):
        self._steps: deque[WindowStep] = deque(maxlen=steps + 1)  # the steps before, and the one being checked
        self.enabled = steps > 0
        self._precursor_meta: dict | None = None
        self._precursor_rows: deque[tuple[int, list]] = deque()
        self._precursor_firings: deque[dict] = deque(maxlen=MAX_FIRINGS)

    def watch_precursors(self, meta: dict, steps: int) -> None:
        """Keep precursor rows (of the columns `meta` states) for the last `steps` steps."""
        self._precursor_meta, self._precursor_rows = meta, deque(maxlen=steps)

    def note_precursors(self, step: int, values: list) -> None:
        self._precursor_rows.append((step, values))

    def note_precursor_firing(self, firing: dict) -> None:
        self._precursor_firings.append(firing)

    def append(self, entry: WindowStep) -> None:
        if self.enabled:
            self._steps.append(entry)

    def files(self, before_step: int) -> dict[str, bytes]:
        """`window.json` and `window-rng.safetensors` for the steps recorded before `before_step` ({} when none)."""
        files = self._precursor_file(before_step)
        steps = [s for s in self._steps if s.step < before_step]
        if not steps:
            return files
        rows, tensors = [], {}
        for entry in steps:
            rng_meta = []
            for index, state in enumerate(entry.rng):
                meta, parts = state.to_parts(f"s{entry.step}/mb{index}")
                rng_meta.append(meta)
                tensors.update(parts)
            rows.append(
                {
                    "step": entry.step,
                    "sample_ids": [json_ids(ids) for ids in entry.sample_ids],
                    "rng": rng_meta,
                    "lr": entry.lr,
                    "loss_scale": entry.loss_scale,
                    "divisor": entry.divisor,
                    "loss": entry.loss,
                    "grad_norm": entry.grad_norm,
                    "clipped": entry.clipped,
                }
            )
        return {**files, spec.WINDOW_JSON: jsonio.dumps({"steps": rows}), spec.WINDOW_RNG: safetensors_bytes(tensors)}

    def _precursor_file(self, up_to_step: int) -> dict[str, bytes]:
        """`precursors.json`: the rows up to and including `up_to_step` (its statistics are known at its check())."""
        if self._precursor_meta is None:
            return {}
        rows = [(s, v) for s, v in self._precursor_rows if s <= up_to_step]
        table = {
            **self._precursor_meta,
            "steps": [s for s, _ in rows],
            "values": [v for _, v in rows],
            "firings": [f for f in self._precursor_firings if f["step"] <= up_to_step],
        }
        return {spec.PRECURSORS: jsonio.dumps(table)}

    def steps_before(self, step: int) -> list[int]:
        return [entry.step for entry in self._steps if entry.step < step]

    def __len__(self) -> int:
        return len(self._steps)
