"""Dump format v1 round trip and byte layout: what the writer puts on disk is what docs/DUMP_FORMAT.md says."""

from __future__ import annotations

import hashlib
import json
import math
import struct

import pytest
import torch
import zstandard

from forensics.core.errors import CaptureError, NotADumpError
from forensics.format import Unreplayable, open_dump, open_step, verify_dump, write_dump
from forensics.format import spec
from forensics.format.tensors import load_safetensors_bytes, safetensors_bytes


@pytest.fixture
def written(helpers, tmp_path):
    """(rank dump directory, what was written into it)."""
    content, originals = helpers.synthetic_content()
    return write_dump(content, tmp_path / "dumps"), originals


@pytest.fixture
def dump_dir(written):
    return written[0]


def test_layout_names_the_run_step_and_rank(dump_dir, tmp_path):
    assert dump_dir == tmp_path / "dumps" / "run-test" / "step-000000007" / "rank-00000"
    assert not [p for p in dump_dir.parent.iterdir() if p.name.startswith(".tmp-")]


def test_every_file_is_listed_with_its_exact_size_and_sha256(helpers, dump_dir):
    manifest = json.loads((dump_dir / "manifest.json").read_bytes())
    assert sorted(manifest["files"]) == helpers.SYNTHETIC_FILES
    assert sorted(p.name for p in dump_dir.iterdir()) == sorted(helpers.SYNTHETIC_FILES + ["manifest.json"])
    for name, entry in manifest["files"].items():
        data = (dump_dir / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert list(manifest)[:2] == ["format", "format_version"]
    assert manifest["format"] == "forensics-dump" and manifest["format_version"] == 1
    assert verify_dump(dump_dir).ok


def test_manifest_tags_non_finite_floats_and_is_strict_json(dump_dir):
    text = (dump_dir / "manifest.json").read_text("utf-8")
    manifest = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in manifest.json"))
    assert manifest["trigger"]["value"] == {"__float__": "nan"}
    assert manifest["loss"]["grad_norm"] == {"__float__": "inf"}
    dump = open_dump(dump_dir)
    assert math.isnan(dump.trigger.value) and dump.manifest["loss"]["grad_norm"] == math.inf


def test_model_tensors_round_trip_bitwise_with_dtype_shape_and_tied_keys(helpers, dump_dir):
    _, originals = helpers.synthetic_content()
    model = open_dump(dump_dir).model_state()
    assert sorted(model) == sorted(originals["model"])
    for name, tensor in originals["model"].items():
        assert helpers.bitwise_equal(model[name], tensor.contiguous()), name
    assert torch.equal(model["tied.a"], model["tied.b"])  # stored once per key


def test_model_safetensors_is_byte_compatible_with_the_safetensors_library(helpers, dump_dir):
    from safetensors.torch import load, save

    data = (dump_dir / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    assert (8 + header_len) % 8 == 0  # data section aligned
    assert header["w"]["dtype"] == "F32" and header["bf"]["dtype"] == "BF16" and header["mask"]["dtype"] == "BOOL"
    theirs = load(data)
    _, originals = helpers.synthetic_content()
    for name, tensor in originals["model"].items():
        assert helpers.bitwise_equal(theirs[name], tensor.contiguous()), name
    # and the reader takes what the safetensors library writes
    blob = save({"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)})
    ours = load_safetensors_bytes(blob, "x.safetensors")
    assert (
        torch.equal(ours["a"], torch.arange(6, dtype=torch.int32).reshape(2, 3)) and ours["b"].dtype == torch.bfloat16
    )


def test_empty_tensor_dict_is_a_valid_safetensors_file():
    assert load_safetensors_bytes(safetensors_bytes({}), "empty.safetensors") == {}


def test_optimizer_state_round_trips_by_parameter_name(helpers, dump_dir):
    _, originals = helpers.synthetic_content()
    opt = open_dump(dump_dir).optimizer_state()
    assert opt["class"] == "torch.optim.adamw.AdamW"
    assert opt["param_groups"] == originals["optimizer"]["param_groups"]
    for name, entries in originals["optimizer"]["state"].items():
        assert set(opt["state"][name]) == set(entries)
        for key, value in entries.items():
            got = opt["state"][name][key]
            assert helpers.bitwise_equal(got, value) if isinstance(value, torch.Tensor) else got == value
    meta = json.loads((dump_dir / "optimizer.json").read_bytes())
    assert "exp_avg" not in meta["state"]["w"]  # tensors live in optimizer.safetensors
    tensors = load_safetensors_bytes((dump_dir / "optimizer.safetensors").read_bytes(), "optimizer.safetensors")
    assert sorted(tensors) == ["state/w/exp_avg", "state/w/exp_avg_sq", "state/w/step"]


def test_batches_round_trip_with_container_types_values_and_unreplayable_leaves(helpers, dump_dir):
    _, originals = helpers.synthetic_content()
    dump = open_dump(dump_dir)
    assert dump.num_micro_batches == 3
    assert helpers.trees_equal(dump.micro_batch(0), originals["batches"][0])
    second = dump.micro_batch(1)
    assert isinstance(second, tuple) and isinstance(second[1], list) and second[1][2] == math.inf
    assert helpers.trees_equal(second, originals["batches"][1])
    third = dump.micro_batch(2)
    assert third["text"] == ["no tensors here"]
    assert third["image"] == Unreplayable("forensics_test_helpers.OpaqueImage", "batch['image']")
    assert third["obj"] == Unreplayable("builtins.object", "batch['obj']")
    assert dump.micro_batches_meta[2]["unreplayable"] == [
        {"path": "batch['image']", "type": "forensics_test_helpers.OpaqueImage"},
        {"path": "batch['obj']", "type": "builtins.object"},
    ]
    assert [dump.sample_ids(i) for i in range(3)] == [["doc-1", "doc-2"], [0, 1, 2], ["t0"]]
    with pytest.raises(IndexError):
        dump.micro_batch(3)


def test_batch_files_are_zstd_frames_of_safetensors_and_of_the_json_skeleton(dump_dir):
    skeleton = json.loads(zstandard.ZstdDecompressor().decompress((dump_dir / "batch-000.json.zst").read_bytes()))
    keys = dict(skeleton["dict"])
    assert keys["input_ids"] == {"tensor": "t0"} and keys["sample_ids"] == {
        "list": [{"value": "doc-1"}, {"value": "doc-2"}]
    }
    assert dict(keys["meta"]["dict"])["pair"] == {"tuple": [{"value": 1.5}, {"value": {"__float__": "nan"}}]}
    tensors = zstandard.ZstdDecompressor().decompress((dump_dir / "batch-000.safetensors.zst").read_bytes())
    assert sorted(load_safetensors_bytes(tensors, "b")) == ["t0", "t1"]


def test_rng_history_scheduler_and_scaler_round_trip(written):
    dump_dir, originals = written
    dump = open_dump(dump_dir)
    for index, state in enumerate(originals["rng"]):
        got = dump.rng_state(index)
        assert got.python == state.python and torch.equal(got.torch_cpu, state.torch_cpu)
        assert got.numpy[0] == state.numpy[0] and (got.numpy[1] == state.numpy[1]).all()
        assert tuple(got.numpy[2:]) == tuple(state.numpy[2:])
    history = dump.history()
    assert (
        history["step"] == [5, 6, 7] and math.isnan(history["loss"][2]) and history["grad_norm"][1:] == [None, math.inf]
    )
    assert dump.scheduler_state()["state"]["last_epoch"] == 7
    assert dump.scaler_state()["scale"] == 65536.0


def test_optional_files_absent_read_as_none(tmp_path, helpers):
    content, _ = helpers.synthetic_content()
    content.optimizer = content.scheduler = content.scaler = None
    dump = open_dump(write_dump(content, tmp_path))
    assert dump.optimizer_state() is None and dump.scheduler_state() is None and dump.scaler_state() is None
    assert verify_dump(dump.path).ok


def test_a_second_dump_for_the_same_step_and_rank_is_refused_and_leaves_nothing_behind(helpers, dump_dir, tmp_path):
    with pytest.raises(CaptureError, match="already exists"):
        helpers.write_synthetic_dump(tmp_path / "dumps")
    assert sorted(p.name for p in dump_dir.parent.iterdir()) == ["rank-00000"]


def test_step_directory_with_several_ranks_and_one_missing(helpers, tmp_path):
    for rank in (0, 2):
        helpers.write_synthetic_dump(tmp_path, rank=rank, world_size=3)
    step_dir = tmp_path / "run-test" / "step-000000007"
    dumps, missing = open_step(step_dir)
    assert [d.rank for d in dumps] == [0, 2] and missing == [1]
    assert open_dump(step_dir, rank=2).rank == 2
    with pytest.raises(NotADumpError, match="no dump for rank 1"):
        open_dump(step_dir, rank=1)
    result = verify_dump(step_dir)
    assert not result.ok and [p.path for p in result.problems] == ["rank-00001"]
    with pytest.raises(NotADumpError, match="run directory .* step-000000007"):
        open_dump(tmp_path / "run-test")


def test_writer_failure_mid_write_leaves_no_dump_no_temp_dir_and_no_empty_step_dir(helpers, tmp_path):
    content, _ = helpers.synthetic_content()
    content.model["complex"] = torch.zeros(2, dtype=torch.complex64)  # safetensors cannot store it
    with pytest.raises(CaptureError, match="complex"):
        write_dump(content, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no temporary, and no empty step or run directory


def test_file_and_directory_names_follow_the_spec():
    assert (
        spec.batch_tensors_name(3) == "batch-003.safetensors.zst" and spec.batch_json_name(12) == "batch-012.json.zst"
    )
    assert spec.step_dir_name(41217) == "step-000041217" and spec.rank_dir_name(3) == "rank-00003"


def test_tensors_read_in_pieces_by_several_threads_round_trip_bitwise(monkeypatch, tmp_path):
    from forensics.format import tensors as tensor_io

    monkeypatch.setattr(tensor_io, "READ_PIECE_MIN", 1000)  # pieces at odd byte boundaries, several per tensor
    monkeypatch.setattr(tensor_io, "READ_THREADS", 3)
    source = {
        "odd": torch.randn(1237, 3),
        "bf16": torch.randn(5001).to(torch.bfloat16),
        "small": torch.arange(7),
        "empty": torch.empty(0),
    }
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as out:
        tensor_io.write_safetensors(out, source)
    assert len(tensor_io.read_pieces(1237 * 3 * 4)) == 3
    with tensor_io.SafetensorsFile(path, "t.safetensors") as reader:
        for key, value in source.items():
            assert torch.equal(reader.read(key), value), key


def test_reads_under_deterministic_algorithms_skip_the_fill_and_restore_the_setting(tmp_path):
    """Replay reads under torch.use_deterministic_algorithms, which fills every torch.empty (a second write of the
    whole state): the reader's buffers, overwritten whole, are not filled; the caller's setting comes back, also
    with readers on several threads at once."""
    import threading

    import torch.utils.deterministic

    from forensics.format import tensors as tensor_io
    from forensics.core.unfilled import unfilled

    source = {f"t{i}": torch.randn(3000) for i in range(8)}
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as out:
        tensor_io.write_safetensors(out, source)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        with unfilled():
            assert not torch.utils.deterministic.fill_uninitialized_memory
        assert torch.utils.deterministic.fill_uninitialized_memory
        results, errors = {}, []

        def read(keys):
            try:
                with tensor_io.SafetensorsFile(path, "t.safetensors") as reader:
                    for key in keys:
                        results[key] = reader.read(key)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=read, args=(list(source)[i::3],)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors and all(torch.equal(results[k], v) for k, v in source.items())
        assert torch.utils.deterministic.fill_uninitialized_memory  # restored after overlapping readers
    finally:
        torch.use_deterministic_algorithms(saved)
