"""The writer's pinned double-buffer path for CUDA tensors round-trips bitwise (runs only where CUDA is)."""

import pytest
import torch

from forensics.format import tensors as tensor_io

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_tensors_round_trip_bitwise_across_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(tensor_io, "STAGING_CHUNK", 1000)  # many chunks, odd boundaries
    source = {
        "big": torch.randn(1234, 7, device="cuda"),
        "bf16": torch.randn(333, device="cuda").to(torch.bfloat16),
        "cpu_in_between": torch.arange(10),
        "strided": torch.randn(50, 40, device="cuda").t(),
        "empty": torch.empty(0, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda"),
    }
    loaded = tensor_io.load_safetensors_bytes(tensor_io.safetensors_bytes(source), "t")
    for key, value in source.items():
        assert torch.equal(loaded[key], value.cpu()), key
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape


def test_tensors_read_onto_the_gpu_one_after_another_are_the_files_bytes(tmp_path):
    """Each read's copy to the GPU is not blocking while the next tensor is read into another pinned buffer: every
    tensor must still arrive whole (a pinned buffer reused before its copy ended would mix two tensors' bytes)."""
    source = {f"t{i:02d}": torch.full((3 << 20,), float(i)) + torch.arange(3 << 20) for i in range(12)}
    source["bf16"] = torch.randn(1 << 20).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as out:
        tensor_io.write_safetensors(out, source)
    with tensor_io.SafetensorsFile(path, "t.safetensors") as reader:
        loaded = {key: reader.read(key, "cuda") for key in reader.keys_in_file_order()}
    for key, value in source.items():
        assert loaded[key].is_cuda and torch.equal(loaded[key].cpu(), value), key
