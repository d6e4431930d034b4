"""The report as a tree of dataclasses (docs/REPORT_FORMAT.md): what the renderers and writers read.

`parse_report(d)` is the one parser of a report dict (the replay engine's, or report.json read back, older majors
included); `Report.as_dict()` serialises the tree to the same keys, in the same order, so a report read and
written again is the same JSON byte for byte. A report is untrusted text once it is on disk: parsing never
raises. Each block keeps what it does not know — keys a newer writer added (`extra`), a section of the wrong
JSON type (written back as it came, read as missing) — and which of its keys were present, so a key that was
absent stays absent.

Numbers stay as the JSON holds them (a float, or "nan" / "inf" / "-inf": forensics.report.as_float decodes
them); kinds stay strings (an older or newer report may hold one this forensics does not know: compare with the
kinds of forensics.core.kinds, which are str Enums).

    Report ─ dump: DumpInfo (damaged: [Damage])     ─ trigger: TriggerBlock (TriggerBlock.of(Trigger))
           ─ environment: Environment (capture: CaptureEnv, replay: ReplayEnv)    ─ fidelity: Fidelity
           ─ verdict: Verdict   ─ culprit: Culprit (samples: [CulpritSample], stats: Stats)   ─ rng: RngCheck
           ─ precision: Precision   ─ bisection: Bisection   ─ per_sample: [SampleRow]   ─ per_layer: [LayerRow]
           ─ history: History   ─ timings: Timings   ─ exception: ExceptionBlock (bad_values, memory)
           ─ remedies: Remedies ([RemedyRow (following)])   ─ window: Window ([WindowStep])
           ─ precursor: Precursor (fired, ranking, series)   ─ repro: Repro
           ─ weights, margin, precursor_history, stream: JSON objects (no renderer reads into them)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Mapping, TypeVar

from forensics.core.trigger import Trigger
from forensics.report.model import to_json_safe

N = TypeVar("N", bound="Node")


def _node(cls: type[Node], always: bool = False) -> Any:
    """A field holding a block: `always` ones read as an empty block when absent (the renderers' "n/a")."""
    return field(
        default_factory=(lambda: cls.parse({})) if always else (lambda: None), metadata={"node": cls, "always": always}
    )


def _rows(cls: type) -> Any:
    """A field holding a list of blocks (table rows); anything in it that is not an object is kept, not read."""
    return field(default_factory=list, metadata={"rows": cls})


@dataclass
class Node:
    """A block of the report: its fields are the keys docs/REPORT_FORMAT.md lists for it."""

    extra: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)
    """Keys this forensics does not know (a newer writer's), in their order."""
    _keys: tuple | None = field(default=None, repr=False, compare=False, kw_only=True)
    """The keys the source held, in order (None: built in code: every field, in field order)."""
    _raw: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)
    """Known keys whose value was not of the block's type: written back as they came."""

    _BOOKKEEPING: ClassVar[frozenset] = frozenset({"extra", "_keys", "_raw"})

    @classmethod
    def _fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.name not in Node._BOOKKEEPING]

    @classmethod
    def parse(cls: type[N], data: Mapping) -> N:
        """The block of a JSON object (a Mapping); never raises."""
        known = {f.name: f for f in cls._fields()}
        values: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        for name, f in known.items():
            if name not in data:
                continue
            value = data[name]
            if "node" in f.metadata:
                if isinstance(value, Mapping):
                    values[name] = f.metadata["node"].parse(value)
                elif value is not None or f.metadata["always"]:
                    raw[name] = value
            elif "rows" in f.metadata:
                if isinstance(value, list):
                    values[name] = [f.metadata["rows"].parse(v) for v in value if isinstance(v, Mapping)]
                    if len(values[name]) != len(value):
                        raw[name] = value
                else:
                    raw[name] = value
            else:
                values[name] = value
        node = cls(**values)
        node.extra = {k: v for k, v in data.items() if k not in known}
        node._keys = tuple(data)
        node._raw = raw
        return node

    @classmethod
    def built(cls: type[N], **values: Any) -> N:
        """A block built in code holding the keys given, in the order given, and no other (the constructor's block
        holds every field, in field order): a key left out stays absent from its JSON until its field is set."""
        node = cls(**values)
        node._keys = tuple(values)
        return node

    def as_dict(self) -> dict:
        """The block as JSON: its keys in the order they were read (or field order), absent keys left out."""
        fields = {f.name: f for f in self._fields()}
        if self._keys is None:
            keys = [*fields, *(k for k in self.extra if k not in fields)]
        else:
            keys = [*self._keys, *(n for n, f in fields.items() if n not in self._keys and self._set(f))]
        out = {}
        for key in keys:
            if key in self._raw:
                out[key] = self._raw[key]
            elif key in fields:
                out[key] = _json(getattr(self, key))
            elif key in self.extra:
                out[key] = self.extra[key]
        return out

    def __bool__(self) -> bool:
        """False for a block with no key, as for an empty JSON object."""
        return bool(self.as_dict())

    def _set(self, f: dataclasses.Field) -> bool:
        """A field the source did not hold has a value of its own since (set in code)."""
        value = getattr(self, f.name)
        return value is not None and value != [] and not (isinstance(value, Node) and not value.as_dict())


def _json(value: Any) -> Any:
    if isinstance(value, Node):
        return value.as_dict()
    if isinstance(value, Enum):  # a kind set in code (forensics.core.kinds): its value, as report.json holds it
        return value.value
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


# -- the blocks, in the order of docs/REPORT_FORMAT.md -------------------------------------------------------------


@dataclass
class Damage(Node):
    file: Any = None
    problem: Any = None
    lost: Any = None


@dataclass
class DumpInfo(Node):
    """`dump`: which dump was replayed."""

    path: str | None = None
    run_id: str | None = None
    step: int | None = None
    rank: int | None = None
    world_size: int | None = None
    missing_ranks: list | None = None
    num_micro_batches: int | None = None
    damaged: list[Damage] = _rows(Damage)


@dataclass
class TriggerBlock(Node):
    """`trigger`: what fired in the training job (JSON micro-batch 0-based; `detail` as the detector wrote it)."""

    kind: str | None = None
    value: float | str | None = None
    threshold: float | str | None = None
    micro_batch: int | None = None
    detail: str | None = None

    @classmethod
    def of(cls, trigger: Trigger) -> "TriggerBlock":
        """The one builder of the report's trigger block; a non-finite value as report.json holds it ("nan")."""
        value, threshold = to_json_safe([trigger.value, trigger.threshold])
        return cls(trigger.kind.value, value, threshold, trigger.micro_batch, trigger.detail)


@dataclass
class CaptureEnv(Node):
    """`environment.capture`: the manifest's environment, verbatim (the fields the renderers show)."""

    python: Any = None
    torch: Any = None
    cuda: Any = None
    gpus: Any = None
    hostname: Any = None
    git_commit: Any = None
    cwd: Any = None
    """The job's working directory; with --trust, replay imports modules missing here from it (and script_dir)."""
    script_dir: Any = None


@dataclass
class ReplayEnv(Node):
    device: Any = None
    torch: Any = None
    gpu: Any = None
    python: Any = None
    cuda: Any = None
    hostname: Any = None


@dataclass
class Environment(Node):
    capture: CaptureEnv = _node(CaptureEnv, always=True)
    replay: ReplayEnv = _node(ReplayEnv, always=True)
    warnings: list | None = None


@dataclass
class Fidelity(Node):
    """`fidelity`: how closely the replay matched the recorded step (`mode`: forensics.core.kinds.FidelityMode)."""

    mode: str | None = None
    tolerance: Any = None
    attempts: int | None = None
    recorded_losses: list | None = None
    replayed_losses: list | None = None
    max_abs_diff: Any = None
    recorded_grad_norm: Any = None
    replayed_grad_norm: Any = None
    bitwise_equal: bool | None = None
    grad_norm_compared: bool | None = None
    grad_norm_reason: str | None = None
    reason: str | None = None
    """`not_replayed`: why nothing was re-run."""
    diverged: dict | None = None
    """A non-finite gradient norm replayed finite but reproduced as the run's divergence (the verdict's rule,
    replay/judge/verdict_facts.diverged_here): replayed_grad_norm, healthy_grad_norm, times_healthy, recorded_loss,
    replayed_loss, bar_times_healthy (the bar each sample crossed alone), samples_over, sample_grad_norms ([smallest,
    largest]). Absent otherwise."""


@dataclass
class RngCheck(Node):
    checked: bool | None = None
    seeds: list | None = None
    failed: list | None = None
    rng_dependent: bool | None = None


@dataclass
class Verdict(Node):
    """`verdict`: what the replay concludes (built by forensics.replay.judge.verdict.decide_verdict)."""

    kind: str | None = None
    """A forensics.core.kinds.VerdictKind when the replay built it (a str Enum); the string as read from a report.json
    (which may hold a kind this forensics does not know)."""
    headline: str | None = None
    explanation: str | None = None
    suggestions: list | None = None


@dataclass
class CulpritSample(Node):
    sample_id: Any = None
    micro_batch: int | None = None
    index: int | None = None
    rank: int | None = None
    positional: bool | None = None
    description: str | None = None
    trigger: bool | None = None
    """Named as the sample that crossed first, not as bad data (verdict trigger_sample): never in a blocklist."""
    shared_with: list | None = None
    """Other positions of the step whose sample carries this one's ID and is not blamed ([{"micro_batch", "index"}]):
    filtering the ID would drop them too, so no blocklist lists it."""


@dataclass
class Stats(Node):
    inputs_absmax: Any = None
    outputs_absmax: Any = None
    params_absmax: Any = None


@dataclass
class Culprit(Node):
    samples: list[CulpritSample] = _rows(CulpritSample)
    module: str | None = None
    op: str | None = None
    phase: str | None = None
    parameter: str | None = None
    optimizer_state: str | None = None
    stats: Stats = _node(Stats, always=True)
    traceback: str | None = None

    def ids(self) -> list:
        """The culprit samples' ids, in report order, without duplicates."""
        ids: list = []
        for s in self.samples:
            if (s._keys is None or "sample_id" in s._keys) and s.sample_id not in ids:
                ids.append(s.sample_id)
        return ids


@dataclass
class Precision(Node):
    autocast_dtype: str | None = None
    fp32_reproduces: bool | None = None
    fsdp_param_dtype: str | None = None
    fp32_ran: dict | None = None
    """What the fp32 re-run ran (replay/run/fp32.py): compute ops by dtype, and what was held to float32."""
    code_dtypes: dict | None = None


@dataclass
class Bisection(Node):
    runs: int | None = None
    candidates: int | None = None
    culprit_size: int | None = None
    budget: int | None = None
    test: str | None = None
    unblamed_group: int | None = None
    independent_groups: int | None = None
    all_subsets_fail: bool | None = None


@dataclass
class SampleRow(Node):
    sample_id: Any = None
    micro_batch: int | None = None
    index: int | None = None
    loss: Any = None
    grad_norm: Any = None
    finite: bool | None = None
    error: str | None = None


@dataclass
class LayerRow(Node):
    module: str | None = None
    grad_norm: Any = None
    output_absmax: Any = None


@dataclass
class History(Node):
    step: list | None = None
    loss: list | None = None
    grad_norm: list | None = None
    signals: list | None = None
    diverged: str | None = None
    shows: list | None = None


@dataclass
class Timings(Node):
    total_s: Any = None
    passes: int | None = None


@dataclass
class BadValue(Node):
    value: Any = None
    limit: Any = None
    sample_id: Any = None
    position: Any = None


@dataclass
class MicroBatchBytes(Node):
    index: int | None = None
    bytes: Any = None


@dataclass
class Memory(Node):
    allocated: Any = None
    reserved: Any = None
    total: Any = None
    micro_batches: list[MicroBatchBytes] = _rows(MicroBatchBytes)


@dataclass
class ExceptionBlock(Node):
    """`exception` (major 2): what the job raised, and where the replay raised it."""

    type: str | None = None
    message: str | None = None
    during: str | None = None
    module: str | None = None
    op: str | None = None
    detail: str | None = None
    bad_values: list[BadValue] = _rows(BadValue)
    memory: Memory | None = _node(Memory)
    traceback: str | None = None


@dataclass
class Following(Node):
    tested: bool | None = None
    healthy: bool | None = None
    steps: list | None = None
    first_unhealthy: int | None = None


@dataclass
class RemedyRow(Node):
    kind: str | None = None
    words: str | None = None
    change: str | None = None
    healthy: bool | None = None
    step_loss: Any = None
    grad_norm: Any = None
    weights_finite: bool | None = None
    relative_change: Any = None
    note: str | None = None
    following: Following | None = _node(Following)


@dataclass
class Remedies(Node):
    tested: list[RemedyRow] = _rows(RemedyRow)
    criteria: str | None = None
    following_steps: str | None = None


@dataclass
class WindowStep(Node):
    step: int | None = None
    recorded_loss: Any = None
    replayed_loss: Any = None
    recorded_grad_norm: Any = None
    replayed_grad_norm: Any = None
    weights_finite: bool | None = None
    relative_change: Any = None
    broke: str | None = None


@dataclass
class Window(Node):
    checkpoint: str | None = None
    from_step: int | None = None
    broke_at: int | None = None
    why: str | None = None
    steps: list[WindowStep] = _rows(WindowStep)


@dataclass
class PrecursorFired(Node):
    layer: Any = None
    statistic: Any = None
    step: Any = None
    started: Any = None


@dataclass
class PrecursorRow(Node):
    layer: Any = None
    statistic: Any = None
    words: Any = None
    started: Any = None
    baseline: Any = None
    last: Any = None
    growth: Any = None
    values: list | None = None
    """`series` rows only: one value per recorded step."""


@dataclass
class Precursor(Node):
    """`precursor` (major 3): a precursor dump's statistics that grew, ranked."""

    fired: PrecursorFired | None = _node(PrecursorFired)
    ranking: list[PrecursorRow] = _rows(PrecursorRow)
    ranked: int | None = None
    columns: int | None = None
    steps: list | None = None
    series: list[PrecursorRow] = _rows(PrecursorRow)


@dataclass
class Repro(Node):
    directory: str | None = None
    files: dict | None = None
    op: str | None = None


@dataclass
class Report(Node):
    """The whole report. Built by the replay (forensics.replay.judge.assemble) or read by `parse_report`; `as_dict()` is
    report.json's content."""

    schema: str | None = None
    created_at: str | None = None
    dump: DumpInfo = _node(DumpInfo, always=True)
    trigger: TriggerBlock = _node(TriggerBlock, always=True)
    environment: Environment = _node(Environment, always=True)
    reproduced: bool | None = None
    fidelity: Fidelity = _node(Fidelity, always=True)
    rng: RngCheck | None = _node(RngCheck)
    verdict: Verdict = _node(Verdict, always=True)
    culprit: Culprit = _node(Culprit, always=True)
    precision: Precision | None = _node(Precision)
    bisection: Bisection | None = _node(Bisection)
    per_sample: list[SampleRow] = _rows(SampleRow)
    per_layer: list[LayerRow] = _rows(LayerRow)
    history: History | None = _node(History)
    history_pattern: str | None = None
    timings: Timings | None = _node(Timings)
    exception: ExceptionBlock | None = _node(ExceptionBlock)
    weights: dict | None = None
    remedies: Remedies | None = _node(Remedies)
    window: Window | None = _node(Window)
    precursor: Precursor | None = _node(Precursor)
    stream: dict | None = None
    precursor_history: dict | None = None
    margin: dict | None = None
    evidence: dict | None = None
    """Whether the culprits' records are bad data or triggers (replay/culprits/evidence.py)."""
    silent: dict | None = None
    """A silent-corruption dump's classification (major 5; replay/judge/silent.py): class, rank, device, where the
    computations part."""
    repro: Repro | None = _node(Repro)
    # a key set in code after the report was read goes after the keys read, in this order (the engine's: the
    # stream of a streamed replay, then the crash's precursor history; repro last, by `forensics repro --report`)


def parse_report(data: Mapping | Report) -> Report:
    """The one parser of a report: the replay engine's dict, or report.json read back (any major); never raises
    (forensics.report.validate_report says whether it is a valid report)."""
    if isinstance(data, Report):
        return data
    return Report.parse(data if isinstance(data, Mapping) else {})
