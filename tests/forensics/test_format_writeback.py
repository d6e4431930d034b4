"""Early writeback of large dump files: the file and its digests are what they would be without it, and no thread
outlives the write (a long job writes many dumps)."""

from __future__ import annotations

import threading

import torch

from forensics.format import open_dump, verify_dump, write_dump, writeback
from forensics.format.writeback import EarlyWriteback


def writeback_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "forensics-writeback"]


def test_a_file_written_with_early_writeback_holds_exactly_the_bytes_written(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "FLUSH_EVERY", 1 << 20)  # many fdatasyncs while the file grows
    data = (
        torch.randint(0, 256, (9 * (1 << 20) + 4321,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
        .numpy()
        .tobytes()
    )
    with open(tmp_path / "file", "wb", buffering=1 << 16) as handle:
        with EarlyWriteback(handle) as out:
            for start in range(0, len(data), 700_001):
                out.write(data[start : start + 700_001])
            assert writeback_threads()  # it is flushing while the file is written
        handle.flush()
    assert (tmp_path / "file").read_bytes() == data
    assert not writeback_threads()


def test_a_dump_written_with_early_writeback_verifies_and_reads_back_bitwise(tmp_path, monkeypatch, helpers):
    monkeypatch.setattr(writeback, "FLUSH_EVERY", 1 << 20)
    content, _ = helpers.synthetic_content()
    content.model["big"] = torch.randn(3 << 20, generator=torch.Generator().manual_seed(0))  # 12 MiB
    path = write_dump(content, tmp_path)
    assert verify_dump(path).ok
    assert torch.equal(dict(open_dump(path).iter_model_tensors())["big"], content.model["big"])
    assert not writeback_threads()
