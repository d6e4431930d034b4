"""What is odd about a culprit sample's own data, in plain words, read from its replayed micro-batch (no model run).

Bisection says *which* sample breaks the step; these facts say *what* about it does, from its tensors alone,
against the other samples of the same micro-batch:
- its labels are all the ignore index (-100): a mean loss over zero tokens is 0/0 (or only its first label is
  not, and a causal LM's shifted loss drops that one);
- its attention mask is all zeros: no token (a mean over its tokens is 0/0; attention masks every score);
- a floating-point field holds NaN/Inf, or reaches values far beyond the other samples' (>= OUTLIER_RATIO x);
- a floating-point field is all zeros where the other samples' are not (a per-token weight or loss mask
  that sums to zero, an empty image, a zero target).
A fact states what the data holds, never a mechanism the loss may not have: whether an all-zero field divides
by zero is the verdict's to say, from the op the replay localised (replay/judge/verdict.py).
Each fact becomes the culprit's `description` in the report and the verdict's first suggestion. A batch
without a recognisable field gives no fact (the generic record hint stays). Field names come from the dump:
the renderers clean them before printing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from forensics.core.kinds import SampleFactKind
from forensics.report.wording import clean
from forensics.replay.run.execute import SampleRef, all_finite
from forensics.format.batch_tree import tensor_leaves
from forensics.replay.load.samples import batch_size, select_samples

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""The label value cross-entropy ignores (torch's and Hugging Face's default)."""
OUTLIER_RATIO = 100.0
"""A float field whose largest |value| is this many times the other samples' largest is named, before any other
fact about floats (an all-zero field beside it is named second)."""
LABEL_FIELDS = ("labels", "label", "targets", "target")
REPEAT_SHARE = 0.5
"""A token sequence is named when at least this share of its n-grams repeat one it already had ..."""
REPEAT_MARGIN = 0.3
"""... and that share is this much above every other sample's: a task whose every sample repeats itself (a copy
task, code) repeats in all of them alike, and none stands out."""
MIN_REPEAT_TOKENS = 16
MASK_FIELDS = ("attention_mask",)


@dataclass(frozen=True)
class SampleFact:
    """One odd thing about a sample's data: what kind, in which batch field, in words."""

    kind: SampleFactKind
    field: str
    words: str


def describe_samples(micro_batches: list[Any], refs: list[SampleRef]) -> dict[SampleRef, list[SampleFact]]:
    """The facts of each sample in `refs` (those with none are left out). Never raises: a batch it cannot read
    gives no facts."""
    found = {}
    for ref in refs:
        fellow = [r.index for r in refs if r.micro_batch == ref.micro_batch and r != ref]  # compared with the rest
        try:
            facts = sample_facts(micro_batches[ref.micro_batch], ref.index, exclude=fellow)
        except Exception as exc:  # noqa: BLE001 - a description is a bonus; the replay's findings stand
            log.debug("no data facts for sample %r: %s", ref.sample_id, exc)
            continue
        if facts:
            found[ref] = facts
    return found


def sample_facts(batch: Any, index: int, exclude: list[int] | tuple[int, ...] = ()) -> list[SampleFact]:
    """What is odd about sample `index` of `batch` (a micro-batch tree), most telling first, against the batch's
    other samples less `exclude` (the other culprits: two records carrying the same sentinel are each odd against
    the rest, not against each other)."""
    own = dict(tensor_leaves(select_samples(batch, [index])))
    others_batch = _others(batch, index, exclude)
    others = dict(tensor_leaves(others_batch)) if others_batch is not None else {}
    facts: list[SampleFact] = []
    for path, tensor in own.items():
        name = path.rsplit(".", 1)[-1].lower()
        if not tensor.numel():
            continue
        shown = clean(path, 60)
        if name in LABEL_FIELDS and not tensor.is_floating_point() and tensor.dtype != torch.bool:
            facts.extend(_labels(path, shown, tensor))
        elif name in MASK_FIELDS and not tensor.is_floating_point():
            if not bool(tensor.bool().any()):
                facts.append(
                    SampleFact(
                        SampleFactKind.NO_ATTENTION,
                        path,
                        f"its {shown} is all zeros: it has no token, so a mean over its tokens is 0/0 "
                        "and attention masks every score",
                    )
                )
        elif tensor.is_floating_point():
            facts.extend(_floats(path, shown, tensor, others.get(path)))
        elif tensor.dtype != torch.bool and name not in LABEL_FIELDS:
            facts.extend(_repeats(path, shown, tensor, others.get(path)))
    order = list(SampleFactKind)
    return sorted(facts, key=lambda f: order.index(f.kind))


def nonfinite_in_field(micro_batch: Any, refs: list[SampleRef], field: str) -> list[SampleRef]:
    """The samples of `refs` (all of this micro-batch) whose batch field `field` (a tensor_leaves path) holds
    NaN/Inf: where the first non-finite value is the batch's own data, the data names them (no bisection)."""
    out = []
    for ref in refs:
        tensor = dict(tensor_leaves(select_samples(micro_batch, [ref.index]))).get(field)
        if tensor is not None and tensor.is_floating_point() and not all_finite(tensor):
            out.append(ref)
    return out


def too_long(tokens: int, limit: int) -> SampleFact:
    """A sample longer than the model's context (found by replay/culprits/sizes.py from its attention mask)."""
    return SampleFact(
        SampleFactKind.TOO_LONG,
        "attention_mask",
        f"it is {tokens:,} tokens long, beyond the model's {limit:,} positions",
    )


def describe(facts: list[SampleFact]) -> str | None:
    """The report's one-line `description` of a sample."""
    return "; ".join(f.words for f in facts) or None


def _others(batch: Any, index: int, exclude: list[int] | tuple[int, ...] = ()) -> Any:
    rest = [i for i in range(batch_size(batch)) if i != index and i not in exclude]
    return select_samples(batch, rest) if rest else None


def _labels(path: str, shown: str, labels: torch.Tensor) -> list[SampleFact]:
    kept = labels != IGNORE_INDEX
    if not bool(kept.any()):
        return [
            SampleFact(
                SampleFactKind.LABELS_MASKED,
                path,
                f"every one of its {labels.numel():,} {shown} is {IGNORE_INDEX} (ignored): a mean loss "
                "over zero tokens is 0/0 = NaN",
            )
        ]
    if labels.dim() >= 2 and labels.shape[-1] > 1 and not bool(kept[..., 1:].any()):
        return [
            SampleFact(
                SampleFactKind.LABELS_MASKED,
                path,
                f"only the first of its {labels.shape[-1]:,} {shown} is not {IGNORE_INDEX}, and a "
                "causal LM's shifted loss drops the first: a mean over zero tokens is 0/0 = NaN",
            )
        ]
    return []


def repeated_share(tokens: torch.Tensor) -> float | None:
    """The share of a token sequence's n-grams (n = 8 from 64 tokens, else 4) that repeat an earlier one of it;
    None for a sequence too short to tell."""
    row = tokens.detach().reshape(-1).long().cpu()
    if row.numel() < MIN_REPEAT_TOKENS:
        return None
    n = 8 if row.numel() >= 64 else 4
    grams = row.unfold(0, n, 1)
    unique = int(torch.unique(grams, dim=0).shape[0])
    return 1.0 - unique / int(grams.shape[0])


def _repeats(path: str, shown: str, tokens: torch.Tensor, others: torch.Tensor | None) -> list[SampleFact]:
    """Long repeated n-grams (OLMo 2 traced gradient spikes to them), when the other samples do not repeat so."""
    own = repeated_share(tokens)
    if own is None or own < REPEAT_SHARE or others is None or not others.numel() or others.dim() < 1:
        return []
    shares = (
        [repeated_share(row) for row in others.reshape(others.shape[0], -1)]
        if others.dim() >= 2
        else [repeated_share(others)]
    )
    known = [v for v in shares if v is not None]
    if not known or own < max(known) + REPEAT_MARGIN:
        return []
    return [
        SampleFact(
            SampleFactKind.REPEATED_NGRAMS,
            path,
            f"{own:.0%} of its {shown} n-grams repeat one it already had, against at most "
            f"{max(known):.0%} in the other samples (long repeated sequences)",
        )
    ]


def _floats(path: str, shown: str, values: torch.Tensor, others: torch.Tensor | None) -> list[SampleFact]:
    values = values.detach().float()
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        nan = int(torch.isnan(values).sum())
        inf = int((~finite).sum()) - nan
        parts = [f"{n:,} {word}" for n, word in ((nan, "NaN"), (inf, "Inf")) if n]
        return [
            SampleFact(
                SampleFactKind.NONFINITE_VALUES,
                path,
                f"its {shown} holds {' and '.join(parts)} (of {values.numel():,} values)",
            )
        ]
    if others is None or not others.numel():
        return []
    other = others.detach().float()
    other_max = float(other[torch.isfinite(other)].abs().max()) if bool(torch.isfinite(other).any()) else 0.0
    own_max = float(values.abs().max())
    if other_max > 0 and own_max >= OUTLIER_RATIO * other_max:
        return [
            SampleFact(
                SampleFactKind.EXTREME_VALUES,
                path,
                f"its {shown} reaches {own_max:.3g}, {own_max / other_max:.3g}x the other samples' "
                f"largest ({other_max:.3g})",
            )
        ]
    if own_max == 0 and other_max > 0:
        return [SampleFact(SampleFactKind.ALL_ZERO, path, f"its {shown} is all zeros (the other samples' are not)")]
    return []
