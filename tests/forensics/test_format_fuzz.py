"""Fuzz of dump format v1: random byte flips and truncations in any file give a DumpError or a clean read, never a crash."""

from __future__ import annotations

import random
import shutil

import pytest

from forensics.errors import DumpError
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
