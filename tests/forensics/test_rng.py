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


def test_the_hot_path_capture_sees_a_draw_that_leaves_the_index_where_it_was():
    """A draw of exactly one Mersenne Twister block (624 words: the whole state regenerated, Python's index and
    numpy's position back where they were) and a reseed to the same index are seen: the in-place compare reads the
    whole state when the cheap part of it (the index) says nothing."""
    capture = RngCapture()
    random.seed(3)
    np.random.seed(3)
    capture()
    random.getrandbits(32)  # index 624 -> 1: away from a block boundary
    np.random.bytes(4)
    capture()
    for block in (lambda: random.getrandbits(32 * 624), lambda: np.random.bytes(4 * 624)):
        block()
        assert _equal_states(capture(), capture_rng())
    random.seed(4)  # index 624 again, other words
    random.seed(5)
    capture()
    random.seed(6)
    assert _equal_states(capture(), capture_rng())


def test_the_hot_path_capture_copies_no_raw_state_while_nothing_draws():
    """While no generator draws, a capture compares the Python and numpy states in place: it allocates no copy of
    their 2,500 raw bytes (the copy, then the compare, each read cold memory right after a backward)."""
    import tracemalloc

    capture = RngCapture()
    capture()
    tracemalloc.start()
    try:
        for _ in range(3):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            state = capture()
            peak = tracemalloc.get_traced_memory()[1] - before
            assert peak < 2500, f"a capture of unchanged generators allocated {peak} bytes at its peak"
    finally:
        tracemalloc.stop()
    assert _equal_states(state, capture_rng())


def test_the_hot_path_capture_follows_numpy_s_replaced_bit_generator():
    """np.random.set_bit_generator swaps the global generator under np.random.get_state: the capture reads the new
    one (and copies it every time when it has no raw bytes to compare, e.g. PCG64)."""
    capture = RngCapture()
    original = np.random.get_bit_generator()
    try:
        capture()
        np.random.set_bit_generator(np.random.MT19937(7))
        assert _equal_states(capture(), capture_rng())
        np.random.rand()
        assert _equal_states(capture(), capture_rng())
        np.random.set_bit_generator(np.random.PCG64(7))
        first = capture()
        np.random.rand()
        second = capture()
        assert first.numpy is not second.numpy
        assert second.numpy == capture_rng().numpy != first.numpy  # (not MT19937: numpy says it in a dict)
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads CUDA generators: needs a GPU")
def test_the_hot_path_capture_shares_a_cuda_state_nothing_drew_from_and_sees_every_draw():
    torch.cuda.init()
    capture = RngCapture()
    first, second = capture(), capture()
    assert second.cuda[0] is first.cuda[0]  # (seed, offset) unchanged: no new tensor
    for draw in (
        lambda: torch.rand(3, device="cuda"),
        lambda: torch.cuda.manual_seed(11),
        lambda: torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5),
    ):
        draw()
        state = capture()
        assert all(torch.equal(a, b) for a, b in zip(state.cuda, torch.cuda.get_rng_state_all(), strict=True))
