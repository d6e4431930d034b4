"""Offline replay of a dumped training step: load -> reproduce -> localise -> bisect -> precision -> verdict.

Runs on one GPU or the CPU; never imported by `capture`. `engine.py` runs the stages, one sub-package each:
`load/` (dump -> live session), `run/` (re-execute the step), `localize/` (where it first fails),
`culprits/` (which samples), `judge/` (precision, remedies, history -> verdict and report); `repro.py` is
`forensics repro`. Public names (imported lazily, so that
`import forensics.replay.load.samples` stays light):

    run_replay(dump_or_path, ReplayOptions(...), progress=None) -> report dict   (forensics.replay.engine)
    run_session(session, options) -> report dict for an in-memory ReplaySession  (forensics.replay.engine)
    load_session(dump, device=, trust=, factory=, loss=, sys_path=) -> ReplaySession  (forensics.replay.load.session)
    session_from_objects(model, micro_batches, loss_fn, optimizer, ...) -> ReplaySession  (forensics.replay.load.session)
    StepRunner, StepResult, SampleRef, reproduce                                   (forensics.replay.run.execute)

Consent: a dump's model factory / loss / optimizer class is imported only with trust=True (CLI --trust)
or when the user names the code (factory= / loss=, CLI --factory / --loss). Built-in recipes
(forensics.recipes.BUILTIN_RECIPES) and torch.optim classes are forensics' / torch's own code and need
no trust.
"""

from __future__ import annotations

from forensics.core.lazy import lazy_exports

_EXPORTS = {
    "run_replay": "forensics.replay.engine",
    "run_session": "forensics.replay.engine",
    "ReplayOptions": "forensics.replay.engine",
    "load_session": "forensics.replay.load.session",
    "session_from_objects": "forensics.replay.load.session",
    "ReplaySession": "forensics.replay.load.session",
    "StepRunner": "forensics.replay.run.execute",
    "StepResult": "forensics.replay.run.execute",
    "SampleRef": "forensics.replay.run.execute",
    "reproduce": "forensics.replay.run.execute",
}

__all__ = list(sorted(_EXPORTS))  # a list literal's type for linters

__getattr__ = lazy_exports(__name__, _EXPORTS)
