"""The flight recorder: what a replay of each of the last N steps needs besides the weights.

Per checked step: the sample IDs of every micro-batch (references, converted to JSON only when a dump is
written), the RNG state taken right before each micro-batch's forward (host memory, already captured by
record_batch), the learning rate, loss scale, divisor, step loss and grad norm. Bounded: the last
GuardConfig.window_steps steps (about 12 KB per micro-batch: the torch CPU and Python RNG states).

With a data recipe (GuardConfig.data_recipe: how to rebuild a micro-batch from its sample IDs) and an earlier
checkpoint, `forensics replay DUMP --from CHECKPOINT` re-executes those steps to find the one whose update
broke the weights (replay/window.py). Written to the dump as `window.json` and `window-rng.safetensors`
(docs/DUMP_FORMAT.md "Flight recorder").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from capture.incident import json_ids
from forensics.format import jsonio, spec
from forensics.format.tensors import safetensors_bytes
from forensics.rng import RngState


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

    def append(self, entry: WindowStep) -> None:
        if self.enabled:
            self._steps.append(entry)

    def files(self, before_step: int) -> dict[str, bytes]:
        """`window.json` and `window-rng.safetensors` for the steps recorded before `before_step` ({} when none)."""
        steps = [s for s in self._steps if s.step < before_step]
        if not steps:
            return {}
        rows, tensors = [], {}
        for entry in steps:
            rng_meta = []
            for index, state in enumerate(entry.rng):
                meta, parts = state.to_parts(f"s{entry.step}/mb{index}")
                rng_meta.append(meta)
                tensors.update(parts)
            rows.append({"step": entry.step, "sample_ids": [json_ids(ids) for ids in entry.sample_ids],
                         "rng": rng_meta, "lr": entry.lr, "loss_scale": entry.loss_scale, "divisor": entry.divisor,
                         "loss": entry.loss, "grad_norm": entry.grad_norm, "clipped": entry.clipped})
        return {spec.WINDOW_JSON: jsonio.dumps({"steps": rows}), spec.WINDOW_RNG: safetensors_bytes(tensors)}

    def steps_before(self, step: int) -> list[int]:
        return [entry.step for entry in self._steps if entry.step < step]

    def __len__(self) -> int:
        return len(self._steps)
