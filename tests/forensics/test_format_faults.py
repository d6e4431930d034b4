"""Bad input: truncated, flipped, deleted, extra, unknown-version and half-written dumps, hostile archives.

Every fault must surface as a forensics.core.errors.DumpError subclass whose message names the file at fault,
and verify_dump must list the file; a directory without manifest.json is never a dump.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import tarfile
import tempfile
from pathlib import Path

import pytest
import zstandard

from forensics.core.errors import DumpCorruptError, DumpError, DumpNotFoundError, NotADumpError, UnsupportedVersionError
from forensics.format import spec
from forensics.format import open_dump, open_step, pack_dump, verify_dump, write_dump
from forensics.format.tensors import load_safetensors_bytes

ARCHIVE = ".tar.zst"
# Every file of the synthetic dump (tests/helpers.py); test_the_pristine_dump_is_clean checks the list.
FILES = [
    "batch-000.json.zst",
    "batch-000.safetensors.zst",
    "batch-001.json.zst",
    "batch-001.safetensors.zst",
    "batch-002.json.zst",
    "batch-002.safetensors.zst",
    "history.json",
    "model.safetensors",
    "optimizer.json",
    "optimizer.safetensors",
    "rng.json",
    "rng.safetensors",
    "scaler.json",
    "scheduler.json",
]


@pytest.fixture(scope="module")
def pristine(helpers, tmp_path_factory):
    """One synthetic dump written once; tests work on copies of it."""
    content, _ = helpers.synthetic_content()
    return write_dump(content, tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def dump_dir(pristine, tmp_path):
    target = tmp_path / "run-test" / pristine.parent.name / pristine.name
    shutil.copytree(pristine, target)
    return target


def load_file(dump, name: str):
    """Calls the loader that reads `name`."""
    if name == "model.safetensors":
        return dump.model_state()
    if name.startswith("optimizer."):
        return dump.optimizer_state()
    if name == "scheduler.json":
        return dump.scheduler_state()
    if name == "scaler.json":
        return dump.scaler_state()
    if name.startswith("rng."):
        return dump.rng_state(0)
    if name.startswith("batch-"):
        return dump.micro_batch(int(name[6:9]))
    if name == "history.json":
        return dump.history()
    raise AssertionError(f"no loader reads {name}")


def rewrite_manifest(dump_dir, edit) -> None:
    path = dump_dir / "manifest.json"
    manifest = json.loads(path.read_bytes())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def relist(dump_dir, name: str) -> None:
    """Makes the manifest agree with the (tampered) bytes of `name`, as a careful attacker would."""
    data = (dump_dir / name).read_bytes()
    rewrite_manifest(
        dump_dir,
        lambda m: m["files"].__setitem__(name, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}),
    )


def problems_for(dump_dir, name: str) -> list[str]:
    return [p.message for p in verify_dump(dump_dir).problems if os.path.basename(p.path) == name]


def test_the_pristine_dump_is_clean(helpers, dump_dir):
    result = verify_dump(dump_dir)
    assert result.ok, result.problems
    assert sorted(json.loads((dump_dir / "manifest.json").read_bytes())["files"]) == helpers.SYNTHETIC_FILES == FILES
    helpers.read_everything(dump_dir)


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_is_named_by_verify_and_refused_by_its_loader(dump_dir, name):
    path = dump_dir / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    [message] = problems_for(dump_dir, name)
    assert "truncated" in message and name in message
    with pytest.raises(DumpCorruptError, match="truncated") as info:
        load_file(open_dump(dump_dir), name)
    assert info.value.file == name and name in str(info.value)


@pytest.mark.parametrize("name", FILES)
def test_flipped_byte_is_caught_by_the_checksum(dump_dir, name):
    path = dump_dir / name
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    [message] = problems_for(dump_dir, name)
    assert "sha256" in message
    with pytest.raises(DumpCorruptError, match="sha256") as info:
        load_file(open_dump(dump_dir), name)
    assert info.value.file == name


def test_deleted_file_is_reported_missing(dump_dir):
    (dump_dir / "rng.safetensors").unlink()
    [message] = problems_for(dump_dir, "rng.safetensors")
    assert "missing" in message
    with pytest.raises(DumpCorruptError, match="rng.safetensors is missing"):
        open_dump(dump_dir).rng_state(0)


def test_extra_file_is_a_verify_problem_but_loaders_still_work(dump_dir):
    (dump_dir / "notes.txt").write_text("added later")
    [message] = problems_for(dump_dir, "notes.txt")
    assert "not listed" in message
    assert open_dump(dump_dir).history()["step"] == [5, 6, 7]


def test_file_dropped_from_the_manifest_cannot_be_read(dump_dir):
    rewrite_manifest(dump_dir, lambda m: m["files"].pop("history.json"))
    with pytest.raises(DumpCorruptError, match="history.json is not listed"):
        open_dump(dump_dir).history()
    assert problems_for(dump_dir, "history.json")


def test_newer_format_version_is_refused_naming_both_versions(dump_dir):
    newer = spec.FORMAT_VERSION + 1
    rewrite_manifest(dump_dir, lambda m: m.__setitem__("format_version", newer))
    with pytest.raises(UnsupportedVersionError, match=rf"version {newer}.*up to version {spec.FORMAT_VERSION}") as info:
        open_dump(dump_dir)
    assert "Upgrade" in str(info.value)
    with pytest.raises(UnsupportedVersionError):
        verify_dump(dump_dir)


@pytest.mark.parametrize("version", ["1", 1.0, True, 0, None])
def test_malformed_format_version_is_corrupt(dump_dir, version):
    rewrite_manifest(dump_dir, lambda m: m.__setitem__("format_version", version))
    with pytest.raises(DumpCorruptError, match="format_version") as info:
        open_dump(dump_dir)
    assert info.value.file == "manifest.json"


@pytest.mark.parametrize("text", [b"", b"{", b"not json at all", b"\xff\xfe\x00", b"[1, 2]", b'{"format": "other"}'])
def test_manifest_that_is_not_a_forensics_json_object_is_corrupt(dump_dir, text):
    (dump_dir / "manifest.json").write_bytes(text)
    with pytest.raises(DumpCorruptError, match="manifest.json") as info:
        open_dump(dump_dir)
    assert info.value.file == "manifest.json"


def test_manifest_missing_a_required_key_is_corrupt(dump_dir):
    rewrite_manifest(dump_dir, lambda m: m.pop("micro_batches"))
    with pytest.raises(DumpCorruptError, match="micro_batches"):
        open_dump(dump_dir)


@pytest.mark.parametrize(
    "edit, what",
    [
        (lambda m: m["files"].__setitem__("model.safetensors", "abc"), "model.safetensors"),
        (lambda m: m["files"]["model.safetensors"].__setitem__("size", "12"), "model.safetensors"),
        (lambda m: m.__setitem__("micro_batches", "x"), "micro_batches"),
        (lambda m: m["micro_batches"].__setitem__(0, 5), "micro_batches"),
        (lambda m: m.__setitem__("step", "seven"), "step"),
        (lambda m: m.__setitem__("rank", None), "rank"),
        (lambda m: m.__setitem__("world_size", True), "world_size"),
        (lambda m: m.__setitem__("trigger", "nan"), "trigger"),
        (lambda m: m.__setitem__("exception", {"type": "IndexError", "during": "lunch"}), "exception.during"),
        (lambda m: m.__setitem__("exception", {"type": "IndexError", "state_holds": "../x"}), "exception.state_holds"),
        (
            lambda m: m.__setitem__("exception", {"type": "E", "user_frame": {"line": "ten"}}),
            "exception.user_frame.line",
        ),
        (
            lambda m: m.__setitem__("recipe", {"loss": "__main__:f", "script": {"file": "../train.py"}}),
            "recipe.script.file",
        ),
    ],
)
def test_manifest_with_wrong_types_is_corrupt_not_a_crash(helpers, dump_dir, edit, what):
    rewrite_manifest(dump_dir, edit)
    with pytest.raises(DumpCorruptError, match=what):
        helpers.read_everything(dump_dir)


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname", "sub/dir.json", "..", "manifest.json"])
def test_manifest_cannot_make_the_reader_open_files_outside_the_dump(dump_dir, name):
    outside = dump_dir.parent / "outside.txt"
    outside.write_text("secret")
    data = outside.read_bytes()
    rewrite_manifest(
        dump_dir,
        lambda m: m["files"].__setitem__(name, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}),
    )
    with pytest.raises(DumpCorruptError, match="manifest.json"):
        verify_dump(dump_dir)


def test_directory_without_manifest_is_never_a_dump(helpers, dump_dir):
    step_dir = dump_dir.parent
    leftover = step_dir / ".tmp-rank-00001-deadbeef"
    shutil.copytree(dump_dir, leftover)
    (leftover / "manifest.json").unlink()
    with pytest.raises(NotADumpError, match="no manifest.json"):
        open_dump(leftover)
    dumps, missing = open_step(step_dir)
    assert [d.path for d in dumps] == [dump_dir] and missing == []
    assert verify_dump(step_dir).ok
    (dump_dir / "manifest.json").unlink()  # now the only rank dump is half-written too
    with pytest.raises(NotADumpError, match="no complete rank dump"):
        open_dump(step_dir)
    with pytest.raises(NotADumpError):
        verify_dump(step_dir)
    with pytest.raises(NotADumpError):
        pack_dump(step_dir)
    only_tmp = step_dir.parent / "step-000000008"
    shutil.copytree(leftover, only_tmp / ".tmp-rank-00000-cafef00d")
    with pytest.raises(NotADumpError):
        open_dump(only_tmp)


def test_nonexistent_path(tmp_path):
    with pytest.raises(DumpNotFoundError, match="does not exist"):
        open_dump(tmp_path / "nope")


# -- safetensors headers ------------------------------------------------------------------------


def test_safetensors_header_longer_than_the_file_is_refused():
    blob = struct.pack("<Q", 10_000) + b'{"a": 1}'
    with pytest.raises(DumpCorruptError, match="header of 10000 bytes"):
        load_safetensors_bytes(blob, "x.safetensors")
    with pytest.raises(DumpCorruptError, match="shorter than a safetensors header"):
        load_safetensors_bytes(b"\x01\x00", "x.safetensors")
    huge = struct.pack("<Q", 200 * 1024 * 1024) + b" " * 64
    with pytest.raises(DumpCorruptError, match="header"):
        load_safetensors_bytes(huge, "x.safetensors")


@pytest.mark.parametrize(
    "blob",
    [
        struct.pack("<Q", 8) + b"not json",
        struct.pack("<Q", 48)
        + json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode().ljust(48),
        struct.pack("<Q", 56)
        + json.dumps({"a": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}).encode().ljust(56)
        + b"\x00" * 4,
    ],
)
def test_malformed_safetensors_inside_a_checksummed_file_is_corrupt(dump_dir, blob):
    (dump_dir / "model.safetensors").write_bytes(blob)
    relist(dump_dir, "model.safetensors")
    with pytest.raises(DumpCorruptError, match="model.safetensors"):
        open_dump(dump_dir).model_state()


def test_malformed_zstd_and_skeleton_inside_checksummed_files_are_corrupt(dump_dir):
    (dump_dir / "batch-000.json.zst").write_bytes(b"plainly not zstd")
    relist(dump_dir, "batch-000.json.zst")
    with pytest.raises(DumpCorruptError, match="batch-000.json.zst"):
        open_dump(dump_dir).micro_batch(0)
    bad_skeletons = [
        {"dict": [["a", {"tensor": "t99"}]]},
        {"weird": 1},
        {"dict": "x"},
        [1, 2],
        {"list": [{"dict": [[1]]}]},
    ]
    for skeleton in bad_skeletons:
        (dump_dir / "batch-001.json.zst").write_bytes(
            zstandard.ZstdCompressor().compress(json.dumps(skeleton).encode())
        )
        relist(dump_dir, "batch-001.json.zst")
        with pytest.raises(DumpCorruptError, match="batch"):
            open_dump(dump_dir).micro_batch(1)


# -- archives -----------------------------------------------------------------------------------


def test_pack_round_trips_a_rank_dump_and_a_step_dump(helpers, dump_dir):
    before = helpers.read_everything(dump_dir)
    for source in (dump_dir, dump_dir.parent):
        archive = pack_dump(source)
        assert archive.name == source.name + ARCHIVE and archive.is_file()
        after = helpers.read_everything(archive)
        assert after["verify"].ok and after["step"] == 7
        for name, tensor in before["model"].items():
            assert helpers.bitwise_equal(after["model"][name], tensor)
        for index, batch in enumerate(before["batches"]):
            assert helpers.trees_equal(after["batches"][index], batch)
        archive.unlink()


def test_pack_leaves_out_temp_directories(dump_dir):
    (dump_dir.parent / ".tmp-rank-00003-0badf00d").mkdir()
    archive = pack_dump(dump_dir.parent)
    with zstandard.ZstdDecompressor().stream_reader(archive.open("rb")) as stream:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            names = [m.name for m in tar]
    assert names and not [n for n in names if ".tmp-" in n]


@pytest.mark.parametrize("keep", [0, 1, 100, 0.5, -1])
def test_truncated_archive_is_a_clear_corrupt_error(dump_dir, tmp_path, keep):
    data = pack_dump(dump_dir).read_bytes()
    cut = tmp_path / ("cut" + ARCHIVE)
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(DumpCorruptError, match="truncated|not a readable"):
        open_dump(cut)
    with pytest.raises(DumpCorruptError):
        verify_dump(cut)


def _archive(tmp_path, members) -> os.PathLike:
    """Writes a .tar.zst with hand-made members: (TarInfo-kwargs, bytes or None)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info_kwargs, data in members:
            info = tarfile.TarInfo(info_kwargs.pop("name"))
            for key, value in info_kwargs.items():
                setattr(info, key, value)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path = tmp_path / ("hostile" + ARCHIVE)
    path.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return path


@pytest.mark.parametrize(
    "member, why",
    [
        ({"name": "rank-00000/../../escaped.txt"}, "escapes"),
        ({"name": "../escaped.txt"}, "escapes"),
        ({"name": "/tmp/escaped-absolute.txt"}, "escapes"),
        ({"name": "rank-00000/link", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "link"),
        ({"name": "rank-00000/hard", "type": tarfile.LNKTYPE, "linkname": "rank-00000/manifest.json"}, "link"),
        ({"name": "rank-00000/fifo", "type": tarfile.FIFOTYPE}, "link or device"),
    ],
)
def test_hostile_archive_members_are_refused_and_nothing_escapes(tmp_path, member, why):
    is_file = member.get("type", tarfile.REGTYPE) == tarfile.REGTYPE
    path = _archive(
        tmp_path,
        [
            ({"name": "rank-00000", "type": tarfile.DIRTYPE}, None),
            ({"name": "rank-00000/manifest.json"}, b"{}"),
            (dict(member), b"evil" if is_file else None),
        ],
    )
    with pytest.raises(DumpCorruptError, match=why):
        open_dump(path)
    assert not (Path(tempfile.gettempdir()) / "escaped.txt").exists()
    assert not Path("/tmp/escaped-absolute.txt").exists()


def test_archive_with_two_top_directories_or_garbage_is_not_a_dump(tmp_path):
    path = _archive(
        tmp_path, [({"name": "a", "type": tarfile.DIRTYPE}, None), ({"name": "b", "type": tarfile.DIRTYPE}, None)]
    )
    with pytest.raises(NotADumpError, match="one dump directory"):
        open_dump(path)
    garbage = tmp_path / "garbage.tar.zst"
    garbage.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))
    with pytest.raises(DumpError):
        open_dump(garbage)


def test_a_large_file_is_verified_chunk_by_chunk_and_a_flipped_byte_is_found(tmp_path, helpers):
    import torch

    from forensics.format import open_dump, verify_dump, write_dump
    from forensics.format.spec import CHUNK_BYTES

    content, _ = helpers.synthetic_content()
    content.model["big"] = torch.randn(CHUNK_BYTES // 4 * 2 + 1000, generator=torch.Generator().manual_seed(0))
    path = write_dump(content, tmp_path)  # just over two chunks
    entry = open_dump(path).manifest["files"]["model.safetensors"]
    assert entry["chunk_size"] == CHUNK_BYTES and len(entry["chunks"]) == 3
    assert verify_dump(path).ok
    streamed = dict(open_dump(path).iter_model_tensors())  # verified while it is read
    assert torch.equal(streamed["big"], content.model["big"])
    model = path / "model.safetensors"
    with open(model, "r+b") as handle:  # a flip in the middle chunk
        handle.seek(CHUNK_BYTES + 12345)
        byte = handle.read(1)
        handle.seek(CHUNK_BYTES + 12345)
        handle.write(bytes([byte[0] ^ 1]))
    result = verify_dump(path)
    assert not result.ok and "model.safetensors" in str(result.problems[0])
    with pytest.raises(DumpCorruptError, match=r"model.safetensors does not match its sha256 .*chunk 1"):
        dict(open_dump(path).iter_model_tensors())  # the tensor read across the bad chunk is never handed on


def test_a_read_after_a_bad_chunk_closed_the_file_says_the_file_is_corrupt(tmp_path):
    """Two readers of one file: the first finds a chunk that does not match and closes the file's checks (the later
    ones are cancelled); the second, waiting on a chunk whose check was cancelled, gets the same DumpCorruptError
    naming the chunk that did not match — not concurrent.futures.CancelledError (a traceback, not exit 2)."""
    from forensics.format.reader import ChunkVerifier

    chunk = 32 << 20  # ~15 ms of sha256 each on one core: the checks after the second are still queued at the close
    data = os.urandom(6 * chunk)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    digests = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    digests[0] = "0" * 64  # the first chunk does not match
    verifier = ChunkVerifier(path, "model.safetensors", len(data), chunk, digests, workers=1)
    with pytest.raises(DumpCorruptError, match=r"chunk 0\)"):
        verifier.wait(0, 10)
    cancelled = [i for i, check in enumerate(verifier._chunks) if check is not None and check.cancelled()]
    if not cancelled:  # a machine so loaded that every check ran before the close: nothing left to show
        pytest.skip("every chunk's check ran before the first reader closed the file")
    with pytest.raises(DumpCorruptError, match=r"chunk 0\)"):
        verifier.wait(cancelled[-1] * chunk, cancelled[-1] * chunk + 10)
