"""The model's buffers as they were before the step's first forward.

BatchNorm's running statistics and `num_batches_tracked` (and any buffer a model updates in its forward) have
already changed when check() runs after backward: a dump taken then would hold the failing step's updates (NaN
running statistics after a NaN batch), not the pre-step state, and a skipped step would leave them in the
model. So at the step's first `record_batch` the persistent buffers (those in the state dict) are copied into
tensors allocated once and reused, with one fused copy on their device (no sync); the dump and the host
snapshots take these copies, and the 'skip' policy copies them back.

Above MAX_BYTES of buffers (not a BatchNorm-sized state) it turns itself off with one warning: the dump then
holds the buffers as check() sees them (docs/DUMP_FORMAT.md says which).
"""

from __future__ import annotations

import logging

import torch

from forensics.core.thirdparty import foreach_copy, is_persistent_buffer, own_buffers

log = logging.getLogger(__name__)

MAX_BYTES = 256 * 1024 * 1024
"""Buffers above this many bytes in all are not copied every step."""


class PreForwardBuffers:
    """Copies of the model's persistent buffers taken before the step's first forward."""

    def __init__(self, model: torch.nn.Module):
        self._slots: list[tuple[str, torch.nn.Module, str]] = []
        self._saved: list[torch.Tensor] = []
        self._taken_from: list[torch.Tensor] = []
        self.valid = False
        self.off = False
        try:
            names = set(model.state_dict(keep_vars=True))
            for prefix, module in model.named_modules(remove_duplicate=False):
                for attr, buffer in own_buffers(module).items():
                    name = f"{prefix}.{attr}" if prefix else attr
                    if buffer is not None and is_persistent_buffer(module, attr) and name in names:
                        self._slots.append((name, module, attr))
        except Exception as exc:  # noqa: BLE001 - an odd model must not stop the job: no buffer copies then
            self._slots = []
            self._turn_off(f"the model's buffers could not be listed ({type(exc).__name__}: {exc})")

    def tracks_any(self) -> bool:
        """Whether the model has persistent buffers this copies before each step (its forward may update them)."""
        return bool(self._slots) and not self.off

    def take(self) -> None:
        """Copies the buffers as they are now (call before the step's first forward)."""
        self.valid = False
        if self.off or not self._slots:
            return
        found = [own_buffers(module)[attr] for _, module, attr in self._slots]
        live = [t for t in found if t is not None]
        if len(live) != len(found):  # a module dropped a buffer: stop rather than guess
            self._turn_off("a buffer was removed from the model")
            return
        if [(t.shape, t.dtype, t.device) for t in live] != [(t.shape, t.dtype, t.device) for t in self._saved]:
            if sum(t.numel() * t.element_size() for t in live) > MAX_BYTES:
                self._turn_off(f"the model's buffers exceed {MAX_BYTES >> 20} MiB")
                return
            self._saved = [torch.empty_like(t) for t in live]
        _copy_all(self._saved, [t.detach() for t in live])
        self._taken_from = live
        self.valid = True

    def take_before_forward(self) -> None:
        """take() at the step's first record_batch, never raising: a failure turns the copies off for the run."""
        try:
            self.take()
        except Exception:  # a convenience: the dump then holds the buffers as check() sees them
            self.off = True
            log.exception("forensics: copying the model's buffers before the forward failed; not tried again")

    def undo_skipped_step(self, step: int) -> None:
        """A skipped step: its forward's updates to the buffers (BatchNorm running statistics) are undone too."""
        try:
            restored = self.restore()
            if restored:
                log.warning(
                    "forensics: step %d skipped; %d buffer(s) its forward had updated (e.g. BatchNorm running "
                    "statistics) are back to their values before the step",
                    step,
                    restored,
                )
        except Exception:
            log.exception("forensics: restoring the model's buffers after a skipped step failed")

    def before(self) -> dict[str, torch.Tensor]:
        """`{state-dict name: the buffer before the step's first forward}`, or {} when not taken this step."""
        if not self.valid:
            return {}
        return {name: saved for (name, _, _), saved in zip(self._slots, self._saved)}

    def restore(self) -> int:
        """Puts the pre-forward values back into the model's buffers (a skipped step); returns how many."""
        if not self.valid:
            return 0
        live = [own_buffers(module)[attr] for _, module, attr in self._slots]
        if any(a is not b for a, b in zip(live, self._taken_from)):
            return 0  # the model swapped a buffer object since: leave it
        _copy_all(self._taken_from, self._saved)  # the very tensors `live` holds
        return len(live)

    def _turn_off(self, why: str) -> None:
        self.off = True
        log.warning(
            "forensics: %s; dumps hold the buffers (e.g. BatchNorm running statistics) as check() sees "
            "them, after the step's forward, and a skipped step keeps their update",
            why,
        )


def _copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One fused copy per device and dtype where torch has one, else one copy per tensor."""
    with torch.no_grad():
        foreach_copy(destinations, sources)
