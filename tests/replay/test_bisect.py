"""Tests for replay/culprits/bisect.py: ddmin finds the culprit samples within the run budget."""

import math
import random

import torch

from forensics.replay.culprits.bisect import ddmin
from forensics.replay.load.samples import select_samples


class CountingPredicate:
    """Wraps a predicate, records every call so tests can check runs and memoisation."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __call__(self, subset):
        self.calls.append(tuple(subset))
        return self.fn(subset)


def test_one_culprit_among_32_within_14_runs_wherever_it_is():
    for culprit in range(32):
        pred = CountingPredicate(lambda s, c=culprit: c in s)
        result = ddmin(list(range(32)), pred)
        assert result.culprits == [culprit]
        assert result.runs == len(pred.calls) <= 14 and result.runs <= result.budget  # the report states the budget
        assert len(set(pred.calls)) == len(pred.calls), "a subset was replayed twice"
        assert result.minimal and not result.all_failed


def test_one_culprit_costs_a_binary_search_for_every_size_within_the_reported_budget():
    """One culprit among n costs at most 2 runs per halving (replay/culprits/bisect.py), and never more than the
    budget the report prints; a micro-batch twice as large costs at most 2 more runs."""
    worst = {}
    for n in range(2, 70):
        runs = []
        for culprit in range(n):
            result = ddmin(list(range(n)), lambda s, c=culprit: c in s)
            assert result.culprits == [culprit]
            assert result.runs <= result.budget, (n, culprit, result.runs, result.budget)
            runs.append(result.runs)
        worst[n] = max(runs)
        assert worst[n] <= 2 * math.ceil(math.log2(n)), (n, worst[n])
    assert all(worst[2 * n] <= worst[n] + 2 for n in range(2, 35))


def test_pair_that_fails_only_together_is_found_as_that_pair():
    pred = CountingPredicate(lambda s: 5 in s and 26 in s)
    result = ddmin([f"id-{i}" for i in range(32)], lambda s: pred([int(x[3:]) for x in s]))
    assert result.culprits == ["id-5", "id-26"]
    assert len(set(pred.calls)) == len(pred.calls) == result.runs


def test_two_fp16_samples_that_overflow_a_batch_sum_only_together():
    """Real torch: each sample alone sums to ~40 000, two together exceed fp16's max of 65 504."""
    torch.manual_seed(0)
    x = torch.rand(16, 8)
    x[3, 0] = 40000.0
    x[11, 2] = 40000.0
    linear = torch.nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    linear = linear.half()

    def fails(indices):
        out = linear(select_samples(x, indices).half()).sum()
        return not torch.isfinite(out).item()

    assert fails(list(range(16)))
    result = ddmin(list(range(16)), fails)
    assert result.culprits == [3, 11]
    assert not fails([3]) and not fails([11])


def test_all_zero_sample_breaks_layernorm_without_eps_real_model():
    """Real torch: LayerNorm(eps=0) of an all-zero input is 0/0; bisect over real backward passes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(16, eps=0.0), torch.nn.Linear(16, 4))
    batch = {"x": torch.randn(32, 16), "y": torch.randint(0, 4, (32,)), "sample_ids": [f"rec-{i}" for i in range(32)]}
    batch["x"][21] = 0.0

    def fails(indices):
        sub = select_samples(batch, indices)
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(sub["x"]), sub["y"])
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        return not (torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads))

    assert fails(list(range(32)))
    result = ddmin(list(range(32)), fails)
    assert [batch["sample_ids"][i] for i in result.culprits] == ["rec-21"]
    assert result.runs <= 14


def test_every_subset_failing_reports_all_failed():
    result = ddmin(list(range(16)), lambda s: True)
    assert result.all_failed and len(result.culprits) == 1 and result.runs >= 2


def test_is_one_minimal_for_random_monotone_predicates():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 40)
        family = [frozenset(rng.sample(range(n), rng.randint(1, min(3, n)))) for _ in range(rng.randint(1, 3))]
        pred = CountingPredicate(lambda s, fam=family: any(f <= set(s) for f in fam))
        result = ddmin(list(range(n)), pred)
        culprits = set(result.culprits)
        assert any(f <= culprits for f in family)
        for c in culprits:
            assert not any(f <= culprits - {c} for f in family), (n, family, result.culprits)
        assert len(set(pred.calls)) == len(pred.calls) == result.runs
        if len(family) == 1:
            assert culprits == set(family[0])


def test_is_one_minimal_for_random_non_monotone_predicates():
    rng = random.Random(99)
    for trial in range(200):
        n = rng.randint(2, 24)
        p_fail = rng.choice([0.1, 0.3, 0.6])
        answers = {}

        def fails(s, answers=answers, seed=trial, p=p_fail):
            key = frozenset(s)
            if key not in answers:
                answers[key] = random.Random(hash((seed, tuple(sorted(key))))).random() < p
            return answers[key]

        pred = CountingPredicate(fails)
        result = ddmin(list(range(n)), pred)
        culprits = result.culprits
        assert len(culprits) == n or fails(culprits)  # the full set is assumed to fail
        for c in culprits:
            rest = [x for x in culprits if x != c]
            assert not rest or not fails(rest), (trial, culprits, c)
        assert tuple(range(n)) not in pred.calls
        assert len(set(pred.calls)) == len(pred.calls) == result.runs


def test_max_runs_stops_early_with_a_failing_subset():
    result = ddmin(list(range(64)), lambda s: {3, 40, 41} <= set(s), max_runs=3)
    assert result.runs == 3 and not result.minimal
    assert {3, 40, 41} <= set(result.culprits)


def test_trivial_inputs_cost_no_runs():
    assert ddmin(["only"], lambda s: True).culprits == ["only"]
    assert ddmin(["only"], lambda s: True).runs == 0
    empty = ddmin([], lambda s: True)
    assert empty.culprits == [] and empty.runs == 0 and empty.budget == 0
