"""Test helpers shared by tests/capture and tests/forensics: tiny GPT-2, seeded data, the Guard loop, synthetic dumps.

Reached through the `helpers` fixture of tests/conftest.py (this directory is not a package)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from forensics.core.thirdparty import TorchDispatchMode

VOCAB, EMBD, POSITIONS = 64, 32, 32


def fork_server():
    """The tests/fork_server.py module (its `shared(repo)` server starts scripts and jobs as forked processes)."""
    import sys
    from pathlib import Path

    load = sys.modules["forensics_test_helpers"].load_test_module  # set by tests/conftest.py
    return load("forensics_fork_server", Path(__file__).with_name("fork_server.py"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (a test's server or rendezvous binds it next)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_gpt2(seed: int = 0, dropout: float = 0.1):
    """A random-init GPT-2 (2 layers, 32 wide, vocab 64) in train mode, dropout on."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=EMBD,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


class EmbedsDataset:
    """Map-style dataset of dict samples {"inputs_embeds": (T, 32) float, "labels": (T,) int}.

    `poison` sample indices get a 1e38 entry in their embeddings: LayerNorm squares it, so the
    forward of any micro-batch holding one of them is non-finite.
    """

    def __init__(self, n: int, seq_len: int = 8, poison: Iterable[int] = (), seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.items = [
            {
                "inputs_embeds": torch.randn(seq_len, EMBD, generator=g),
                "labels": torch.randint(0, VOCAB, (seq_len,), generator=g),
            }
            for _ in range(n)
        ]
        for index in poison:
            self.items[index]["inputs_embeds"][0, 0] = 1e38

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def collate(dataset, indices: list[int]) -> dict:
    """One micro-batch of `dataset[indices]`, stacked, with `sample_ids` = the indices (as IndexedDataset gives)."""
    batch = torch.utils.data.default_collate([dataset[i] for i in indices])
    batch["sample_ids"] = torch.tensor(indices)
    return batch


def default_loss_fn(ignore: tuple = ("sample_ids",)) -> Callable:
    from forensics.recipes import default_loss

    return lambda model, batch: default_loss(model, batch, ignore)


def guarded_step(guard, optimizer, batch, loss_of: Callable[[Any], torch.Tensor], scheduler=None) -> None:
    """One step of the loop README shows, one micro-batch, no clipping: record_batch, the loss, record_loss, backward,
    the optimizer step only when check() says so (then the scheduler's), zero_grad."""
    guard.record_batch(batch)
    loss = loss_of(batch)
    guard.record_loss(loss)
    loss.backward()
    if guard.check():
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad()


@dataclass
class StepLog:
    """What the loop saw at one optimizer step, taken right before `guard.check()`."""

    step: int
    micro_batches: list = field(default_factory=list)
    losses: list = field(default_factory=list)  # detached per-micro-batch losses (before division)
    draws: list = field(default_factory=list)  # torch.rand(4) drawn right after record_batch, per micro-batch
    model_state: dict | None = None  # deep copies taken right before check()
    optimizer_state: dict | None = None
    scheduler_state: dict | None = None
    scaler_state: dict | None = None
    decision: bool | None = None  # what check() returned (None: it raised)


class TrainLoop:
    """The loop docs/ARCHITECTURE.md shows, with gradient accumulation and optional autocast + GradScaler.

    `run(steps)` takes an iterable of steps, each a list of micro-batches, and appends a StepLog per
    step to `self.logs` before calling check(), so a test still has them when check() raises.
    """

    def __init__(
        self,
        model,
        optimizer,
        guard,
        scheduler=None,
        scaler=None,
        loss_fn: Callable | None = None,
        autocast_dtype: torch.dtype | None = None,
        clip: float = 1.0,
        snapshot: bool = True,
        draw: bool = False,
    ):
        self.model, self.optimizer, self.guard = model, optimizer, guard
        self.scheduler, self.scaler = scheduler, scaler
        self.loss_fn = loss_fn or default_loss_fn()
        self.autocast_dtype, self.clip, self.snapshot, self.draw = autocast_dtype, clip, snapshot, draw
        self.logs: list[StepLog] = []

    def run(self, steps: Iterable[list]) -> list[StepLog]:
        for batches in steps:
            self.step(list(batches))
        return self.logs

    def step(self, batches: list) -> StepLog:
        log = StepLog(step=len(self.logs), micro_batches=batches)
        self.logs.append(log)
        for batch in batches:
            self.guard.record_batch(batch)
            if self.draw:
                log.draws.append(torch.rand(4))
            with torch.autocast(
                "cpu", dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None
            ):
                loss = self.loss_fn(self.model, batch)
                self.guard.record_loss(loss)  # inside autocast: the Guard reads the autocast state here
            log.losses.append(loss.detach().clone())
            scaled = loss / len(batches)
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.snapshot:
            log.model_state = copy.deepcopy(self.model.state_dict())
            log.optimizer_state = copy.deepcopy(self.optimizer.state_dict())
            log.scheduler_state = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler else None
            log.scaler_state = copy.deepcopy(self.scaler.state_dict()) if self.scaler else None
        log.decision = self.guard.check(grad_norm=grad_norm)
        if log.decision:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad()
        return log


def written(record: dict, *path: str) -> Any:
    """`record[path[0]][path[1]]...`, failing with the missing key's name: a test that compares `.get(key)` of two
    reports passes when no code writes the key at all (None == None); reading through this one cannot.

    Example: `assert written(streamed, "culprit", "module") == written(normal, "culprit", "module")`."""
    value: Any = record
    for depth, key in enumerate(path):
        assert isinstance(value, dict) and key in value, (
            f"no key {'.'.join(path[: depth + 1])!r}: nothing wrote it (has {sorted(value) if isinstance(value, dict) else type(value).__name__})"
        )
        value = value[key]
    return value


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN == NaN when the bits match)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8)
    )


def optimizer_state_by_name(state_dict: dict, model, optimizer) -> dict:
    """optimizer.state_dict()["state"] re-keyed by parameter name (the dump's keying)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {order[index]: entries for index, entries in state_dict["state"].items()}


def trees_equal(a: Any, b: Any) -> bool:
    """Batch trees equal leaf by leaf, tensors bitwise, container types kept."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bitwise_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(trees_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(trees_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN floats


# -- synthetic dumps (no Guard): every optional file present, awkward dtypes and batch trees ---------

SYNTHETIC_FILES = sorted(
    [
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "scheduler.json",
        "scaler.json",
        "rng.safetensors",
        "rng.json",
        "history.json",
        "batch-000.safetensors.zst",
        "batch-000.json.zst",
        "batch-001.safetensors.zst",
        "batch-001.json.zst",
        "batch-002.safetensors.zst",
        "batch-002.json.zst",
    ]
)


class OpaqueImage:
    """Stands in for a PIL image: a batch leaf the format cannot store."""


def synthetic_content(step: int = 7, rank: int = 0, world_size: int = 1, run_id: str = "run-test"):
    """A DumpContent exercising every encoding of docs/DUMP_FORMAT.md; returns (content, originals)."""
    from forensics.format import DumpContent
    from forensics.core.rng import capture_rng

    g = torch.Generator().manual_seed(step)
    tied = torch.randn(5, 3, generator=g)
    model = {
        "w": torch.randn(4, 3, generator=g),
        "half": torch.randn(2, 2, generator=g).half(),
        "bf": torch.randn(3, generator=g).bfloat16(),
        "f64": torch.randn(2, generator=g).double(),
        "mask": torch.tensor([True, False, True]),
        "count": torch.tensor(41, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "tied.a": tied,
        "tied.b": tied,
        "transposed": torch.randn(3, 4, generator=g).t(),
        "nonfinite": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    }
    optimizer = {
        "class": "torch.optim.adamw.AdamW",
        "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "foreach": None, "params": ["w", "half"]}],
        "state": {
            "w": {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn(4, 3, generator=g),
                "exp_avg_sq": torch.rand(4, 3, generator=g),
            },
            "half": {"step": 3, "note": "scalar state"},
        },
    }
    rng = []
    batches = [
        {
            "input_ids": torch.randint(0, 64, (2, 5), generator=g),
            "attention_mask": torch.ones(2, 5, dtype=torch.long),
            "sample_ids": ["doc-1", "doc-2"],
            "meta": {"lengths": [5, 4], "pair": (1.5, float("nan")), "none": None, "flag": True, "name": "x"},
        },
        (torch.randn(3, 2, generator=g), [torch.arange(3), "tail", float("inf")]),
        {"text": ["no tensors here"], "image": OpaqueImage(), "obj": object()},
    ]
    for _ in batches:
        rng.append(capture_rng())
        torch.rand(3)
    micro_batches = [
        {"index": i, "sample_ids": ids, "batch_size": size, "loss": loss}
        for i, (ids, size, loss) in enumerate(
            [(["doc-1", "doc-2"], 2, 1.25), ([0, 1, 2], 3, float("nan")), (["t0"], 1, 2.5)]
        )
    ]
    manifest = {
        "run_id": run_id,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "local_rank": rank,
        "grad_accum": 3,
        "micro_batches": micro_batches,
        "trigger": {
            "kind": "nonfinite_loss",
            "value": float("nan"),
            "threshold": None,
            "micro_batch": 1,
            "detail": "loss of micro-batch 1 is nan",
        },
        "loss": {"per_micro_batch": [1.25, float("nan"), 2.5], "divisor": 3, "grad_norm": float("inf")},
        "precision": {
            "param_dtype": "float32",
            "autocast": {"enabled": False, "device_type": None, "dtype": None},
            "grad_scaler": None,
        },
        "recipe": {"factory": None, "factory_kwargs": {}, "loss": None},
    }
    history = {
        "capacity": 8,
        "step": [5, 6, 7],
        "loss": [1.0, 1.1, float("nan")],
        "grad_norm": [0.5, None, float("inf")],
        "lr": [1e-3, 1e-3, 1e-3],
        "loss_scale": [None, None, None],
        "clipped": [False, None, None],
        "skipped": [False, False, True],
    }
    content = DumpContent(
        manifest=manifest,
        model=model,
        rng=rng,
        micro_batches=batches,
        history=history,
        optimizer=optimizer,
        scheduler={"class": "torch.optim.lr_scheduler.LambdaLR", "state": {"last_epoch": 7, "base_lrs": [1e-3]}},
        scaler={
            "scale": 65536.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 3,
        },
    )
    originals = {
        "model": {k: v.clone() for k, v in model.items()},
        "optimizer": optimizer,
        "batches": batches,
        "rng": rng,
        "history": history,
        "manifest": manifest,
    }
    return content, originals


def write_synthetic_dump(root, **kwargs):
    """Writes synthetic_content(**kwargs) under `root`; returns the rank dump directory."""
    from forensics.format import write_dump

    content, _ = synthetic_content(**kwargs)
    return write_dump(content, root)


OLD_CHUNK_BYTES = 64 << 20
"""The chunk size format versions 1 and 2 were written with."""


def as_version_1_dump(dump_dir, chunk_bytes: int = OLD_CHUNK_BYTES) -> None:
    """Rewrites a full-state rank dump's manifest as the version-1 writer made it: each file's `sha256` of its
    bytes, chunk digests only for a file above `chunk_bytes` (the old writer's rule), `format_version` 1."""
    import hashlib
    import json

    path = dump_dir / "manifest.json"
    manifest = json.loads(path.read_bytes())
    for name in manifest["files"]:
        data = (dump_dir / name).read_bytes()
        entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if len(data) > chunk_bytes:
            entry.update(
                chunk_size=chunk_bytes,
                chunks=[
                    hashlib.sha256(data[i : i + chunk_bytes]).hexdigest() for i in range(0, len(data), chunk_bytes)
                ],
            )
        manifest["files"][name] = entry
    manifest["format_version"] = 1
    path.write_text(json.dumps(manifest))


def read_everything(path) -> dict:
    """Opens a dump and calls every loader and verify_dump; returns what they gave (raises what they raise)."""
    from forensics.format import open_dump, verify_dump

    dump = open_dump(path)
    out = {
        "dump": dump,
        "step": dump.step,
        "rank": dump.rank,
        "trigger": dump.trigger,
        "model": dump.model_state(),
        "optimizer": dump.optimizer_state(),
        "scheduler": dump.scheduler_state(),
        "scaler": dump.scaler_state(),
        "history": dump.history(),
        "rng": [dump.rng_state(i) for i in range(dump.num_micro_batches)],
        "batches": [dump.micro_batch(i) for i in range(dump.num_micro_batches)],
        "sample_ids": [dump.sample_ids(i) for i in range(dump.num_micro_batches)],
    }
    out["verify"] = verify_dump(path)
    return out


# -- re-signed files: a change whose checksums pass, so the parsers behind them are reached ------------


def edit_manifest(dump, edit) -> None:
    """Applies `edit(manifest dict)` to a rank dump's manifest.json (which no checksum covers)."""
    import json

    manifest = json.loads((dump / "manifest.json").read_text())
    edit(manifest)
    (dump / "manifest.json").write_text(json.dumps(manifest))


def resign(dump, name: str, data: bytes) -> None:
    """Replaces a listed file and updates its size and sha256 in the manifest, so the checksum passes."""
    import hashlib

    (dump / name).write_bytes(data)
    edit_manifest(
        dump, lambda m: m["files"].__setitem__(name, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    )


def read_member(dump, name: str) -> bytes:
    """A file's bytes, decompressed when it is a zstd member."""
    import zstandard

    data = (dump / name).read_bytes()
    return zstandard.ZstdDecompressor().stream_reader(data).read() if name.endswith(".zst") else data


def resign_member(dump, name: str, data: bytes) -> None:
    """`resign`, compressing `data` first for a zstd member."""
    import zstandard

    resign(dump, name, zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)


def retype_tensor(blob: bytes, key: str, dtype: torch.dtype) -> bytes:
    """A safetensors blob with tensor `key` re-typed to `dtype`: its bytes reinterpreted, in the same shape when the
    element sizes agree, else flat (zero-padded to a whole number of elements)."""
    from safetensors.torch import load, save

    tensors = load(blob)
    old = tensors[key]
    raw = old.contiguous().reshape(-1).view(torch.uint8)
    size = torch.empty((), dtype=dtype).element_size()
    if size == old.element_size():
        tensors[key] = raw.view(dtype).reshape(old.shape)
    else:
        tensors[key] = torch.cat([raw, torch.zeros(-raw.numel() % size, dtype=torch.uint8)]).view(dtype)
    return save(tensors)


# -- counting host reads (the Guard's one-sync promise) ----------------------------------
HOST_READS = {
    "tolist",
    "item",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "numpy",
    "cpu",
    "__array__",
    "__format__",
    "__repr__",
}


class Watched(torch.Tensor):
    """A tensor that records every host read of its data (or of anything computed from it)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


class ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def assert_dump_holds_pre_step_state(dump, log, model, optimizer):
    """The dump's weights and AdamW state are bitwise the copy `log` took before the optimizer step."""
    state = dump.model_state()
    assert sorted(state) == sorted(log.model_state)
    for name, tensor in log.model_state.items():
        assert bitwise_equal(state[name], tensor), name
    expected = optimizer_state_by_name(log.optimizer_state, model, optimizer)
    dumped = dump.optimizer_state()
    assert dumped["class"] == "torch.optim.adamw.AdamW"
    assert sorted(dumped["state"]) == sorted(expected)
    for name, entries in expected.items():
        assert sorted(dumped["state"][name]) == sorted(entries), name
        for key, value in entries.items():
            assert bitwise_equal(dumped["state"][name][key], value), (name, key)
    [group] = dumped["param_groups"]
    [expected_group] = log.optimizer_state["param_groups"]
    assert group["lr"] == expected_group["lr"] and group["betas"] == list(expected_group["betas"])
    assert group["params"] == [n for n, _ in model.named_parameters()]
