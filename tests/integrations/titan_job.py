"""The torchtitan job of tests/integrations/test_torchtitan.py, named by its config (`--experimental.custom_import`).

Importing it (torchtitan does, inside `Trainer.__init__`, before it picks its device) does two things:
- registers the train spec `titan_tokens`: torchtitan's Llama 3 (model, parallelisation, optimizer, schedule and
  loss unchanged) reading a small synthetic token dataset instead of a tokenizer and a dataset from a hub (nothing
  is downloaded). Record POISON of the stream has every label masked (-100, the ignore index): the mean
  cross-entropy of a micro-batch holding only that record is 0/0 = NaN, a loss-masking bug practitioners
  meet (every label -100: 0/0 in a mean over tokens);
- on a machine without CUDA, points torchtitan 0.2.0 at the CPU: it takes `device_type` to be "cuda" whenever no
  accelerator is found (torchtitan/tools/utils.py, get_device_info) and reads memory statistics from that device.
  A test stand-in only: on a GPU nothing is changed.
"""

from __future__ import annotations

import dataclasses
import os
import types

import torch
from torch.utils.data import IterableDataset

VOCAB, SEQ = 2048, 32  # torchtitan's llama3 debugmodel vocabulary; a short sequence keeps the CPU test cheap
POISON = int(os.environ.get("TITAN_POISON", "5"))  # position of the masked record in rank POISON_RANK's stream
POISON_RANK = int(os.environ.get("TITAN_POISON_RANK", "1"))
WITH_IDS = os.environ.get("TITAN_SAMPLE_IDS") == "1"  # records carry their own IDs in the input dict
IGNORE_INDEX = -100  # torch's cross_entropy default, which torchtitan's loss keeps


class TokenRecords(IterableDataset):
    """This data-parallel rank's records, in order: ({"input": SEQ ids}, SEQ labels), the labels the inputs shifted
    (with TITAN_SAMPLE_IDS=1 the input dict also holds the record's ID, "rank<R>/rec<N>").

    Record POISON of rank POISON_RANK has all its labels masked. The tokens come from a fixed generator per rank, so a
    re-run reads the same records."""

    def __init__(self, dp_rank: int, count: int):
        self.dp_rank, self.count = dp_rank, count

    def __iter__(self):
        generator = torch.Generator().manual_seed(1000 + self.dp_rank)
        for position in range(self.count):
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=generator)
            labels = tokens[1:].clone()
            if self.dp_rank == POISON_RANK and position == POISON:
                labels[:] = IGNORE_INDEX
            inputs = {"input": tokens[:-1]}
            if WITH_IDS:  # a dataset that names its records: the Guard takes the field out before the model
                inputs["sample_ids"] = f"rank{self.dp_rank}/rec{position}"
            yield inputs, labels


def build_token_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    from torchtitan.components.dataloader import ParallelAwareDataloader

    local = job_config.training.local_batch_size
    count = job_config.training.steps * local * 64  # more than the run reads
    return ParallelAwareDataloader(
        TokenRecords(dp_rank, count), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local
    )


def _register() -> None:
    from torchtitan.models.llama3 import get_train_spec
    from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

    if "titan_tokens" not in _extra_train_specs:
        spec = dataclasses.replace(
            get_train_spec(),
            build_dataloader_fn=build_token_dataloader,
            build_tokenizer_fn=None,
            build_validator_fn=None,
        )
        register_train_spec("titan_tokens", spec)


class _HostMemory:
    """What torchtitan reads of its device module, answered for the CPU."""

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def current_device() -> int:  # torchtitan passes it to barrier(device_ids=...), which wants an index
        return 0

    def __getattr__(self, name):  # set_device, synchronize, empty_cache, reset_peak_memory_stats
        return getattr(torch.cpu, name, lambda *args, **kwargs: 0)


def _cpu_if_no_accelerator() -> None:
    if torch.cuda.is_available():
        return
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tool_utils

    module = _HostMemory()
    for where in (tool_utils, metrics, dist_utils, parallel_dims):
        where.device_type = "cpu"
        if hasattr(where, "device_module"):
            where.device_module = module


_cpu_if_no_accelerator()
_register()
