"""The CUDA caching allocator's setting for a streamed replay (replay/load/allocator.py): expandable segments unless
the user configured the allocator; on a CPU nothing."""

import subprocess
import sys

import pytest
import torch

from forensics.replay.load.allocator import USER_SETTINGS, prefer_expandable_segments


def test_a_cpu_replay_leaves_the_allocator_alone():
    assert prefer_expandable_segments(torch.device("cpu")) == ("", False)


@pytest.mark.parametrize("name", USER_SETTINGS)
def test_the_users_own_allocator_settings_are_kept_and_named(monkeypatch, name):
    for other in USER_SETTINGS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "max_split_size_mb:128")
    assert prefer_expandable_segments(torch.device("cuda", 0)) == (f"CUDA allocator: as {name} sets it", False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_segments_made_afterwards_are_expandable_until_the_default_is_set_back():
    """In a fresh process (the allocator's settings are the process's): segments made after the call grow in place;
    after `restore_default_segments` new ones are of fixed size again."""
    code = (
        "import os, torch\n"
        "[os.environ.pop(n, None) for n in ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF')]\n"
        "from forensics.replay.load.allocator import prefer_expandable_segments, restore_default_segments\n"
        "said, was_set = prefer_expandable_segments(torch.device('cuda', 0))\n"
        "x = torch.empty(64 << 20, dtype=torch.uint8, device='cuda:0')\n"
        "during = [s.get('is_expandable') for s in torch.cuda.memory_snapshot()]\n"
        "restore_default_segments()\n"
        "with torch.cuda.stream(torch.cuda.Stream()):  # a stream with no cached blocks: a new segment\n"
        "    y = torch.empty(256 << 20, dtype=torch.uint8, device='cuda:0')\n"
        "after = [s.get('is_expandable') for s in torch.cuda.memory_snapshot()]\n"
        "print(was_set, all(during), after.count(False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "1"], out
