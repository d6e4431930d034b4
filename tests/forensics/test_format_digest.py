"""Checksums of format version 3, byte for byte: per-chunk sha256s written on many threads, a file's `sha256` the
sha256 of its chunk digests; dumps of versions 1 and 2 (sha256 of the bytes, 64 MiB chunks) still verify and read."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch

from forensics.core.errors import DumpCorruptError
from forensics.format import open_dump, spec, verify_dump, write_dump
from forensics.format.digest import HashingWriter

CHUNK = spec.CHUNK_BYTES


def expected_entry(data: bytes, chunk: int = CHUNK) -> dict:
    """What docs/DUMP_FORMAT.md "Checksums" says a version-3 manifest lists for a file holding `data`."""
    if len(data) <= chunk:
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    digests = [hashlib.sha256(data[i : i + chunk]).digest() for i in range(0, len(data), chunk)]
    return {
        "size": len(data),
        "sha256": hashlib.sha256(b"".join(digests)).hexdigest(),
        "chunk_size": chunk,
        "chunks": [d.hex() for d in digests],
    }


def written_entry(data: bytes, cuts: list[int], chunk: int = CHUNK) -> tuple[dict, bytes]:
    out = io.BytesIO()
    writer = HashingWriter(out, chunk)
    for begin, end in zip([0, *cuts], [*cuts, len(data)]):
        writer.write(data[begin:end])
    entry = {"size": writer.size, "sha256": writer.hexdigest()}
    if writer.chunk_digests():
        entry.update(chunk_size=writer.chunk_bytes, chunks=writer.chunk_digests())
    return entry, out.getvalue()


@pytest.mark.parametrize(
    "size, cuts",
    [
        (0, []),
        (1000, [1, 999]),
        (CHUNK, []),  # exactly one chunk: the plain sha256 of the bytes
        (CHUNK + 1, []),
        (3 * CHUNK + 12345, []),  # one large write cut at the chunk boundaries, hashed in parallel
        (3 * CHUNK + 12345, [7, CHUNK - 3, CHUNK + (1 << 20) + 5, 2 * CHUNK, 2 * CHUNK + 1]),  # pieces that straddle
        (2 * CHUNK + 99, list(range(100_000, 2 * CHUNK, 700_001))),  # small writes only (hashed inline)
    ],
)
def test_the_digests_are_the_ones_the_spec_defines_however_the_bytes_arrive(size, cuts):
    data = (
        bytes((i * 7 + i // 4099) & 0xFF for i in range(size))
        if size < 4096
        else torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size), dtype=torch.uint8)
        .numpy()
        .tobytes()
    )
    entry, on_disk = written_entry(data, cuts)
    assert on_disk == data
    assert entry == expected_entry(data)


def test_a_dump_with_a_large_file_is_version_3_and_lists_the_digests_of_its_bytes(tmp_path, helpers):
    content, _ = helpers.synthetic_content()
    content.model["big"] = torch.randn(CHUNK // 4 * 2 + 1000, generator=torch.Generator().manual_seed(0))
    path = write_dump(content, tmp_path)
    manifest = json.loads((path / spec.MANIFEST).read_bytes())
    assert manifest["format_version"] == spec.CHUNK_DIGEST_VERSION == 3
    for name, entry in manifest["files"].items():
        assert entry == expected_entry((path / name).read_bytes()), name
    assert len(manifest["files"][spec.MODEL]["chunks"]) == 3
    assert verify_dump(path).ok


def test_a_dump_of_small_files_keeps_version_1(tmp_path, helpers):
    path = helpers.write_synthetic_dump(tmp_path)
    manifest = json.loads((path / spec.MANIFEST).read_bytes())
    assert manifest["format_version"] == 1
    assert all("chunks" not in entry for entry in manifest["files"].values())


def test_a_version_3_file_digest_that_does_not_match_its_chunks_is_refused(tmp_path, helpers):
    content, _ = helpers.synthetic_content()
    content.model["big"] = torch.randn(CHUNK // 4 + 1000, generator=torch.Generator().manual_seed(0))
    path = write_dump(content, tmp_path)
    manifest = json.loads((path / spec.MANIFEST).read_bytes())
    data = (path / spec.MODEL).read_bytes()
    manifest["files"][spec.MODEL]["sha256"] = hashlib.sha256(data).hexdigest()  # a version-2 style digest
    (path / spec.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DumpCorruptError, match=r"files\.model\.safetensors\.sha256.*chunk digests"):
        open_dump(path)


def test_a_version_1_dump_by_the_old_writer_still_verifies_reads_and_finds_a_flipped_byte(tmp_path, helpers):
    content, originals = helpers.synthetic_content()
    content.model["big"] = torch.randn(helpers.OLD_CHUNK_BYTES // 4 + 1000, generator=torch.Generator().manual_seed(0))
    path = write_dump(content, tmp_path)
    helpers.as_version_1_dump(path)
    entry = json.loads((path / spec.MANIFEST).read_bytes())["files"][spec.MODEL]
    assert entry["chunk_size"] == helpers.OLD_CHUNK_BYTES and len(entry["chunks"]) == 2
    assert entry["sha256"] == hashlib.sha256((path / spec.MODEL).read_bytes()).hexdigest()
    assert verify_dump(path).ok
    streamed = dict(open_dump(path).iter_model_tensors())
    assert torch.equal(streamed["big"], content.model["big"]) and torch.equal(streamed["w"], originals["model"]["w"])
    with open(path / spec.MODEL, "r+b") as handle:
        handle.seek(helpers.OLD_CHUNK_BYTES + 77)
        byte = handle.read(1)
        handle.seek(helpers.OLD_CHUNK_BYTES + 77)
        handle.write(bytes([byte[0] ^ 1]))
    assert not verify_dump(path).ok
    with pytest.raises(DumpCorruptError, match=r"chunk 1"):
        dict(open_dump(path).iter_model_tensors())


def test_a_json_file_larger_than_a_chunk_is_read_through_its_chunk_digests(tmp_path, helpers):
    content, _ = helpers.synthetic_content()
    content.history["notes"] = ["x" * 1000] * (CHUNK // 1000 + 10)  # history.json over one chunk
    path = write_dump(content, tmp_path)
    assert "chunks" in json.loads((path / spec.MANIFEST).read_bytes())["files"][spec.HISTORY]
    assert open_dump(path).history()["notes"][0] == "x" * 1000
