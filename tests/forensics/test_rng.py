"""forensics.core.rng: capture / restore of python, numpy and torch CPU RNGs, and their split into dump parts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from forensics.core.rng import RngCapture, RngState, capture_rng, cuda_rng_targets, restore_rng


def _draw() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), np.random.standard_normal(), torch.rand(5)


def _same(a: tuple, b: tuple) -> bool:
    return a[:4] == b[:4] and torch.equal(a[4], b[4])


def test_restore_replays_every_generator():
    random.gauss(0, 1)  # leave a cached gaussian in python's state
    np.random.standard_normal()
    state = capture_rng()
    first = _draw()
    _draw()
    restore_rng(state)
    assert _same(_draw(), first)


def test_capture_is_a_snapshot_not_a_view():
    state = capture_rng()
    before = state.torch_cpu.clone()
    torch.rand(100)
    assert torch.equal(state.torch_cpu, before)


def test_parts_round_trip_through_json_types_and_tensors():
    import json

    random.gauss(0, 1)
    state = capture_rng()
    expected = _draw()
    meta, tensors = state.to_parts("mb3")
    meta = json.loads(json.dumps(meta))  # what rng.json holds
    assert set(tensors) == {"mb3/torch_cpu", "mb3/numpy_keys"} and meta["cuda_devices"] == 0
    assert tensors["mb3/torch_cpu"].dtype == torch.uint8
    rebuilt = RngState.from_parts(meta, {k: v.clone() for k, v in tensors.items()}, "mb3")
    _draw()
    restore_rng(rebuilt)
    assert _same(_draw(), expected)


def test_capture_never_initialises_cuda():
    initialised = torch.cuda.is_initialized()  # read before the call that could change it
    state = capture_rng()
    assert torch.cuda.is_initialized() == initialised
    if not initialised:
        assert state.cuda == []


def test_a_rank_s_cuda_state_goes_onto_the_replay_device_and_nothing_else_moves():
    assert cuda_rng_targets(4, 1, source_device=3, target_device=0) == [(3, 0)]  # rank 3 of a node, one GPU here
    assert cuda_rng_targets(8, 8, source_device=5, target_device=2) == [(5, 2)]
    assert cuda_rng_targets(2, 1, source_device=3, target_device=0) == []  # the job captured no state for device 3
    assert cuda_rng_targets(4, 2) == [(0, 0), (1, 1)]  # no mapping: each state onto its own index, where it exists
    assert cuda_rng_targets(1, 4) == [(0, 0)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="puts a CUDA generator's state: needs a GPU")
def test_restore_with_device_mapping_sets_the_mapped_state_on_the_gpu():
    torch.cuda.init()
    ours = torch.cuda.get_rng_state(0)
    other = torch.Generator("cuda").manual_seed(1234).get_state()
    state = capture_rng()
    state.cuda = [ours, ours, ours, other]  # as if the job's device 3 had drawn differently
    restore_rng(state, source_device=3, target_device=0)
    assert torch.equal(torch.cuda.get_rng_state(0), other)


def test_restore_with_device_mapping_restores_the_cpu_generators_without_cuda():
    state = capture_rng()
    expected = _draw()
    restore_rng(state, source_device=3, target_device=0)
    assert _same(_draw(), expected)


def _equal_states(a: RngState, b: RngState) -> bool:
    return (
        a.python == b.python
        and torch.equal(a.torch_cpu, b.torch_cpu)
        and a.numpy[0] == b.numpy[0]
        and np.array_equal(a.numpy[1], b.numpy[1])
        and a.numpy[2:] == b.numpy[2:]
    )


def test_the_hot_path_capture_shares_unchanged_states_and_equals_a_full_capture_after_any_draw():
    """RngCapture (the Guard's record_batch) copies the Python / numpy states only when a generator drew: what it
    returns is always what capture_rng returns, cached Gaussians included (a draw that consumes one leaves the
    generator's raw bytes as they were)."""
    capture = RngCapture()
    random.seed(1)
    np.random.seed(1)
    first, second = capture(), capture()
    assert second.python is first.python and second.numpy is first.numpy  # nothing drew: shared, not copied
    draws = [
        lambda: random.random(),
        lambda: random.gauss(0, 1),
        lambda: np.random.rand(),
        lambda: np.random.standard_normal(),
        lambda: torch.rand(1),
        lambda: None,
    ]
    for draw in draws * 3:  # a cached Gaussian made, then consumed (no raw change), for each generator
        draw()
        assert _equal_states(capture(), capture_rng()), draw
    random.gauss(0, 1)
    np.random.standard_normal()  # a Gaussian cached in each; consumed below without a raw change
    state = capture()
    expected = _draw()
    restore_rng(state)
    assert _same(_draw(), expected)
