"""What the replay stages found, as typed values: each stage of replay/engine.py returns one, and
replay/judge/assemble.py builds the report (and the verdict's facts) from them in one place.

Each finding's type lives with the stage that makes it (ForwardFinding, BackwardFinding in
replay/localize/forward_backward.py; OptimizerFinding and LayerRow in replay/localize/update.py; CorruptedWeight
in replay/localize/weights.py; SizeSummary in replay/culprits/sizes.py). The stages whose output is itself a
report block or table (the fp32 triage, the random-state check, the per-layer and per-sample tables, the
remedies) return it as a TypedDict whose keys are those of docs/REPORT_FORMAT.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forensics.core.kinds import HistoryPattern, Phase, TriggerKind
from forensics.core.trigger import Trigger
from forensics.replay.culprits.evidence import RecordEvidence
from forensics.replay.culprits.margin import MarginBlock
from forensics.replay.culprits.per_sample import SampleRow
from forensics.replay.culprits.sample_facts import SampleFact
from forensics.replay.culprits.sizes import SizeSummary
from forensics.replay.judge.history_pattern import HistoryReading, read_history
from forensics.replay.judge.precision import PrecisionBlock
from forensics.replay.judge.remedies import RemediesBlock
from forensics.replay.localize.exception import ExceptionFinding
from forensics.replay.localize.forward_backward import BackwardFinding, ForwardFinding
from forensics.replay.localize.update import LayerRow, OptimizerFinding
from forensics.replay.localize.weights import CorruptedWeight
from forensics.replay.run.execute import Reproduction, SampleRef
from forensics.replay.run.rng_dependence import RngBlock

if TYPE_CHECKING:  # the stage's module imports the runner
    from forensics.replay.culprits.earlier_state import EarlierRows


@dataclass
class Bisection:
    """Which samples make the step fail (ddmin, confirmed by removal)."""

    culprits: list[SampleRef]
    block: dict | None
    """The report's `bisection` block (None: not run)."""
    all_failed: bool = False
    """Every subset tried failed: no sample is to blame."""

    @property
    def independent_groups(self) -> int:
        return (self.block or {}).get("independent_groups", 0)

    @property
    def unblamed_group(self) -> int:
        """The size of the smallest failing set when it was too large a share of the step to blame (else 0)."""
        return (self.block or {}).get("unblamed_group", 0)

    @property
    def runs(self) -> int | None:
        return (self.block or {}).get("runs")


@dataclass
class HistoryFinding:
    """The recorded loss / grad-norm history: the report's `history` block, its pattern and signals."""

    block: dict | None
    pattern: HistoryPattern
    signals: list[str] = field(default_factory=list)
    diverged: str | None = None
    """A sentence when the whole run (since step 0) was far off long before the dumped step."""
    reading: HistoryReading = field(default_factory=lambda: read_history(None, None))
    """What the history shows before the analysed step, with numbers from before the divergence."""


@dataclass
class Findings:
    """Everything one replay found, stage by stage (engine order)."""

    kind: TriggerKind
    trigger: Trigger
    threshold: float | None
    reproduction: Reproduction
    reproduced: bool
    optimizer: OptimizerFinding | None = None
    rng: RngBlock | None = None
    forward: ForwardFinding | None = None
    backward: BackwardFinding | None = None
    phase: Phase | None = None
    per_layer: list[LayerRow] = field(default_factory=list)
    bisection: Bisection = field(default_factory=lambda: Bisection([], None))
    precision: PrecisionBlock | None = None
    margin: MarginBlock | None = None
    """How close the step comes to fp16's limit without the samples bisection named (replay/culprits/margin.py)."""
    per_sample: list[SampleRow] = field(default_factory=list)
    history: HistoryFinding = field(default_factory=lambda: HistoryFinding(None, HistoryPattern.INSUFFICIENT_HISTORY))
    exception: ExceptionFinding | None = None
    """trigger exception: where the replayed step raised."""
    weights_nonfinite: list[str] = field(default_factory=list)
    """Parameters that hold NaN/Inf before the step (named_parameters order)."""
    corrupted: list[CorruptedWeight] = field(default_factory=list)
    """Per such parameter: counts and bad slices (replay/localize/weights.py)."""
    remedies: RemediesBlock | None = None
    """The report's `remedies` block: each counterfactual fix tried on the step, ranked (replay/judge/remedies.py)."""
    touching: dict[str, list[SampleRef]] | None = None
    """Corrupted embedding -> the samples whose ids hit its bad rows (None: no corrupted embedding)."""
    sizes: SizeSummary | None = None
    """Out of memory: the step's sample sizes, largest and outliers (replay/culprits/sizes.py; report
    exception.sizes)."""
    evidence: RecordEvidence | None = None
    """Whether the culprits' records are bad data or triggers (replay/culprits/evidence.py); None: no culprit."""
    norm_overflow: float | None = None
    """Every gradient finite but their norm not: the largest |gradient| (forensics.replay.run.execute.StepResult.norm_overflow)."""
    sample_facts: dict[SampleRef, list[SampleFact]] = field(default_factory=dict)
    """What is odd in each culprit's own data (replay/culprits/sample_facts.py): the report's sample `description`."""
    earlier_rows: EarlierRows | None = None
    """A NaN gradient norm replayed finite: the step's samples alone on an earlier state (the Guard's host snapshot,
    the window's checkpoint), which tells a broken state from a batch of bad records (verdict_facts.diverged_here)."""

    @property
    def culprits(self) -> list[SampleRef]:
        return self.bisection.culprits
