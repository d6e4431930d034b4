"""What is read from a dump in object storage, against moto's S3 server (conftest.py): only the verified bytes, each
fetched once per replay; a report folder and an archive of their own per dump (issues 49 and 50).

The replayed dump is the demo's bad_sample capture (written on disk once, uploaded to each test's bucket); the others
are synthetic dumps written straight to the bucket.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main
from forensics.core.errors import DumpCorruptError
from forensics.core.kinds import ExitCode
from forensics.format import open_dump, spec, write_dump

MODEL = spec.PRE_STEP_STATE.model


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    """The demo's bad_sample dump (a record of 1e38 features; replays to bad_sample), on disk."""
    from forensics.demo.scenarios import SCENARIOS

    return SCENARIOS["bad_sample"].capture(tmp_path_factory.mktemp("captured"), device="cpu").dump_path


def _upload(dump: Path, bucket: str) -> str:
    """The rank dump under s3://bucket/dumps/<run>/<step>/<rank>; returns its step directory's URL."""
    import s3fs

    step_key = f"{bucket}/dumps/{dump.parent.parent.name}/{dump.parent.name}"
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(dump), f"{step_key}/{dump.name}", recursive=True)
    return f"s3://{step_key}"


def _nan_copy(data: bytes) -> bytes:
    """A safetensors file of the same size whose every float is NaN (its header kept: every byte after it 0xFF)."""
    (length,) = struct.unpack("<Q", data[:8])
    return data[: 8 + length] + b"\xff" * (len(data) - 8 - length)


def _replace(key: str) -> None:
    """Replaces the object at `key` (bucket/...) with its NaN copy of the same size."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    original = fs.cat_file(key)
    fs.pipe_file(key, _nan_copy(original))
    assert fs.size(key) == len(original)


def _replay(args: list[str]):
    return CliRunner().invoke(main, ["replay", *args, "--device", "cpu", "--no-rng-check"], catch_exceptions=True)


def test_a_file_replaced_in_the_bucket_after_verification_changes_nothing(s3_server, bucket, captured, monkeypatch):
    """Issue 49 item 1: model.safetensors swapped for a same-size copy full of NaNs at the "loading model" line,
    after the replay verified it: the replay reads the verified bytes (its local copy) and names the bad sample, as
    from a local disk; before, it read the swapped file from the bucket and blamed the model state."""
    import forensics.replay.engine as engine

    step_url = _upload(captured, bucket)
    rank_key = f"{step_url[len('s3://') :]}/{captured.name}"
    original_stage = engine.stage

    def stage_then_swap(progress, message):
        if message.startswith("loading model"):
            _replace(f"{rank_key}/{MODEL}")
        return original_stage(progress, message)

    monkeypatch.setattr(engine, "stage", stage_then_swap)
    result = _replay([step_url, "-o", str(Path(captured).parent / "report-swap")])
    assert result.exit_code == ExitCode.OK, (result.output, result.exception)
    report = json.loads((Path(captured).parent / "report-swap" / "report.json").read_text())
    assert report["verdict"]["kind"] == "bad_sample"


def _big_synthetic(bucket: str) -> str:
    """A synthetic rank dump whose model file spans 3 chunks (a 10 MiB tensor), written to the bucket; its URL."""
    import torch
    from forensics_test_helpers import synthetic_content

    content, _ = synthetic_content(step=3)
    content.model["large"] = torch.arange(10 << 18, dtype=torch.float32)
    return str(write_dump(content, f"s3://{bucket}/dumps"))


@pytest.mark.parametrize("chunks_per_get", [8, 1])
def test_a_file_replaced_after_verification_reads_its_verified_copy(s3_server, bucket, monkeypatch, chunks_per_get):
    """Verified, then swapped in the bucket: every tensor read afterwards is the verified one, bit for bit (the copy
    fetched in one GET, or in several)."""
    import torch

    import forensics.format.spool as spool

    monkeypatch.setattr(spool, "STREAM_BYTES", chunks_per_get * spec.CHUNK_BYTES)
    url = _big_synthetic(bucket)
    dump = open_dump(url)
    dump.verify_file(MODEL)
    _replace(f"{url[len('s3://') :]}/{MODEL}")
    large = dict(dump.iter_model_tensors())["large"]
    assert torch.equal(large, torch.arange(10 << 18, dtype=torch.float32))


def test_without_room_for_a_copy_a_chunk_fetched_again_is_verified_again(s3_server, bucket, monkeypatch):
    """No room in the temp directory for a local copy: the model is read by ranged GETs. Verified, swapped, read
    again past the bounded cache: the read is refused, naming the file, instead of handing on the NaNs."""
    import forensics.format.location as location
    import forensics.format.spool as spool

    monkeypatch.setattr(spool, "KEEP_FREE", 1 << 62)  # no room for a large tensor file's copy
    monkeypatch.setattr(location, "CACHE_BYTES", 0)  # the cache keeps 2 chunks: the third is fetched again
    url = _big_synthetic(bucket)
    dump = open_dump(url)
    dump.verify_file(MODEL)
    assert not isinstance(dump._verifiers[MODEL], spool.SpooledFile)  # read by ranges
    _replace(f"{url[len('s3://') :]}/{MODEL}")
    with pytest.raises(DumpCorruptError, match="changed in the store after it was verified") as raised:
        dict(dump.iter_model_tensors())
    assert raised.value.file == MODEL and MODEL in str(raised.value)


def test_a_replay_from_a_url_fetches_each_byte_once(s3_server, bucket, captured, monkeypatch, tmp_path):
    """Issue 50 item 2: the replay GETs every file the manifest lists once (the optimizer state included, which the
    load and the remedies both read), never a range twice (the manifest, a few KB, is read by each open)."""
    import s3fs.core

    step_url = _upload(captured, bucket)
    fetched: dict[str, int] = {}
    original = s3fs.core.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        response = await original(self, method, *args, **kwargs)
        if method == "get_object":
            key = kwargs["Key"].rsplit("/", 1)[-1]
            fetched[key] = fetched.get(key, 0) + int(response["ContentLength"])
        return response

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counting)
    result = _replay([step_url, "-o", str(tmp_path / "report")])
    assert result.exit_code == ExitCode.OK, (result.output, result.exception)
    sizes = {p.name: p.stat().st_size for p in captured.iterdir() if p.name != spec.MANIFEST}
    fetched.pop(spec.MANIFEST)
    assert fetched and set(fetched) <= set(sizes)
    assert {name: count for name, count in fetched.items() if count > sizes[name]} == {}, (fetched, sizes)


def test_reports_of_dumps_in_two_buckets_never_mix(s3_server, captured, monkeypatch, tmp_path):
    """Issue 49 item 11: the same run, step and rank in two buckets. After replaying the first, `list` of the second
    says it was never replayed; replaying the second writes a report folder of its own."""
    monkeypatch.chdir(tmp_path)
    first, second = _upload(captured, s3_server.bucket()), _upload(captured, s3_server.bucket())

    def listed_report(step_url: str) -> str | None:
        result = CliRunner().invoke(main, ["list", step_url.rsplit("/", 2)[0], "--json"])
        assert result.exit_code == 0, result.output
        [row] = json.loads(result.output)["dumps"]
        return row["report"]

    assert _replay([first]).exit_code == ExitCode.OK
    [folder] = list((tmp_path / "forensics_reports").iterdir())
    assert listed_report(first) == str(Path("forensics_reports") / folder.name / "report.json")
    assert listed_report(second) is None
    assert _replay([second]).exit_code == ExitCode.OK
    folders = sorted((tmp_path / "forensics_reports").iterdir())
    assert len(folders) == 2 and all((f / "report.json").is_file() for f in folders)
    assert listed_report(second) not in (None, listed_report(first))


def test_pack_of_a_url_names_the_archive_and_never_overwrites(s3_server, bucket, tmp_path, monkeypatch):
    """Issue 50 item 3: `forensics pack <URL>` writes `<run>-step<N>[-rank<R>].tar.zst`; a second dump of another
    step gets its own archive; packing onto an existing archive is exit 2 saying what to do, and --force replaces."""
    from forensics_test_helpers import synthetic_content

    monkeypatch.chdir(tmp_path)
    urls = [write_dump(synthetic_content(step=step, run_id="packed")[0], f"s3://{bucket}/dumps") for step in (4, 9)]
    runner = CliRunner()
    for url in urls:
        result = runner.invoke(main, ["pack", str(url.parent)])
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed-step4.tar.zst", "packed-step9.tar.zst"]
    rank = runner.invoke(main, ["pack", str(urls[0])])
    assert rank.exit_code == 0 and (tmp_path / "packed-step4-rank0.tar.zst").is_file(), rank.output

    before = (tmp_path / "packed-step4.tar.zst").read_bytes()
    again = runner.invoke(main, ["pack", str(urls[0].parent)])
    assert again.exit_code == ExitCode.BAD_INPUT and "--force" in again.output, again.output
    assert (tmp_path / "packed-step4.tar.zst").read_bytes() == before
    forced = runner.invoke(main, ["pack", str(urls[0].parent), "--force"])
    assert forced.exit_code == 0, forced.output
