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
