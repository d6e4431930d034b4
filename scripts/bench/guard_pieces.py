"""Benchmark helper: the host time of each piece of the Guard's healthy step, on the machine the bench runs on.

`Pieces(guard)` wraps the Guard's calls and the stages behind them (the RNG capture, the step check's halves, the read,
the detectors, the history and its run log, the flight recorder, the budget's question, the hooks on the model and the
optimizer) with a wall-clock timer, on this Guard only (instance attributes and the hook dictionaries; one class method,
DeviceFence.wait, for the sync-free check's wait on the previous step's copy). A few microseconds of timer per piece:
use it in a pass of its own, after the timed rounds. `table(steps)` lists each piece per step, nested as they call one
another (a piece's time includes the pieces below it).

    pieces = Pieces(guard); ...run N steps...; print(pieces.table(N)); pieces.remove()

Run as a script, it times the pieces on this machine's CPU: a GPT-2 with GPT-2 small's 148 parameter tensors (12
layers) at width 128, 4 micro-batches of 2 x 128 tokens, AdamW fused (the sync-free check) or foreach (the synchronous
one), check(grad_norm=clip_grad_norm_(...)); every Guard call right after a forward / backward, as in a job (cold
caches). The plain steps' time beside it, for scale:

    python -m scripts.bench.guard_pieces [--steps 200] [--check sync_free,synchronous]
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any, Callable

from forensics.capture import Guard
from forensics.capture.detection import sync as sync_check
from forensics.core import device_sync

# (label, depth): the order and nesting the table prints
LAYOUT = (
    ("record_batch", 0),
    ("RNG capture (python / numpy / torch CPU / CUDA states)", 1),
    ("step start (buffers copied before the forward)", 1),
    ("duplicate sample IDs", 1),
    ("record_loss", 0),
    ("model forward pre-hooks (autocast state)", 0),
    ("optimizer step pre/post hooks", 0),
    ("check", 0),
    ("check() calls look / answered / repeats", 1),
    ("synchronous check", 1),
    ("the read: host_numbers (waits for the backward)", 2),
    ("sync-free: resolve the previous step", 1),
    ("wait for the previous step's copy", 2),
    ("sync-free: start this step (device ops, copy)", 1),
    ("dump budget: spike_floor", 2),
    ("detectors (detect)", 1),
    ("history row (+ run log)", 1),
    ("run log row", 2),
    ("flight recorder entry", 1),
    ("Python's garbage collector (any caller: the whole step)", 0),
)


class Pieces:
    """Args:
    guard: the Guard to time.
    model_hooks: also time its forward pre-hook on the model; False for a torch.compile'd model (dynamo traces the
        hooks into the graph and would recompile for a wrapped one: their time is inside the compiled call).
    """

    def __init__(self, guard: Guard, model_hooks: bool = True):
        self.seconds: dict[str, float] = {label: 0.0 for label, _ in LAYOUT}
        self.cpu: dict[str, float] = {label: 0.0 for label, _ in LAYOUT}  # the calling thread's CPU time in them
        self._undo: list[Callable[[], None]] = []
        recorder, checks, calls = guard.recorder, guard.checks, guard.calls
        self._method(guard, "record_batch", "record_batch")
        self._method(guard, "record_loss", "record_loss")
        self._method(guard, "check", "check")
        self._method(recorder, "_capture_rng", "RNG capture (python / numpy / torch CPU / CUDA states)")
        self._method(recorder, "on_step_start", "step start (buffers copied before the forward)")
        self._method(recorder, "_note_duplicates", "duplicate sample IDs")
        for name in ("look", "answered", "repeats"):
            self._method(calls, name, "check() calls look / answered / repeats")
        self._method(checks.sync, "check", "synchronous check")
        self._method(checks.detectors, "detect", "detectors (detect)")
        self._method(guard.history, "append", "history row (+ run log)")
        if guard.history.listener is not None:
            self._method(guard.history, "listener", "run log row")
        self._method(guard.window, "append", "flight recorder entry")
        if checks.sync_free is not None:
            self._method(checks.sync_free, "resolve", "sync-free: resolve the previous step")
            self._method(checks.sync_free, "start", "sync-free: start this step (device ops, copy)")
            self._method(checks.sync_free, "spike_floor", "dump budget: spike_floor")
        self._function(sync_check, "host_numbers", "the read: host_numbers (waits for the backward)")
        self._function(device_sync.DeviceFence, "wait", "wait for the previous step's copy")
        if model_hooks:
            self._hooks(guard.model._forward_pre_hooks, "model forward pre-hooks (autocast state)", recorder)
        self._collecting = self._collecting_cpu = 0.0
        gc.callbacks.append(self._collector)
        self._undo.append(lambda: gc.callbacks.remove(self._collector))
        optimizer = guard.optimizer
        for hooks in (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks):
            self._hooks(hooks, "optimizer step pre/post hooks")

    def _collector(self, phase: str, info: dict) -> None:
        """gc.callbacks: a collection's wall time (it lands in whichever call allocated last, the Guard's or not)."""
        label = "Python's garbage collector (any caller: the whole step)"
        if phase == "start":
            self._collecting, self._collecting_cpu = time.perf_counter(), time.thread_time()
        elif self._collecting:
            self.seconds[label] += time.perf_counter() - self._collecting
            self.cpu[label] += time.thread_time() - self._collecting_cpu

    def _timed(self, call: Callable, label: str) -> Callable:
        seconds, cpu = self.seconds, self.cpu

        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, on_cpu = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                cpu[label] += time.thread_time() - on_cpu

        return timed

    def _method(self, owner: Any, name: str, label: str) -> None:
        had = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, self._timed(original, label))
        self._undo.append(lambda: setattr(owner, name, original) if had else delattr(owner, name))

    def _function(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        setattr(owner, name, self._timed(original, label))
        self._undo.append(lambda: setattr(owner, name, original))

    def _hooks(self, hooks: dict, label: str, owner: Any = None) -> None:
        """Wraps the hooks in `hooks` (a module's or an optimizer's hook dict); `owner`: only its bound methods."""
        originals = {k: h for k, h in hooks.items() if owner is None or getattr(h, "__self__", None) is owner}
        for key, hook in originals.items():
            hooks[key] = self._timed(hook, label)
        self._undo.append(lambda: hooks.update({k: v for k, v in originals.items() if k in hooks}))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def table(self, steps: int) -> str:
        """One line per piece that ran: microseconds per step, wall and the thread's CPU time (inclusive of the pieces
        indented below it; a CUDA wait spins, so it counts as CPU time too)."""
        head = f"  {'piece (per step)':<60} {'wall':>9}    {'CPU':>9}"
        return "\n".join(
            [head]
            + [
                f"  {'  ' * depth}{label:<{60 - 2 * depth}} {self.seconds[label] / steps * 1e6:9.1f} us "
                f"{self.cpu[label] / steps * 1e6:9.1f} us"
                for label, depth in LAYOUT
                if self.seconds[label] > 0
            ]
        )


def cpu_pieces(check: str, steps: int) -> str:
    """The pieces table of `steps` healthy steps on the CPU (module docstring), after 40 of warm-up. `check`: sync_free
    (AdamW fused) or synchronous (foreach)."""
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from forensics.capture import GuardConfig

    config = GPT2Config(n_layer=12, n_embd=128, n_head=4, n_positions=128, vocab_size=4096)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    fused = check == "sync_free"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(prefix="fx-pieces-")))
    data = [torch.randint(0, config.vocab_size, (2, 128)) for _ in range(4)]

    def step() -> None:
        for index, ids in enumerate(data):
            guard.record_batch({"input_ids": ids, "sample_ids": [2 * index, 2 * index + 1]})
            loss = model(input_ids=ids, labels=ids).loss
            guard.record_loss(loss)
            (loss / len(data)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.check(grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(40):
        step()
    pieces = Pieces(guard)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = time.perf_counter() - start
    table = pieces.table(steps)
    pieces.remove()
    guard.close()
    return (
        f"{check} check (AdamW {'fused' if fused else 'foreach'}): {steps} steps of {seconds / steps * 1e3:.1f} ms "
        f"(the timers included), per step:\n{table}"
    )


def main() -> None:
    import argparse
    import os

    import torch

    from scripts.bench.common import machine

    parser = argparse.ArgumentParser(description="the host time of each piece of the Guard's healthy step, on a CPU")
    parser.add_argument("--steps", type=int, default=200, help="steps timed (after 40 of warm-up)")
    parser.add_argument("--check", default="sync_free,synchronous", help="which checks: sync_free, synchronous")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    for check in args.check.split(","):
        print(cpu_pieces(check, args.steps))


if __name__ == "__main__":
    main()
