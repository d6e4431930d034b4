"""Run, streamed: several forward-only passes of one stage run block-major, each block brought to the device once for
all of them (FlexGen's block schedule, for a model whose forward is the user's code and cannot be cut into blocks).

`Lockstep.run(jobs)` runs each job (one forward-only pass: StepRunner.run(..., backward=False)) on a thread of its
own, one thread at a time (a baton). A pass that needs a block the streamer does not hold (BlockStreamer.acquire
asks `need`) hands the baton to the next pass; once every pass waits, the lowest block they wait for is
materialised, once, and each pass waiting for it runs through it in turn, in the jobs' order. Every pass computes
what it would alone: the global RNG states (torch, CUDA, Python, numpy) are each pass's own, saved when it hands the
baton on and put back when it gets it again; grad mode and autocast are per thread already; what each pass sets
up for the process and tears down at its end (the warnings filters, FSDP2's compute dtypes: StreamedStepRunner
counts its users) is put back once, when the last pass is over. The passes run without
autograd (their values are the same; each keeps only its current hidden state, not every block's inputs).

Backward passes are not run this way: the autograd engine runs a CUDA graph's backward on one device thread, which a
waiting pass would block.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Sequence, TypeVar

import torch

from forensics.core.rng import capture_rng, restore_rng

T = TypeVar("T")


class Lockstep:
    """Forward-only passes run together, block by block (see the module's docstring)."""

    def __init__(self, holds: Callable[[int], bool], device: torch.device):
        self._holds, self.device = holds, device
        self._cond = threading.Condition()
        self._count = 0
        self._turn: int | None = None
        self._waiting: dict[int, int] = {}
        """Pass -> the block it waits for."""
        self._done: set[int] = set()
        self._ids: dict[int, int] = {}
        """Thread ident -> its pass."""
        self.waits = 0
        """Times a pass handed the baton on to wait for a block."""

    def run(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """Each job's result, in order; the first exception a job raised is raised once every job is over."""
        self._count, self._turn = len(jobs), None
        self._waiting.clear()
        self._done.clear()
        self._ids.clear()
        results: list = [None] * len(jobs)
        errors: list[BaseException | None] = [None] * len(jobs)
        start = capture_rng()
        last = [start]
        filters, show = warnings.filters[:], warnings.showwarning

        def task(number: int) -> None:
            with self._cond:
                self._ids[threading.get_ident()] = number
                self._cond.wait_for(lambda: self._turn == number)
            try:
                if self.device.type == "cuda":  # a thread starts on cuda:0, whatever the replay's device
                    torch.cuda.set_device(self.device)
                restore_rng(start)  # each pass starts from the same state (the jobs restore or seed their own)
                with torch.no_grad():
                    results[number] = jobs[number]()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors[number] = exc
            finally:
                last[0] = capture_rng()
                with self._cond:
                    self._done.add(number)
                    self._waiting.pop(number, None)
                    self._pass_on(number)

        threads = [
            threading.Thread(target=task, args=(n,), name=f"forensics-lockstep-{n}", daemon=True)
            for n in range(len(jobs))
        ]
        for thread in threads:
            thread.start()
        with self._cond:
            self._turn = 0 if jobs else None
            self._cond.notify_all()
        for thread in threads:
            thread.join()
        self._ids.clear()
        # each pass entered and left warnings.catch_warnings (StepRunner.run) at its own time: not nested, they
        # leave the process-wide filters of whichever entered first; put back what was there, as catch_warnings does
        warnings.filters, warnings.showwarning = filters, show
        getattr(warnings, "_filters_mutated", lambda: None)()  # the filters' cache invalidated (CPython's own hook)
        restore_rng(last[0])  # as after the last pass run alone
        for error in errors:
            if error is not None:
                raise error
        return results

    def need(self, index: int) -> None:
        """Called before a block is materialised: a pass (of this lockstep) needing a block the streamer does not
        hold waits until every pass does, then runs through it when its turn comes; anything else goes on."""
        number = self._ids.get(threading.get_ident())
        if number is None or self._holds(index):
            return
        saved = capture_rng()
        with self._cond:
            self.waits += 1
            self._waiting[number] = index
            self._pass_on(number)
            self._cond.wait_for(lambda: self._turn == number)
        restore_rng(saved)

    def _pass_on(self, me: int) -> None:
        """The baton to the next pass after `me` that can run; when all wait, to the first of those waiting for the
        lowest block (each of them runs through it in turn). Called with the lock held."""
        order = [(me + step) % self._count for step in range(1, self._count + 1)]
        ready = [n for n in order if n not in self._done and n not in self._waiting]
        if not ready and self._waiting:
            lowest = min(self._waiting.values())
            ready = sorted(n for n, index in self._waiting.items() if index == lowest)
            for n in ready:
                del self._waiting[n]
        self._turn = ready[0] if ready else None
        self._cond.notify_all()


__all__ = ["Lockstep"]
