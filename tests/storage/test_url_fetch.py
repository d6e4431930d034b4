"""How a replay from an s3:// URL fetches the dump (issue 50 item 2), against moto's S3 server (conftest.py): every
file once, in one GET up to spool.STREAM_BYTES, the fetch of every file started before the model is built (so it
overlaps the replay's own start, which a download-then-replay cannot), the files the replay waits on first, and no
more than a chunk per GET in memory.

The replayed dump is a small Llama (transformers, a built-in recipe) captured by the Guard at a NaN loss: its weights
(16 MB) and AdamW moments (33 MB) have chunk digests, as a real model's have.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main
from forensics.core.kinds import ExitCode
from forensics.format import open_dump, spec, write_dump


@pytest.fixture(scope="module")
def llama_dump(tmp_path_factory) -> Path:
    """A rank dump of a 1-layer Llama (hidden 64, 32000 words) whose loss was NaN, with AdamW moments, on disk."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from forensics.capture import DetectionConfig, Guard, GuardConfig

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        vocab_size=32000,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path_factory.mktemp("llama")), run_id="url", detection=DetectionConfig(on_nonfinite="skip")
        ),
    )
    ids = torch.randint(0, 32000, (2, 16))
    guard.record_batch({"input_ids": ids, "labels": ids, "sample_ids": ["a", "b"]})
    loss = model(input_ids=ids, labels=ids).loss
    guard.record_loss(loss * float("nan"))
    loss.backward()
    for p in model.parameters():
        optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
        optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)
        optimizer.state[p]["step"] = torch.tensor(3.0)
    guard.check()
    guard.close()
    return guard.dumps[0]


def _upload(dump: Path, bucket: str) -> str:
    import s3fs

    key = f"{bucket}/dumps/{dump.parent.parent.name}/{dump.parent.name}/{dump.name}"
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(dump), key, recursive=True)
    return f"s3://{key}"


def _record_gets(monkeypatch, events: list) -> None:
    """Appends ("get", file name, bytes the store answered with) for each GetObject s3fs sends, as it is sent."""
    import s3fs.core

    original = s3fs.core.S3FileSystem._call_s3

    async def recording(self, method, *args, **kwargs):
        if method != "get_object":
            return await original(self, method, *args, **kwargs)
        event = ["get", kwargs["Key"].rsplit("/", 1)[-1], 0]
        events.append(event)
        response = await original(self, method, *args, **kwargs)
        event[2] = int(response["ContentLength"])
        return response

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", recording)


def test_a_url_replay_fetches_every_file_once_and_before_the_model_is_built(
    s3_server, bucket, llama_dump, monkeypatch, tmp_path
):
    """The whole `forensics replay URL`: each listed file is fetched exactly once, whole (bytes = its size, one GET:
    none is above STREAM_BYTES), and the fetch of every one of them, the AdamW moments (the largest file, read last)
    included, is under way before the replay builds the model (before, the optimizer state was fetched only once the
    model was loaded)."""
    import forensics.format.spool as spool
    import forensics.replay.load.session as session

    url = _upload(llama_dump, bucket)
    sizes = {p.name: p.stat().st_size for p in llama_dump.iterdir() if p.name != spec.MANIFEST}
    largest = max(sizes, key=sizes.__getitem__)
    assert largest == spec.OPTIMIZER_TENSORS and sizes[largest] > 2 * spec.CHUNK_BYTES
    events: list = []
    _record_gets(monkeypatch, events)
    original_file, original_build = spool.SpooledFile.__init__, session.build_model

    def fetching(self, path, name, *args, **kwargs):
        events.append(["fetch", name])
        original_file(self, path, name, *args, **kwargs)

    def building(*args, **kwargs):
        events.append(["build"])
        return original_build(*args, **kwargs)

    monkeypatch.setattr(spool.SpooledFile, "__init__", fetching)
    monkeypatch.setattr(session, "build_model", building)
    result = CliRunner().invoke(
        main, ["replay", url, "--device", "cpu", "--no-rng-check", "-o", str(tmp_path / "r")], catch_exceptions=True
    )
    assert result.exit_code in (ExitCode.OK, ExitCode.NOT_REPRODUCED, ExitCode.NO_CULPRIT), (result.output, result)
    assert (tmp_path / "r" / "report.json").is_file()
    built = events.index(["build"])
    started = {event[1] for event in events[:built] if event[0] == "fetch"}
    assert started == set(sizes), f"not fetched before the model was built: {set(sizes) - started}"
    fetched: dict[str, list[int]] = {}
    for event in events:
        if event[0] == "get" and event[1] != spec.MANIFEST:
            fetched.setdefault(event[1], []).append(event[2])
    assert {name: sum(got) for name, got in fetched.items()} == sizes
    assert {name: len(got) for name, got in fetched.items()} == {
        name: math.ceil(size / spool.STREAM_BYTES) for name, size in sizes.items()
    }


def test_the_files_a_replay_waits_on_first_are_fetched_first(s3_server, bucket, llama_dump, monkeypatch):
    """One GET at a time: the small files the replay reads whole before it loads (JSON, micro-batches, RNG;
    smallest first), then the weights, the optimizer state last; a large file in ranges of STREAM_BYTES."""
    from concurrent.futures import ThreadPoolExecutor

    import forensics.format.spool as spool

    url = _upload(llama_dump, bucket)
    one = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(spool, "_pool", one)
    monkeypatch.setattr(spool, "STREAM_BYTES", 2 * spec.CHUNK_BYTES)
    events: list = []
    dump = open_dump(url)
    files = dump.manifest["files"]
    _record_gets(monkeypatch, events)
    try:
        dump.prefetch()
        for name in files:
            dump.verify_file(name)
    finally:
        dump.close()
        one.shutdown()
    order = [event[1] for event in events]
    small = sorted((n for n in files if not files[n].get("chunks")), key=lambda n: files[n]["size"])
    model_gets = math.ceil(files[spec.MODEL]["size"] / (2 * spec.CHUNK_BYTES))
    optimizer_gets = math.ceil(files[spec.OPTIMIZER_TENSORS]["size"] / (2 * spec.CHUNK_BYTES))
    assert optimizer_gets > 1
    assert order == small + [spec.MODEL] * model_gets + [spec.OPTIMIZER_TENSORS] * optimizer_gets
    assert all(event[2] <= 2 * spec.CHUNK_BYTES for event in events)


def test_a_fetch_holds_one_chunk_per_get_in_memory(s3_server, bucket):
    """The stated cache of a URL replay: a 48 MiB file (12 chunks, one GET) is fetched into its verified copy with
    the chunk being filled and the HTTP client's read-ahead in memory at the peak (measured ~17 MiB: spool.STREAM_HELD),
    never the GET's whole reply (before: the 48 MiB reply, then a copy of it)."""
    import tracemalloc

    import torch
    from forensics_test_helpers import synthetic_content

    import forensics.format.spool as spool

    content, _ = synthetic_content(step=3)
    content.model["large"] = torch.zeros(12 << 20, dtype=torch.float32)  # 48 MiB
    url = str(write_dump(content, f"s3://{bucket}/dumps"))
    dump = open_dump(url)
    assert dump.manifest["files"][spec.MODEL]["size"] > 12 * spec.CHUNK_BYTES
    tracemalloc.start()
    try:
        copy = dump.verify_file(spec.MODEL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert copy.stat().st_size == dump.manifest["files"][spec.MODEL]["size"]
    dump.close()
    assert peak < spool.STREAM_HELD, f"{peak / 2**20:.1f} MiB held while fetching"


def test_a_replay_that_fails_leaves_no_fetch_going(s3_server, bucket, llama_dump, monkeypatch, tmp_path):
    """A URL replay that ends in an error after the dump was opened (here: a model factory refused without --trust)
    stops fetching the dump's files: nothing is asked of the store once the command returned (before, the fetch
    pool went on through every file, the AdamW moments included, and the process waited for it at exit: a 70B dump's
    terabyte fetched for a command that had already failed)."""
    from concurrent.futures import ThreadPoolExecutor

    import forensics.format.spool as spool

    url = _upload(llama_dump, bucket)
    one = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(spool, "_pool", one)
    monkeypatch.setattr(spool, "STREAM_BYTES", spec.CHUNK_BYTES)  # a GET per chunk: many left when it fails
    events: list = []
    _record_gets(monkeypatch, events)
    try:
        result = CliRunner().invoke(
            main,
            ["replay", url, "--device", "cpu", "--factory", "no_such_module:build", "-o", str(tmp_path / "r")],
        )
        returned = len(events)
    finally:
        one.shutdown(wait=True)
    assert result.exit_code == ExitCode.BAD_INPUT, result.output
    optimizer_gets = [event for event in events if event[1] == spec.OPTIMIZER_TENSORS]
    assert len(events) - returned <= 1, f"{len(events) - returned} GETs after the command failed ({optimizer_gets})"


def test_a_replay_stopped_before_it_opens_the_dump_leaves_no_fetch_going(
    s3_server, bucket, llama_dump, monkeypatch, tmp_path
):
    """Ctrl-C while the command imports torch and the model's code (the fetch already started, nothing claimed it
    yet): the fetch stops with the command; nothing is asked of the store afterwards (before, the fetch pool went on
    through every file, and the interpreter's exit waited for it)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import forensics.core.gc_pause as gc_pause
    import forensics.format.spool as spool

    url = _upload(llama_dump, bucket)
    one = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(spool, "_pool", one)
    monkeypatch.setattr(spool, "STREAM_BYTES", spec.CHUNK_BYTES)  # a GET per chunk: many left when it stops
    events: list = []
    _record_gets(monkeypatch, events)
    opened = threading.Event()
    original_open = open_dump.__globals__["open_unclaimed"]

    def opening(*args, **kwargs):
        try:
            return original_open(*args, **kwargs)
        finally:
            opened.set()

    monkeypatch.setitem(open_dump.__globals__, "open_unclaimed", opening)

    def interrupted():  # Ctrl-C during the imports, once the prefetch opened the dump
        assert opened.wait(60)
        raise KeyboardInterrupt

    monkeypatch.setattr(gc_pause, "gc_paused", interrupted)
    try:
        result = CliRunner().invoke(main, ["replay", url, "--device", "cpu", "-o", str(tmp_path / "r")])
        returned = len(events)
        for thread in threading.enumerate():
            if thread.name == "forensics-prefetch":
                thread.join(60)
    finally:
        one.shutdown(wait=True)
    assert result.exit_code != 0
    large = [event for event in events[returned:] if event[1] in (spec.MODEL, spec.OPTIMIZER_TENSORS)]
    print("DBG", returned, [e[1] for e in events])
    assert len(large) <= 1, f"{len(large)} GETs of the state's files after the command stopped"


def test_ctrl_c_while_waiting_for_the_prefetched_open_leaves_no_fetch_going(s3_server, bucket, llama_dump, monkeypatch):
    """Ctrl-C (a real SIGINT) while open_dump waits for the open the prefetch started: once that open ends, its Dump
    is closed, so its fetch stops (before, claim had taken the Dump's place and nobody closed it: the fetch pool went
    through every file and the interpreter's exit waited for it)."""
    import os
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import forensics.format.spool as spool
    from forensics.format.reader import Dump, start_fetching

    url = _upload(llama_dump, bucket)
    one = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(spool, "_pool", one)
    monkeypatch.setattr(spool, "STREAM_BYTES", spec.CHUNK_BYTES)
    events: list = []
    _record_gets(monkeypatch, events)
    go = threading.Event()
    original_open = open_dump.__globals__["open_unclaimed"]

    def slow_open(*args, **kwargs):
        assert go.wait(60)
        return original_open(*args, **kwargs)

    monkeypatch.setitem(open_dump.__globals__, "open_unclaimed", slow_open)
    fetching = threading.Event()
    original_prefetch = Dump.prefetch

    def prefetch(self):
        original_prefetch(self)
        fetching.set()

    monkeypatch.setattr(Dump, "prefetch", prefetch)
    start_fetching(url)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            open_dump(url)
        returned = len(events)
        go.set()
        assert fetching.wait(60)  # (the interrupted join left the thread marked as stopped: it cannot be joined)
    finally:
        go.set()
        timer.cancel()
        one.shutdown(wait=True)
    large = [event for event in events[returned:] if event[1] in (spec.MODEL, spec.OPTIMIZER_TENSORS)]
    assert len(large) <= 1, f"{len(large)} GETs of the state's files after the Ctrl-C"


def test_a_read_of_a_file_closed_for_a_bad_chunk_says_the_file_is_corrupt(s3_server, bucket, monkeypatch):
    """A remote file whose first chunk no longer matches (the object replaced in the bucket): the read that finds it
    closes the file's copy (the GETs still queued are cancelled), and a read of a later part of the same file, by
    another loader thread or after the first error, is refused the same way, DumpCorruptError naming the file, never
    concurrent.futures' CancelledError (an error no command handles: a traceback instead of exit 2)."""
    from concurrent.futures import ThreadPoolExecutor

    import s3fs
    import torch
    from forensics_test_helpers import synthetic_content

    import forensics.format.spool as spool
    from forensics.core.errors import DumpCorruptError

    content, _ = synthetic_content(step=3)
    content.model["large"] = torch.zeros(12 << 20, dtype=torch.float32)  # 48 MiB: 12 chunks
    url = str(write_dump(content, f"s3://{bucket}/dumps"))
    one = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(spool, "_pool", one)
    monkeypatch.setattr(spool, "STREAM_BYTES", spec.CHUNK_BYTES)  # a GET per chunk: the later ones still queued
    dump = open_dump(url)
    key = url.removeprefix("s3://") + "/" + spec.MODEL
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    data = bytearray(fs.cat_file(key))
    data[100] ^= 0xFF  # the first chunk changed, the size the same
    fs.pipe_file(key, bytes(data))
    size = dump.manifest["files"][spec.MODEL]["size"]
    try:
        copy = dump._chunk_verifier(spec.MODEL)
        with pytest.raises(DumpCorruptError):
            copy.wait(0, 1)
        with pytest.raises(DumpCorruptError, match="sha256"):
            copy.wait(size - 1, size)
    finally:
        dump.close()
        one.shutdown(wait=True)


def test_an_unexpected_error_in_the_early_open_prints_no_traceback_and_the_replay_opens_again(monkeypatch):
    """An error of another kind in the early open (a storage library's own exception) does not escape the prefetch
    thread (Python would print its traceback on stderr); claim gives None, so the replay's own open_dump meets the
    error and says it as always."""
    import threading

    from forensics.format import prefetch

    escaped: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_type))

    def broken() -> None:
        raise RuntimeError("a storage library's own error")

    prefetch.start("s3://bucket/run/step-000000001", 0, None, [], broken)
    assert prefetch.claim("s3://bucket/run/step-000000001", 0, None, []) is None
    assert escaped == []
