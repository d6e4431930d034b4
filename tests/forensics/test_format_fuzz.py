"""Fuzz of dump format v1: random byte flips and truncations in any file, and re-signed changes behind the checksums
(batch skeletons, tensor dtypes, a rank dump under another rank's name), give a DumpError or a clean read, never a
crash."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from forensics.core.errors import DumpError
from forensics.format import write_dump

FLIPS_PER_FILE = 12
MANIFEST_FLIPS = 150  # the manifest is parsed before any checksum protects it: fuzz it harder


@pytest.fixture(scope="module")
def pristine(helpers, tmp_path_factory):
    content, _ = helpers.synthetic_content()
    return write_dump(content, tmp_path_factory.mktemp("fuzz"))


def _read(helpers, path) -> str:
    """'ok', 'problem' (verify found one) or 'error' (a DumpError); anything else propagates and fails the test."""
    try:
        result = helpers.read_everything(path)
    except DumpError:
        return "error"
    return "ok" if result["verify"].ok else "problem"


def test_every_file_fuzzed_by_byte_flips_and_truncation(helpers, pristine, tmp_path, caplog):
    caplog.set_level("ERROR")  # the writer's unreplayable-leaf warnings are expected noise here
    dump_dir = tmp_path / "d"
    shutil.copytree(pristine, dump_dir)
    rng = random.Random(20261126)
    outcomes: dict[str, dict[str, int]] = {}
    for path in sorted(dump_dir.iterdir()):
        original = path.read_bytes()
        counts = outcomes.setdefault(path.name, {})
        trials = MANIFEST_FLIPS if path.name == "manifest.json" else FLIPS_PER_FILE
        for trial in range(trials):
            data = bytearray(original)
            if trial % 4 == 3:
                data = data[: rng.randrange(len(data))]
            else:
                for _ in range(1 + trial % 3):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            if bytes(data) == original:  # two flips of the same bit
                continue
            path.write_bytes(bytes(data))
            outcome = _read(helpers, dump_dir)
            counts[outcome] = counts.get(outcome, 0) + 1
        path.write_bytes(original)
        if path.name != "manifest.json":
            # a checksummed file: every change is caught
            assert counts.get("ok", 0) == 0, (path.name, counts)
    assert _read(helpers, dump_dir) == "ok"
    assert set(outcomes) >= {"manifest.json", "model.safetensors", "batch-000.json.zst"}


RE_SIGNED_TRIALS = 60
DTYPES = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.bool]
SKELETON_NODES = [
    {"value": 5},
    {"tensor": "missing"},
    {"list": 5},
    {"dict": [[1, {"value": 2}]]},
    {"tuple": []},
    {"unreplayable": 7},
    {},
    [],
    None,
    "x",
    {"dict": [["k"]]},
    {"tensor": 3},
]


def _skeleton(helpers, rng: random.Random, dump_dir) -> None:
    """A batch skeleton with one node replaced by a malformed one, or one over the JSON cap once decompressed."""
    name = rng.choice(sorted(p.name for p in dump_dir.glob("batch-*.json.zst")))
    if rng.random() < 0.25:
        helpers.resign_member(dump_dir, name, b"[" + b" " * (65 << 20) + b"]")
        return
    tree = json.loads(helpers.read_member(dump_dir, name))
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for index, child in node.items() if isinstance(node, dict) else enumerate(children):
            nodes.append((node, index))
            stack.append(child)
    parent, key = rng.choice(nodes)
    parent[key] = rng.choice(SKELETON_NODES)
    helpers.resign_member(dump_dir, name, json.dumps(tree).encode())


def _retype(helpers, rng: random.Random, dump_dir) -> None:
    """One tensor of a safetensors member (model, optimizer, RNG, batch) re-typed, its bytes reinterpreted."""
    from safetensors.torch import load

    name = rng.choice(sorted(p.name for p in dump_dir.iterdir() if ".safetensors" in p.name))
    blob = helpers.read_member(dump_dir, name)
    keys = sorted(load(blob))
    if keys:
        helpers.resign_member(dump_dir, name, helpers.retype_tensor(blob, rng.choice(keys), rng.choice(DTYPES)))


def test_re_signed_skeletons_dtypes_and_a_duplicated_rank(helpers, pristine, tmp_path, caplog):
    """Behind passing checksums: every loader either reads the dump or raises a DumpError; a rank dump under
    another rank's name is always refused."""
    caplog.set_level("ERROR")
    rng = random.Random(20261127)
    outcomes: dict[str, dict[str, int]] = {}
    for trial in range(RE_SIGNED_TRIALS):
        step_dir = tmp_path / f"t{trial}" / "step-000000007"
        dump_dir = step_dir / "rank-00000"
        shutil.copytree(pristine, dump_dir)
        kind = ("skeleton", "dtype", "rank copy")[trial % 3]
        if kind == "skeleton":
            _skeleton(helpers, rng, dump_dir)
        elif kind == "dtype":
            _retype(helpers, rng, dump_dir)
        else:
            shutil.copytree(dump_dir, step_dir / f"rank-{rng.randint(1, 99999):05d}")
        outcome = _read(helpers, step_dir if kind == "rank copy" else dump_dir)
        outcomes.setdefault(kind, {}).setdefault(outcome, 0)
        outcomes[kind][outcome] += 1
        shutil.rmtree(tmp_path / f"t{trial}")
    assert outcomes["rank copy"] == {"error": RE_SIGNED_TRIALS // 3}
    assert outcomes["skeleton"].get("error", 0) > 0 and sum(outcomes["dtype"].values()) == RE_SIGNED_TRIALS // 3
