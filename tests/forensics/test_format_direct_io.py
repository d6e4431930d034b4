"""Large dump files written with O_DIRECT (forensics/format/direct_io.py): the file holds exactly the bytes given, a
dump written so verifies with the chunk digests of its bytes, its pages are not left in the page cache (a multi-GB
dump does not evict the job's own), a write that fails midway leaves no dump, and no thread outlives the write."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from forensics.format import direct_io, open_dump, spec, verify_dump, write_dump
from forensics.format.direct_io import open_direct

CHUNK = spec.CHUNK_BYTES


def direct_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "forensics-direct-write"]


def random_bytes(size: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8).numpy().tobytes()


def memory_backed(path: Path) -> bool:
    """`path` lies on a file system whose files live in memory (tmpfs, ramfs): its pages are always cached."""
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point, fs_type = fields[4], fields[fields.index("-") + 1]
        if str(path).startswith(mount_point) and len(mount_point) > len(best):
            best, kind = mount_point, fs_type
    return kind in ("tmpfs", "ramfs")


def cached_fraction(path: Path) -> float:
    """The share of `path`'s pages in the page cache (mincore(2) on a private mapping that is never touched)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    page = mmap.PAGESIZE
    pages = -(-size // page)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        resident = sum(v & 1 for v in vector)
        del address
    return resident / pages


@pytest.fixture
def direct_dir(tmp_path):
    probe = open_direct(tmp_path / "probe")
    if probe is None:
        pytest.skip("this file system refuses O_DIRECT (the writer then uses the page cache)")
    probe.close()
    return tmp_path


@pytest.mark.parametrize(
    "size, piece", [(0, 1), (4095, 1000), (direct_io.BUFFER, 1 << 20), (3 * CHUNK + 4321, 700_001)]
)
def test_a_direct_file_holds_exactly_the_bytes_written_whatever_their_alignment(direct_dir, size, piece):
    data = random_bytes(size, size)
    with open_direct(direct_dir / "file") as out:
        for start in range(0, len(data), piece):
            out.write(memoryview(data)[start : start + piece])
        out.flush()
        os.fsync(out.fileno())
    assert (direct_dir / "file").read_bytes() == data
    assert not direct_threads()


def test_a_dump_written_with_direct_io_verifies_lists_its_chunk_digests_and_reads_back_bitwise(direct_dir, helpers):
    content, _ = helpers.synthetic_content()
    content.model["big"] = torch.randn(5 * CHUNK // 4 + 333, generator=torch.Generator().manual_seed(0))  # 20 MiB + odd
    content.optimizer["state"]["w"]["exp_avg"] = torch.randn(
        direct_io.MIN_BYTES // 4 + 7, generator=torch.Generator().manual_seed(1)
    )
    path = write_dump(content, direct_dir)
    manifest = json.loads((path / spec.MANIFEST).read_bytes())
    for name in (spec.MODEL, spec.OPTIMIZER_TENSORS):
        data, entry = (path / name).read_bytes(), manifest["files"][name]
        digests = [hashlib.sha256(data[i : i + CHUNK]).digest() for i in range(0, len(data), CHUNK)]
        assert entry["size"] == len(data) and entry["chunks"] == [d.hex() for d in digests], name
        assert entry["sha256"] == hashlib.sha256(b"".join(digests)).hexdigest(), name
    assert verify_dump(path).ok
    dump = open_dump(path)
    assert torch.equal(dict(dump.iter_model_tensors())["big"], content.model["big"])
    assert not direct_threads()


def test_a_large_dump_file_is_not_left_in_the_page_cache(direct_dir, helpers):
    if memory_backed(direct_dir):
        pytest.skip("a tmpfs file is its pages in memory")
    content, _ = helpers.synthetic_content()
    content.model["big"] = torch.randn(8 << 20, generator=torch.Generator().manual_seed(0))  # 32 MiB
    path = write_dump(content, direct_dir)
    assert cached_fraction(path / spec.MODEL) < 0.05  # the unaligned tail went through the page cache: one page


def test_a_write_that_fails_midway_leaves_no_dump_and_says_why(direct_dir):
    # a real file system error in the middle of the direct write: the process's file-size limit (EFBIG)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, torch
        sys.path[:0] = {sys.path!r}
        from forensics.core.errors import CaptureError
        from forensics.core.rng import capture_rng
        from forensics.format.writer import DumpContent, write_dump
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        content = DumpContent(
            manifest={{"run_id": "r", "step": 3, "rank": 0, "world_size": 1, "trigger": {{}}, "micro_batches": []}},
            model={{"big": torch.randn(12 << 20)}}, rng=[capture_rng()], micro_batches=[], history={{}},
        )
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 20, 20 << 20))
        try:
            write_dump(content, {str(direct_dir)!r})
        except CaptureError as exc:
            print("CaptureError:", exc)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "CaptureError: no dump written" in done.stdout and "too large" in done.stdout.lower(), done.stdout
    assert not list(direct_dir.rglob(spec.MANIFEST))
    assert not (direct_dir / "r").exists() or not any((direct_dir / "r").rglob("*.safetensors"))


def test_a_write_the_file_system_refuses_with_einval_goes_through_the_page_cache_instead(direct_dir):
    # an unaligned buffer is what a file system with a larger O_DIRECT alignment refuses: the kernel's real EINVAL
    data = random_bytes(3 * direct_io.ALIGN, 5)
    unaligned = mmap.mmap(-1, len(data) + 1)
    unaligned[1:] = data
    with open_direct(direct_dir / "file") as out:
        out._write(memoryview(unaligned)[1:])  # the I/O thread's write of one buffer
        out.write(data)
        out.flush()
    assert (direct_dir / "file").read_bytes() == data + data


def test_only_a_local_disks_file_system_is_written_with_o_direct(tmp_path, helpers, monkeypatch):
    """O_DIRECT only where it skips the page cache and nothing else (ext4, xfs, btrfs, f2fs): a tmpfs dump, like one on
    a network or parallel file system, keeps the page cache's path and still verifies; FORENSICS_DIRECT_IO=0 turns it
    off everywhere."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not memory_backed(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    assert direct_io.file_system_type(shm) not in direct_io.LOCAL_DISK_FILE_SYSTEMS
    target = Path(shm) / f"fx-direct-{os.getpid()}"
    target.mkdir()
    try:
        assert open_direct(target / "big.bin") is None
        content, _ = helpers.synthetic_content()
        content.model["big"] = torch.randn(5 << 20)  # 20 MiB: a direct write on a local disk
        dump = write_dump(content, target)
        assert verify_dump(dump).ok
    finally:
        import shutil

        shutil.rmtree(target, ignore_errors=True)
    if direct_io.file_system_type(tmp_path) in direct_io.LOCAL_DISK_FILE_SYSTEMS:
        probe = open_direct(tmp_path / "probe")
        assert probe is not None
        probe.close()
        monkeypatch.setenv("FORENSICS_DIRECT_IO", "0")
        assert open_direct(tmp_path / "probe") is None
