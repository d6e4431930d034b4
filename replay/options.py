"""What a replay does and what it may import (ReplayOptions), and the dump's step loaded as they say (`load`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forensics.format.limits import ArchiveLimits
from forensics.replay.load.session import ReplaySession, load_session


@dataclass
class ReplayOptions:
    """What `run_replay` does and what it may import."""

    device: str | None = None
    """"cuda:0", "cpu"; None: CUDA when present, else CPU."""
    trust: bool = False
    """Import the model factory / loss / optimizer class the dump names (CLI --trust)."""
    factory: str | None = None
    """"module:fn" returning the model, instead of the dump's recipe (CLI --factory)."""
    loss: str | None = None
    """"module:fn" with (model, batch) -> loss, instead of the dump's (CLI --loss)."""
    sys_path: list[str] = field(default_factory=list)
    """Directories put in front of sys.path for the imports above (CLI --path); with `trust`, the job's script and
    working directories recorded in the dump serve only imports nothing installed resolves (forensics.replay.load.recipe.job_paths)."""
    factory_kwargs: dict | None = None
    """Keyword arguments for the factory instead of the recorded ones (CLI --factory-kwargs); None: recorded."""
    loss_kwargs: dict | None = None
    """Keyword arguments for the loss instead of the recorded ones (CLI --loss-kwargs); None: recorded."""
    rank: int | None = None
    """Rank of a multi-rank step dump; None: the rank whose trigger fired, else the lowest."""
    max_attempts: int = 3
    """Full-step replays before giving up on reproducing (GPU kernels may be non-deterministic)."""
    fp32_check: bool = True
    """Re-run the culprit samples in fp32 to tell precision problems from data / model problems."""
    bisect: bool = True
    """Search for the smallest set of samples that still fails (ddmin)."""
    allow_neg_inf_masks: bool = True
    """-inf made by mask ops (masked_fill / where / full) is not reported as the first bad value."""
    max_per_sample: int = 64
    """At most this many samples get their own loss / grad-norm row (culprits always do)."""
    max_bisect_runs: int | None = 200
    """Hard cap on bisection replays (ddmin is quadratic when samples only fail together)."""
    shard_dirs: list[str] = field(default_factory=list)
    """Sharded dump written on several nodes: other nodes' directories with this step's rank dumps (--shards)."""
    archive_limits: ArchiveLimits | None = None
    """What unpacking a .tar.zst dump may produce (default forensics.format.limits.ArchiveLimits())."""
    from_checkpoint: str | None = None
    """Window replay (CLI --from): an earlier checkpoint to re-execute the recorded steps from
    (replay/run/window.py)."""
    from_step: int | None = None
    """The step the checkpoint was taken before (CLI --from-step; default: what the checkpoint says)."""
    window: bool = True
    """A dump holding the Guard's host snapshot (GuardConfig.recording.snapshot_every) and a data recipe: re-execute the
    recorded steps from the snapshot, as --from does with a checkpoint (needs trust: it imports the data
    recipe). CLI --no-window turns it off."""
    remedies: bool = True
    """Once reproduced, re-run the step under each applicable fix (drop samples, eps, fp32, loss scale, clip,
    lower LR, skip) and rank what makes it healthy; report block `remedies` (replay/judge/remedies.py)."""
    rng_check: bool = True
    """Once reproduced, re-run the step from a few other seeds (recorded RNG not restored) to tell
    whether the failure needs the dump's random state (a dropout mask); report block `rng`."""
    memory_budget: int | None = None
    """Bytes the replay may use on its device (CLI --memory-budget 16GiB; the CPU too). A state that does not fit them,
    or without a budget a GPU's free memory, is streamed block by block (replay/run/streamed_runner.py; report `stream`)."""
    host_cache_bytes: int | None = None
    """A streamed replay: host memory that keeps the blocks (in the dtype the passes compute in), so each byte is read
    from storage once and later passes only copy host to device (replay/load/host_cache.py). None: up to half the
    host's available memory on a GPU, for those copies alone; none on the CPU, whose memory --memory-budget holds;
    0: every pass reads the dump. Given, it may also hold the dump's fp32 values of blocks computed in bf16 (for the
    fp32 re-run) where it has room beyond the copies."""
    block_major: bool = True
    """A streamed replay runs a stage's forward-only passes together, each block brought to the device once for all
    of them (replay/run/lockstep.py: the bisection's look-ahead, the other seeds); False: one walk over the blocks per
    pass, the schedule before (scripts/bench/replay_stream.py measures both). The report is the same either way."""

    def __post_init__(self):
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(
                f"ReplayOptions.memory_budget must be a positive number of bytes, got {self.memory_budget}"
            )
        if self.host_cache_bytes is not None and self.host_cache_bytes < 0:
            raise ValueError(f"ReplayOptions.host_cache_bytes must be >= 0 bytes, got {self.host_cache_bytes}")
        if self.max_attempts < 1:
            raise ValueError(f"ReplayOptions.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_per_sample < 0:
            raise ValueError(f"ReplayOptions.max_per_sample must be >= 0, got {self.max_per_sample}")
        self.sys_path = [str(p) for p in self.sys_path]


def load(dump: Any, options: ReplayOptions, weights: bool = True) -> ReplaySession:
    """The dump's step as a live session, on the options' device, with their consent and user code (`weights`:
    False when a window replay's checkpoint holds the state instead)."""
    return load_session(
        dump,
        device=options.device,
        trust=options.trust,
        factory=options.factory,
        loss=options.loss,
        sys_path=options.sys_path,
        weights=weights,
        memory_budget=options.memory_budget,
        factory_kwargs=options.factory_kwargs,
        loss_kwargs=options.loss_kwargs,
        host_cache_bytes=options.host_cache_bytes,
    )


__all__ = ["ReplayOptions", "load"]
