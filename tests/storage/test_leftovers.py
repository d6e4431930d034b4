"""What a killed or failed write leaves never spoils a later dump (issue 49, item 9; the #54 rules near the writer).

A writer killed mid-write leaves files without a manifest under the rank dump's prefix (object storage) or a `.tmp-*`
directory beside it (disk). The next write of the same run, step and rank (a rerun with the same run_id) must give a
dump that `verify` accepts and `pack` packs — before, in object storage the old files stayed beside the new ones:
"dump written", then verify failed on a file the manifest does not list. A write that fails deletes what it wrote; a failed spike write gives back the place of the
spike dump it was to replace (that dump is still there)."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from forensics.capture.config import DumpConfig
from forensics.capture.dumping.budget import DumpBudget
from forensics.core.errors import CaptureError
from forensics.core.kinds import TriggerKind
from forensics.format import pack_dump, spec, verify_dump, write_dump
from forensics.format.location import RemotePath, as_location


def _content(helpers):
    content, _ = helpers.synthetic_content(step=3, run_id="rerun")
    return content


def _leave_a_killed_write(helpers, root) -> None:
    """Files of a write killed before its manifest: a whole dump's files but the manifest, and a micro-batch file the
    new dump will not have (the killed step had more micro-batches)."""
    path = write_dump(_content(helpers), root)
    (path / spec.MANIFEST).fs.rm((path / spec.MANIFEST).path) if isinstance(path, RemotePath) else (
        path / spec.MANIFEST
    ).unlink()
    with (path / spec.batch_tensors_name(7)).open("wb") as handle:
        handle.write(b"left by the killed write")


def _check_the_rerun(helpers, root, tmp_path):
    path = write_dump(_content(helpers), root)
    checked = verify_dump(path)
    assert checked.ok, [str(p) for p in checked.problems]
    archive = pack_dump(path, tmp_path / "dump.tar.zst")
    assert verify_dump(archive).ok


@pytest.fixture
def memory_root():
    return f"memory://leftovers-{uuid.uuid4().hex[:8]}/dumps"


def test_memory_store_a_killed_writes_files_do_not_spoil_the_rerun(helpers, memory_root, tmp_path):
    _leave_a_killed_write(helpers, as_location(memory_root))
    _check_the_rerun(helpers, as_location(memory_root), tmp_path)


def test_s3_a_killed_writes_files_do_not_spoil_the_rerun(helpers, bucket, s3_server, tmp_path):
    root = as_location(f"s3://{bucket}/dumps")
    _leave_a_killed_write(helpers, root)
    _check_the_rerun(helpers, root, tmp_path)
    rank = f"{bucket}/dumps/rerun/{spec.step_dir_name(3)}/{spec.rank_dir_name(0)}"
    assert f"{rank}/{spec.batch_tensors_name(7)}" not in s3_server.keys(f"{bucket}/dumps")


def test_disk_a_killed_writes_temporary_with_this_pid_does_not_spoil_the_rerun(helpers, tmp_path):
    """A container rerun often has the killed process's pid: its `.tmp-*` then looks alive to the stale check and
    stayed for a day beside the new dump (`list` called it an unfinished dump). On disk the new dump itself was
    never mixed with it (a rank dump appears by rename): the rerun removes it."""
    root = tmp_path / "dumps"
    step_dir = root / "rerun" / spec.step_dir_name(3)
    host = socket.gethostname().replace("-", "_")[:64] or "host"
    leftover = step_dir / f".tmp-{spec.rank_dir_name(0)}-{host}-{os.getpid()}-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / spec.batch_tensors_name(0)).write_bytes(b"half a file")
    _check_the_rerun(helpers, root, tmp_path)
    assert verify_dump(step_dir).ok
    assert not leftover.exists()


def test_an_object_store_write_that_fails_deletes_the_files_it_wrote(helpers, memory_root):
    content = _content(helpers)
    content.extra_files = {"precursors.json": object()}  # written after the state and the batches: fails there
    root = as_location(memory_root)
    with pytest.raises(CaptureError):
        write_dump(content, root)
    assert root.fs.find(root.path) == []


def test_a_failed_spike_write_gives_back_the_place_of_the_dump_it_was_to_replace():
    budget = DumpBudget(DumpConfig(max_spike_dumps=2, min_spike_gap=0))
    spike = TriggerKind.LOSS_SPIKE
    assert budget.admit(spike, 1, 2.0, 1.0).why_not is None  # the first spike: kept for good
    assert budget.admit(spike, 2, 3.0, 1.0).why_not is None  # the largest other
    larger = budget.admit(spike, 3, 5.0, 1.0)
    assert larger.replaces is not None and larger.replaces.step == 2
    budget.failed(spike, larger, multi_rank=False)  # its write failed: step 2's dump was not deleted
    assert budget.spike_floor(10) == 3.0  # step 2's dump is kept again: a spike must beat it
    assert budget.admit(spike, 11, 2.5, 1.0).why_not is not None
