"""A dump from someone else is untrusted input. Each case here was found by an attacker-style sweep: hostile
manifests, re-signed files (the checksums pass, so the parsers are reached), crafted archives, links.
Every one must end in exit 2 with a one-line reason (or a correct answer), never exit 1, never a write
outside the chosen output, never an unbounded allocation.

The fuzz test at the end re-signs 96 seeded random mutations (240 with --runslow); FORENSICS_FUZZ_MUTANTS=N (and
FORENSICS_FUZZ_SEED) runs more of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard
from click.testing import CliRunner
from forensics_test_helpers import guarded_step

import forensics.format.members as members
from forensics.cli import main
from forensics.demo.scenarios import SCENARIOS
from forensics.core.kinds import ExitCode
from forensics_test_helpers import edit_manifest, read_member, resign, resign_member, retype_tensor

REPLAY = ["--device", "cpu", "--no-bisect", "--no-rng-check"]
REPO = Path(__file__).resolve().parents[2]


def run(args: list, cwd: Path | None = None):
    """`forensics ARGS` in-process; returns the click Result (never raises)."""
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    finally:
        os.chdir(old)


def assert_exit(result, code: int) -> None:
    assert result.exit_code == code, (
        result.exit_code,
        result.stdout[-2000:],
        result.stderr[-2000:],
        repr(result.exception),
    )
    if code == ExitCode.BAD_INPUT:
        assert result.stderr.startswith("Error:") or "Error:" in result.stderr


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    return SCENARIOS["bad_sample"].capture(root, device="cpu").dump_path


@pytest.fixture
def dump(pristine, tmp_path) -> Path:
    """A fresh copy of a real, replayable rank dump."""
    copy = tmp_path / "dumps" / "run" / "step-000000006" / "rank-00000"
    shutil.copytree(pristine, copy)
    return copy


@dataclass
class ChildRun:
    code: int
    stdout: str
    stderr: str
    peak_rss: int
    """The child's peak resident memory, bytes (its own VmHWM)."""


CHILD = """
import json, resource, sys, traceback
limit = int(sys.argv[1])
if limit:  # as `ulimit -v`: an allocation beyond it fails (MemoryError) instead of swapping the machine
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from forensics.cli import main
for args in json.loads(sys.argv[2]):
    try:
        main(args, prog_name="forensics")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # MemoryError under the limit: reported as the exit 1 it would be, and the next one runs
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        stream.write("\\nEXIT_CODE %d\\n" % code)
        stream.flush()
def peak_kib():  # VmHWM belongs to this process's own memory map: ru_maxrss keeps the parent's peak across exec
    try:
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.stderr.write("PEAK_RSS_KIB %d\\n" % peak_kib())
"""
GiB = 1 << 30
MEMORY_LIMIT = 4 * GiB
ZSTD_BLOCK = 128 << 10


def zstd_bomb(prefix: bytes, size: int, declare: bool = True, fill: bytes = b"\0", suffix: bytes = b"") -> bytes:
    """A zstd frame of `prefix`, then `fill` bytes, then `suffix`: `size` bytes in all, declared in its header (or
    not), written by hand as an adversary would: the fill as RLE blocks of 128 KiB, 4 bytes each (3 GiB in ~98 KB,
    built in a blink instead of compressing gigabytes). A 128 KiB window: any zstd decoder reads it."""
    out = bytearray((0xFD2FB528).to_bytes(4, "little"))
    out += bytes([0xC0 if declare else 0x00, 0x38])  # an 8-byte content size (or none); window 2**17
    out += size.to_bytes(8, "little") if declare else b""
    blocks = [(0, prefix[i : i + ZSTD_BLOCK]) for i in range(0, len(prefix), ZSTD_BLOCK)]
    left = size - len(prefix) - len(suffix)
    while left:
        blocks.append((1, min(left, ZSTD_BLOCK)))
        left -= blocks[-1][1]
    blocks += [(0, suffix)] if suffix else []
    for index, (kind, body) in enumerate(blocks):
        n = len(body) if kind == 0 else body
        out += ((index == len(blocks) - 1) | kind << 1 | n << 3).to_bytes(3, "little")
        out += body if kind == 0 else fill
    return bytes(out)


"""The address space a child may map (RLIMIT_AS): a bomb inflated whole fails with MemoryError instead of passing."""


def run_children(commands: list[list], cwd: Path | None = None, memory_limit: int = MEMORY_LIMIT) -> list[ChildRun]:
    """`forensics ARGS` for each of `commands`, one after another in ONE fresh process under an address-space limit
    (a hang fails the test instead of blocking it; one interpreter start for them all); each result carries the
    process's peak RSS over all of them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = json.dumps([[str(a) for a in command] for command in commands])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(memory_limit), args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    stderr, _, peak = done.stderr.rpartition("PEAK_RSS_KIB ")
    assert done.returncode == 0 and peak, done.stderr[-3000:]
    rss = int(peak.split()[0]) * 1024
    (codes, outs), (_, errs) = _by_command(done.stdout, len(commands)), _by_command(stderr, len(commands))
    return [ChildRun(code, out, err, rss) for code, out, err in zip(codes, outs, errs)]


def _by_command(text: str, count: int) -> tuple[list[int], list[str]]:
    """The exit codes and the output of each command, from a stream the child marked after each one."""
    pieces = text.split("\nEXIT_CODE ")
    assert len(pieces) == count + 1, text[-3000:]
    codes = [int(piece.split("\n", 1)[0]) for piece in pieces[1:]]
    return codes, [pieces[0]] + [piece.partition("\n")[2] for piece in pieces[1:-1]]


def run_child(args: list, cwd: Path | None = None, memory_limit: int = MEMORY_LIMIT) -> ChildRun:
    """`forensics ARGS` in a fresh process under an address-space limit, with its peak RSS (its stdout is not kept)."""
    return run_children([args], cwd, memory_limit)[0]


def assert_refused_within_a_gib(result: ChildRun, *words: str) -> None:
    """Exit 2 with a sentence holding `words`, and the process never held more than 1 GiB."""
    assert result.code == ExitCode.BAD_INPUT, (result.code, result.stderr[-3000:])
    assert "Error:" in result.stderr and all(w in result.stderr for w in words), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert 0 < result.peak_rss <= GiB, result.peak_rss


@pytest.fixture
def make_fifo():
    """`make_fifo(path)`: a FIFO the command under test meets in-process. Were the command to open it and wait for
    the other end (a hang), a watcher opens that end after 100 s, so the test fails instead of blocking the suite."""
    paths, done, rescued = [], threading.Event(), []

    def watch():
        if done.wait(100):
            return
        while not done.is_set():
            for path in paths:
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))  # a blocked reader or writer goes on
                    rescued.append(path)
            time.sleep(0.5)

    def make(path: Path) -> None:
        os.mkfifo(path)
        paths.append(path)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield make
    done.set()
    watcher.join()
    assert not rescued, f"a command blocked on the FIFO(s) {sorted(set(map(str, rescued)))}"


# -- names from a dump never become paths or raw terminal output -------------------------------


@pytest.mark.parametrize("run_id", ["/abs/path/ESCAPED", "../../..", "../escaped", "x" * 300, "a\x1b]0;pwned\x07"])
def test_a_hostile_run_id_is_refused_and_nothing_is_written(dump, tmp_path, run_id):
    edit_manifest(dump, lambda m: m.__setitem__("run_id", run_id))
    work = tmp_path / "cwd"
    work.mkdir()
    for verb in (["inspect"], ["verify"], ["replay", *REPLAY]):
        result = run([verb[0], dump, *verb[1:]], cwd=work)
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "run_id" in result.stderr and "\x1b" not in result.stderr + result.stdout
    assert list(work.iterdir()) == [] and not Path("/abs/path/ESCAPED").exists()


def test_a_hostile_run_id_in_a_packed_archive_is_refused(dump, tmp_path):
    edit_manifest(dump, lambda m: m.__setitem__("run_id", "../../.."))
    archive = _archive(tmp_path / "evil.tar.zst", {f"rank-00000/{p.name}": p.read_bytes() for p in dump.iterdir()})
    work = tmp_path / "cwd"
    work.mkdir()
    assert_exit(run(["replay", archive, *REPLAY], cwd=work), ExitCode.BAD_INPUT)
    assert list(work.iterdir()) == []


# -- wrong types and sizes in the manifest ---------------------------------------------------


@pytest.mark.parametrize(
    "path, value",
    [
        (("recipe",), "x"),
        (("environment",), [1]),
        (("precision",), "x"),
        (("determinism",), "x"),
        (("loss",), 5),
        (("missing_ranks",), 5),
        (("micro_batches", 0, "sample_ids"), 5),
        (("world_size",), 2**31),
        (("rank",), 3),
        (("trigger",), "nan"),
        (("trigger", "micro_batch"), 9),
        (("files", "model.safetensors", "size"), "big"),
        (("micro_batches",), [{}] * 5000),
        (("precision", "autocast", "dtype"), 16),
        (("loss", "divisor"), 0),
    ],
)
def test_wrong_manifest_field_types_exit_2_naming_the_field(dump, path, value):
    def edit(manifest):
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    edit_manifest(dump, edit)
    result = run(["inspect", dump])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert str(path[0]) in result.stderr


@pytest.mark.parametrize("text", ["[" * 100_000, '{"format": "forensics-dump", "n": ' + "9" * 5000 + "}"])
def test_a_manifest_that_is_too_deep_or_has_a_huge_number_exits_2(dump, text):
    (dump / "manifest.json").write_text(text)
    assert_exit(run(["inspect", dump]), ExitCode.BAD_INPUT)


def test_a_file_name_that_is_not_a_plain_name_exits_2(dump):
    edit_manifest(dump, lambda m: m["files"].__setitem__("x" * 300, {"size": 1, "sha256": "0" * 64}))
    assert_exit(run(["verify", dump]), ExitCode.BAD_INPUT)


def test_no_micro_batches_is_bad_input_not_suspected_hardware(dump):
    edit_manifest(dump, lambda m: m.__setitem__("micro_batches", []) or m["trigger"].__setitem__("micro_batch", None))
    result = run(["replay", dump, *REPLAY])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "no micro-batch" in result.stderr


# -- re-signed files: the checksum passes, the parser must still refuse --------------------------


@pytest.mark.parametrize(
    "name, data",
    [
        ("history.json", b"[1]"),
        ("rng.json", b"[1]"),
        ("rng.json", b'{"micro_batches": [1, 2]}'),
        ("optimizer.json", b'{"param_groups": []}'),
        ("scheduler.json", b"5"),
        ("history.json", b'{"loss": 5}'),
    ],
)
def test_re_signed_json_files_of_the_wrong_shape_exit_2(dump, name, data):
    resign(dump, name, data)
    assert_exit(run(["replay", dump, *REPLAY]), ExitCode.BAD_INPUT)


def test_an_optimizer_tensor_key_without_a_slash_exits_2(dump):
    from safetensors.torch import load_file, save

    tensors = load_file(str(dump / "optimizer.safetensors"))
    key = next(iter(tensors))
    tensors["noslash"] = tensors.pop(key)
    resign(dump, "optimizer.safetensors", save(tensors))
    result = run(["replay", dump, *REPLAY])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "state/<param name>/<key>" in result.stderr


def test_a_zstd_frame_that_declares_a_huge_size_is_capped_while_streaming(dump, monkeypatch):
    monkeypatch.setattr(members, "MAX_DECOMPRESSED", 1 << 20)  # our cap, lowered to keep the test small
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (4 << 20))  # the frame header declares 4 MiB
    resign(dump, "batch-000.safetensors.zst", bomb)
    result = run(["replay", dump, *REPLAY])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "declares 4194304 decompressed bytes, more than the 1048576" in result.stderr


def test_a_huge_sparse_json_file_is_refused_by_its_size_before_it_is_read(dump):
    with open(dump / "history.json", "wb") as handle:
        handle.truncate(6 << 30)  # sparse: costs no disk
    edit_manifest(dump, lambda m: m["files"].__setitem__("history.json", {"size": 6 << 30, "sha256": "0" * 64}))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for verb in ("inspect", "replay"):
        result = run([verb, dump] + (REPLAY if verb == "replay" else []))
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "more than" in result.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB: nothing read whole


# -- links and archives ------------------------------------------------------------------------


def test_a_link_out_of_a_directory_dump_is_refused_by_verify_replay_and_pack(dump, tmp_path):
    (dump / "history.json").unlink()
    (dump / "history.json").symlink_to("/etc/passwd")
    assert_exit(run(["verify", dump]), ExitCode.BAD_INPUT)
    assert_exit(run(["replay", dump, *REPLAY]), ExitCode.BAD_INPUT)
    assert_exit(run(["pack", dump, "-o", tmp_path / "x.tar.zst"]), ExitCode.BAD_INPUT)
    assert not (tmp_path / "x.tar.zst").exists()


def test_pack_refuses_a_fifo_that_its_reader_would_refuse(dump, tmp_path):
    os.mkfifo(dump / "pipe")
    assert_exit(run(["pack", dump, "-o", tmp_path / "x.tar.zst"]), ExitCode.BAD_INPUT)


def _archive(path: Path, members: dict[str, bytes | None], pax_size: int = 0) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
    return path


@pytest.mark.parametrize(
    "members, why",
    [
        ({f"d/{i}": b"" for i in range(300)}, "members"),
        ({"d/" + "/".join(["x"] * 40) + "/f": b"x"}, "deeper"),
        ({"d/big": b"\0" * (3 << 20)}, "unpacks to more than"),
    ],
)
def test_archive_limits_are_enforced_before_writing(tmp_path, members, why, monkeypatch):
    archive = _archive(tmp_path / "a.tar.zst", members)
    flags = ["--max-members", "100", "--max-unpacked-gb", "0.001"]
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("forensics-*"))
    result = run(["verify", archive, *flags])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert why in result.stderr
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("forensics-*")) <= before  # nothing left behind


def test_a_user_can_raise_the_archive_limits(dump, tmp_path):
    archive = tmp_path / "ok.tar.zst"
    assert_exit(run(["pack", dump, "-o", archive]), ExitCode.OK)
    assert_exit(run(["verify", archive, "--max-members", "5"]), ExitCode.BAD_INPUT)
    assert_exit(run(["verify", archive, "--max-members", "500"]), ExitCode.OK)


# -- the user's code raising on the dump's data is theirs (exit 2, their traceback) -----------------


def test_the_users_loss_raising_on_dump_data_exits_2_with_their_traceback(dump, tmp_path):
    (tmp_path / "userpkg_loss.py").write_text(
        "def strict_loss(model, batch):\n"
        "    labels = next(v for v in batch.values() if hasattr(v, 'max'))\n"
        "    if int(labels.max()) >= 2:\n"
        "        raise IndexError(f'label {int(labels.max())} is out of range for my 2-class head')\n"
        "    return model(labels).logits.mean()\n"
    )
    result = run(["replay", dump, *REPLAY, "--loss", "userpkg_loss:strict_loss", "--path", tmp_path])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "IndexError" in result.stderr and "userpkg_loss.py" in result.stderr
    assert "out of range for my 2-class head" in result.stderr


# -- the last eight of the adversarial run (issue 23): exit 2 with a sentence, at most 1 GiB ----------------


@pytest.fixture(scope="module")
def skeleton_bomb() -> bytes:
    """A ~100 KB zstd frame whose header declares 3 GiB: '[', 3 GiB of spaces, ']' (valid JSON when decompressed)."""
    bomb = zstd_bomb(b"[", 3 * GiB, fill=b" ", suffix=b"]")
    assert len(bomb) <= 100_000
    return bomb


def test_a_skeleton_that_hides_its_size_is_capped_while_streaming(dump, tmp_path):
    resign(dump, "batch-000.json.zst", zstd_bomb(b"[", (65 << 20) + 2, declare=False, fill=b" ", suffix=b"]"))
    assert_exit(run(["inspect", dump]), ExitCode.OK)  # inspect reads frame headers only
    for verb in ("verify", "replay"):
        result = run([verb, dump, *(REPLAY + ["-o", tmp_path / "report"] if verb == "replay" else [])])
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "batch-000.json.zst decompresses to more than 67108864 bytes" in result.stderr + result.stdout


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.__setitem__("environment", None), "'environment' must be an object"),
        (lambda m: m["trigger"].__setitem__("kind", "bogus"), "'trigger.kind' is 'bogus'"),
    ],
)
def test_a_null_section_or_an_unknown_trigger_kind_is_refused_by_inspect_and_replay(dump, tmp_path, edit, field):
    edit_manifest(dump, edit)
    assert_exit(run(["inspect", dump]), ExitCode.BAD_INPUT)
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert field in result.stderr


def test_a_weight_re_typed_to_int32_is_refused_naming_it(dump, tmp_path):
    import torch
    from safetensors.torch import load

    blob = (dump / "model.safetensors").read_bytes()
    key = "transformer.h.0.attn.c_attn.weight"
    assert load(blob)[key].dtype == torch.float32
    resign(dump, "model.safetensors", retype_tensor(blob, key, torch.int32))
    assert_exit(run(["verify", dump]), ExitCode.OK)  # the checksums pass: only the model can tell
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert (
        f"the dtype of tensor {key} in the dump (int32) does not match the model's parameter (float32)" in result.stderr
    )


@pytest.fixture(scope="module")
def pristine_pair(tmp_path_factory) -> Path:
    """A dump of the demo's built-in BatchNorm model (forensics.demo.models:sensor_classifier)."""
    return SCENARIOS["pair"].capture(tmp_path_factory.mktemp("pair"), device="cpu").dump_path


def test_a_built_in_model_raising_on_a_reshaped_batch_is_bad_input(pristine_pair, tmp_path):
    from safetensors.torch import load, save

    dump = tmp_path / "run" / "step-000000005" / "rank-00000"
    shutil.copytree(pristine_pair, dump)
    tensors = load(read_member(dump, "batch-000.safetensors.zst"))
    key = next(k for k, t in tensors.items() if t.dim() == 3)  # the features, (4 samples, 8 channels, 16 steps)
    tensors[key] = tensors[key].reshape(16, 8, 4).contiguous()
    resign_member(dump, "batch-000.safetensors.zst", save(tensors))
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "the model the dump's recipe names (built into forensics) raised ValueError" in result.stderr
    assert "does not fit that model" in result.stderr
    # one sentence: no traceback through forensics' own files, and the code is not called the user's
    assert "Traceback" not in result.stderr and "your code raised" not in result.stderr
    said = [line for line in result.stderr.strip().splitlines() if not line.startswith("[")]  # not the progress
    assert len(said) == 1 and said[0].startswith("Error:"), result.stderr


def _damage(dump: Path, name: str, how: str, make_fifo=None) -> None:
    path = dump / name
    if how == "flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "deleted":
        path.unlink()
    else:
        path.unlink()
        make_fifo(path)  # opened for reading, it would block until a writer came


@pytest.mark.parametrize(
    "name, how",
    [
        ("window.json", "flipped"),
        ("window-rng.safetensors", "truncated"),
        ("window-rng.safetensors", "deleted"),
        ("window-rng.safetensors", "fifo"),
    ],
)
def test_a_damaged_flight_recorder_is_named_in_the_report_and_left_out(dump, tmp_path, name, how, make_fifo):
    _damage(dump, name, how, make_fifo)
    result = run(["replay", dump, *REPLAY, "--json", "-o", tmp_path / "report"])
    assert result.exit_code in (ExitCode.OK, ExitCode.NOT_REPRODUCED, ExitCode.NO_CULPRIT), result.stderr[-3000:]
    [damaged] = json.loads((tmp_path / "report" / "report.json").read_text())["dump"]["damaged"]
    assert damaged["file"] == name and "window replay is skipped" in damaged["lost"]
    text = (tmp_path / "report" / "report.md").read_text()
    assert "The dump is damaged" in text and name in text and "flight recorder" in text


@pytest.mark.parametrize(
    "name, how", [("scheduler.json", "flipped"), ("history.json", "fifo"), ("rng.safetensors", "truncated")]
)
def test_a_damaged_essential_file_ends_the_replay_naming_it(dump, tmp_path, name, how, make_fifo):
    _damage(dump, name, how, make_fifo)
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert name in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "report").exists()


def test_a_rank_directory_holding_another_ranks_dump_is_refused_naming_both(dump, tmp_path):
    shutil.copytree(dump, dump.parent / "rank-00001")
    words = ("rank-00001 is named for rank 1, but its manifest says rank 0", "rank-00000")
    result = run(["verify", dump.parent])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert all(w in result.stderr for w in words)
    result = run(["replay", dump.parent, "--all-ranks", *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert all(w in result.stderr for w in words) and not (tmp_path / "report").exists()


def test_a_report_is_never_written_into_the_dump(dump, tmp_path):
    (tmp_path / "link").symlink_to(dump.parent)
    targets = [dump, dump / "report", tmp_path / "link" / "rank-00000" / "report", dump / "manifest.json"]
    for target in targets:
        result = run(["replay", dump, *REPLAY, "-o", target])
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "the report would be written into the dump" in result.stderr and "choose another -o" in result.stderr
    result = run(["replay", dump, *REPLAY, "--blocklist", dump / "blocklist.jsonl", "-o", tmp_path / "r"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "choose another --blocklist" in result.stderr
    assert_exit(run(["replay", dump.parent, *REPLAY], cwd=dump), ExitCode.BAD_INPUT)  # the default, from inside
    assert_exit(run(["verify", dump]), ExitCode.OK)


# -- the fuzz: seeded re-signed mutations ---------------------------------------------------------

HOSTILE_VALUES = [
    5,
    -1,
    "x",
    [1],
    {},
    None,
    True,
    2**63,
    1e308,
    "../../escaped",
    "/abs/ESCAPED",
    "\x1b]0;pwned\x07",
    [[[[]]]],
    {"__float__": "zzz"},
    "",
    0,
]


def _mutate_json(rng: random.Random, node):
    """Replaces one random node of a JSON tree (in place where possible); returns the new root."""
    containers = [(None, None, node)]
    stack = [node]
    while stack:
        current = stack.pop()
        items = (
            current.items() if isinstance(current, dict) else enumerate(current) if isinstance(current, list) else ()
        )
        for key, child in items:
            containers.append((current, key, child))
            stack.append(child)
    parent, key, _ = rng.choice(containers)
    value = rng.choice(HOSTILE_VALUES)
    if parent is None:
        return value
    parent[key] = value
    return node


RETYPES = ["int32", "int64", "float16", "bfloat16", "float64", "uint8", "bool"]


def _skeleton_mutant(rng: random.Random, dump: Path) -> str:
    """A batch skeleton (json.zst) with one node replaced, or one whose frame declares more than the JSON cap."""
    name = rng.choice(sorted(p.name for p in dump.glob("batch-*.json.zst")))
    if rng.random() < 0.2:
        resign(dump, name, zstd_bomb(b"[", (65 << 20) + 2, fill=b" ", suffix=b"]"))
    else:
        resign_member(dump, name, json.dumps(_mutate_json(rng, json.loads(read_member(dump, name)))).encode())
    return name


def _dtype_mutant(rng: random.Random, dump: Path) -> str:
    """A tensor of any safetensors member re-typed (its bytes reinterpreted), re-signed."""
    import torch
    from safetensors.torch import load

    name = rng.choice(sorted(p.name for p in dump.iterdir() if ".safetensors" in p.name))
    tensors = load(read_member(dump, name))
    if not tensors:
        raise ValueError("nothing to re-type")
    key = rng.choice(sorted(tensors))
    resign_member(dump, name, retype_tensor(read_member(dump, name), key, getattr(torch, rng.choice(RETYPES))))
    return f"{name} (dtype)"


def _mutant(rng: random.Random, dump: Path) -> str:
    roll = rng.random()
    if roll < 0.15:
        return _skeleton_mutant(rng, dump)
    if roll < 0.3:
        return _dtype_mutant(rng, dump)
    if roll < 0.35:
        shutil.copytree(dump, dump.parent / "rank-00001")  # another rank's name, rank 0's dump
        return "rank-00001 (copy)"
    files = sorted(p.name for p in dump.iterdir())
    name = rng.choice(files + ["manifest.json"] * 4)  # the manifest is checked by no checksum: fuzz it more
    data = (dump / name).read_bytes()
    if name.endswith(".json") and rng.random() < 0.7:
        mutated = json.dumps(_mutate_json(rng, json.loads(data))).encode()
    elif rng.random() < 0.5:
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        mutated = bytes(mutated)
    else:
        mutated = data[: rng.randrange(len(data))]
    if name == "manifest.json":
        (dump / name).write_bytes(mutated)
    else:
        resign(dump, name, mutated)
    return name


def test_fuzz_re_signed_mutants_give_exit_0_or_2_never_1(pristine, tmp_path, caplog, request):
    caplog.set_level("CRITICAL")
    mutants = int(os.environ.get("FORENSICS_FUZZ_MUTANTS", "240" if request.config.getoption("--runslow") else "96"))
    replays = max(8, mutants // 12)  # a replay costs ~1 s here; inspect / verify run on every mutant
    rng = random.Random(int(os.environ.get("FORENSICS_FUZZ_SEED", "20261126")))
    work = tmp_path / "cwd"
    work.mkdir()
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seen: dict[str, dict[int, int]] = {}
    for trial in range(mutants):
        dump = tmp_path / f"m{trial}" / "run" / "step-000000006" / "rank-00000"
        shutil.copytree(pristine, dump)
        try:
            name = _mutant(rng, dump)
        except (ValueError, json.JSONDecodeError):
            shutil.rmtree(tmp_path / f"m{trial}")
            continue
        target = dump.parent if name == "rank-00001 (copy)" else dump
        verbs = [["inspect", target], ["verify", target]]
        if trial < replays:
            verbs.append(["replay", target, *REPLAY, "--all-ranks", "-o", tmp_path / f"m{trial}" / "report"])
        for verb in verbs:
            result = run(verb, cwd=work)
            allowed = (0, 2, 3, 4) if verb[0] == "replay" else (0, 2)
            if target != dump:
                allowed = (2,)  # a rank dump under another rank's name is never read as that rank
            assert result.exit_code in allowed, (
                trial,
                name,
                verb[0],
                result.exit_code,
                result.stderr[-1500:],
                repr(result.exception),
            )
            seen.setdefault(name, {}).setdefault(result.exit_code, 0)
            seen[name][result.exit_code] += 1
        shutil.rmtree(tmp_path / f"m{trial}")
    assert list(work.iterdir()) == [], "something was written outside the chosen output"
    assert not Path("/abs/ESCAPED").exists() and not (tmp_path.parent / "escaped").exists()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss < 2 * 1024 * 1024  # KiB: < 2 GiB
    assert seen["manifest.json"].get(2, 0) > 0 and len(seen) > 5  # the sweep reached the parsers of many files
    assert any(n.endswith(".json.zst") for n in seen) and any(n.endswith("(dtype)") for n in seen)
    assert "rank-00001 (copy)" in seen


# -- unfinished dumps of killed writers are cleaned safely -------------------------------------------


def test_stale_temporaries_of_dead_writers_are_removed_at_the_next_dump(tmp_path, helpers):
    import subprocess
    import sys
    import time

    import forensics.format.writer as writer
    from forensics.format import stale

    step = tmp_path / "old-run" / "step-000000003"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = stale.temporary_name("rank-00000").rsplit("-", 3)[1]
    killed = step / f".tmp-rank-00000-{host}-{dead.pid}-deadbeef"
    alive = step / f".tmp-rank-00001-{host}-{os.getppid()}-cafecafe"  # a writer that is still running
    old = step / ".tmp-rank-00002-0123abcd"  # an older writer's name: judged by age
    other_host = step / ".tmp-rank-00003-elsewhere-1-0123abcd"
    for path in (killed, alive, old, other_host):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"\0" * 1024)
    two_days_ago = time.time() - 2 * 86400
    os.utime(old, (two_days_ago, two_days_ago))
    assert stale.stale_temporaries(tmp_path) == sorted([killed, old])
    writer._CLEANED.discard(str(tmp_path))
    helpers.write_synthetic_dump(tmp_path)
    assert not killed.exists() and not old.exists() and alive.exists() and other_host.exists()


def test_an_archive_whose_pax_header_claims_gigabytes_is_refused_within_bounded_memory(tmp_path):
    header = tarfile.TarInfo("d/f")
    header.pax_headers = {"comment": "x"}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(header, io.BytesIO(b""))
    data = bytearray(raw.getvalue())
    # The pax header's size field (octal, at offset 124 of the first header) now claims 3 GiB of zeros.
    data[124:136] = b"%011o\0" % (3 << 30)
    checksum = sum(data[:148]) + 8 * 32 + sum(data[156:512])
    data[148:156] = b"%06o\0 " % checksum
    (tmp_path / "pax.tar.zst").write_bytes(zstd_bomb(bytes(data[:512]), 512 + 3 * GiB, declare=False))  # 3 GiB of
    # zeros after the header, in ~100 KB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run(["verify", tmp_path / "pax.tar.zst"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1536 << 10)  # KiB: < 1.5 GiB


# -- what replay writes beside a dump: report-rank<R>/ and replays.jsonl in the step directory -------------


@pytest.mark.parametrize("into", ["rank", "outside"])
def test_a_report_rank_link_in_the_step_directory_is_not_followed(dump, tmp_path, into):
    """A crafted step directory whose `report-rank0` links into its rank dump (or anywhere else) does not get
    the default report written through the link: it goes under ./forensics_reports/ instead."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dump.parent / "report-rank0").symlink_to(dump if into == "rank" else elsewhere)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run(["replay", dump.parent, *REPLAY], cwd=cwd)
    assert_exit(result, ExitCode.NO_CULPRIT)  # --no-bisect
    assert not (dump / "report.json").exists() and not list(elsewhere.iterdir())
    assert list((cwd / "forensics_reports").glob("*/report.json"))
    assert_exit(run(["verify", dump]), ExitCode.OK)


def test_a_replays_note_that_links_elsewhere_is_not_appended_to(dump, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (dump.parent / "replays.jsonl").symlink_to(victim)
    assert_exit(run(["replay", dump.parent, *REPLAY, "-o", tmp_path / "report"]), ExitCode.NO_CULPRIT)
    assert victim.read_text() == "precious\n"


def test_a_replays_note_that_is_a_fifo_blocks_neither_replay_nor_list(dump, tmp_path, make_fifo):
    make_fifo(dump.parent / "replays.jsonl")
    assert_exit(run(["replay", dump.parent, *REPLAY, "-o", tmp_path / "report"]), ExitCode.NO_CULPRIT)
    assert_exit(run(["list", dump.parent.parent, "--json"]), ExitCode.OK)


def test_a_huge_replays_note_is_read_within_bounded_memory(dump, tmp_path):
    """`forensics list` reads only the tail of a step directory's replays.jsonl (a sparse 3 GiB one here)."""
    report = tmp_path / "report"
    assert_exit(run(["replay", dump.parent, *REPLAY, "-o", report]), ExitCode.NO_CULPRIT)
    note = dump.parent / "replays.jsonl"
    line = note.read_bytes()
    with open(note, "r+b") as handle:
        handle.truncate(3 * GiB)
        handle.seek(3 * GiB)
        handle.write(b"\n" + line)
    result = run_child(["list", dump.parent.parent, "--json"])
    assert result.code == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["dumps"][0]["report"] == str((report / "report.json").resolve())
    assert 0 < result.peak_rss <= GiB, result.peak_rss


@pytest.fixture(scope="module")
def chunked_dump(tmp_path_factory) -> Path:
    """A dump whose state files have chunk digests (over 4 MiB): a GPT-2 with a 16,384-token vocabulary, AdamW
    moments, one record of NaN-making embeddings."""
    import torch
    import transformers

    from forensics.capture import Guard, GuardConfig, RecordConfig
    from forensics.core.errors import TrainingFaultError

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=128, n_head=2, vocab_size=16384, n_positions=16)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = tmp_path_factory.mktemp("chunked")
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(root), run_id="big", recording=RecordConfig(capture_exceptions=False)),
    )
    with pytest.raises(TrainingFaultError):
        for step in range(4):
            embeds = torch.randn(2, 8, 128)
            if step == 3:
                embeds[1, 2, 5] = float("inf")
            batch = {
                "inputs_embeds": embeds,
                "labels": torch.randint(0, 16384, (2, 8)),
                "sample_ids": [f"s{step}-0", f"s{step}-1"],
            }
            guarded_step(
                guard, optimizer, batch, lambda b: model(inputs_embeds=b["inputs_embeds"], labels=b["labels"]).loss
            )
    guard.close()
    return guard.dumps[0]


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_a_flipped_byte_in_a_streamed_state_file_ends_the_replay_naming_it(chunked_dump, tmp_path, name):
    """The state's large files are verified while replay streams them, not hashed whole first; a chunk that does not
    match ends the replay with exit 2 naming the file, whether replay read that part or not (optimizer moments a
    bad_sample verdict never reads are waited for before the report)."""
    dump = tmp_path / "run" / "step-000000003" / "rank-00000"
    shutil.copytree(chunked_dump, dump)
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["files"][name].get("chunks"), "the test needs a file with chunk digests"
    _damage(dump, name, "flipped")
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert name in result.stderr
    assert not (tmp_path / "report").exists()


# -- round 4 (issue 33): a tensor-file bomb, keys twice, overlapping offsets, the last rough edges ---------------


def _zstd_of(data: bytes) -> bytes:
    """A zstd frame of `data` that does not declare its size."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        writer.write(data)
    return out.getvalue()


def _safetensors_head(entries: dict) -> bytes:
    encoded = json.dumps(entries).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded


@pytest.fixture(scope="module")
def tensor_bombs() -> dict[str, bytes]:
    """Batch tensor files of ~160 KB that would inflate to 5 GiB, more than the child's 4 GiB of address space can
    hold: a frame of zeros (the adversary's), one with a safetensors header that accounts for all of it, and one
    whose frame does not declare its size. The last two are well-formed all-zero tensors (a padding mask of that
    size is a legitimate batch, issue 43): intact to `inspect` and `verify`, too large for this host to replay."""
    size = 5 * GiB
    head = _safetensors_head({"x": {"dtype": "U8", "shape": [size - 8 - 80], "data_offsets": [0, size - 8 - 80]}})
    assert len(head) == 88
    bombs = {
        "zeros": zstd_bomb(b"", size),
        "valid header": zstd_bomb(head, size),
        "no declared size": zstd_bomb(head, size, declare=False),
    }
    assert all(len(bomb) < 200_000 for bomb in bombs.values()), {k: len(v) for k, v in bombs.items()}
    return bombs


def test_a_batch_file_bomb_is_refused_by_every_command_before_it_is_inflated(
    pristine, tmp_path, tensor_bombs, skeleton_bomb
):
    """Each bomb (~100-160 KB declaring or holding 3 or 5 GiB) in one child process limited to 4 GiB of address
    space whose peak RSS stays under 1 GiB (the tensor bomb took 3.6 GB, then a MemoryError traceback): the skeleton
    and the headerless frame of zeros are refused by inspect, verify and replay with one line naming the file; the
    well-formed 5 GiB all-zero tensors are intact to inspect and verify (streamed through a small buffer) and
    replay refuses them before allocating: more than this host can hold."""
    bombs = [("batch-000.json.zst", "skeleton", skeleton_bomb)] + [
        ("batch-000.safetensors.zst", kind, bomb) for kind, bomb in tensor_bombs.items()
    ]
    commands = []
    for index, (name, _, bomb) in enumerate(bombs):
        dump = tmp_path / f"d{index}" / "run" / "step-000000006" / "rank-00000"
        shutil.copytree(pristine, dump)
        resign(dump, name, bomb)
        commands += [["inspect", dump], ["verify", dump], ["replay", dump, *REPLAY, "-o", tmp_path / f"r{index}"]]
    results = run_children(commands)
    for (name, kind, _), three in zip(bombs, (results[i : i + 3] for i in range(0, len(results), 3))):
        if kind in ("valid header", "no declared size"):
            inspect, verify, replay = three
            assert inspect.code == verify.code == ExitCode.OK, (inspect.stderr[-2000:], verify.stderr[-2000:])
            assert_refused_within_a_gib(
                replay, name, f"would decompress to {5 * GiB} bytes, more than this host can hold now"
            )
            continue
        for result in three:
            assert_refused_within_a_gib(result, name)
            if kind == "skeleton":
                assert f"declares {3 * GiB} decompressed bytes" in result.stderr and "67108864" in result.stderr
    assert not any(tmp_path.glob("r*/report.json"))


def test_a_tensor_file_holding_more_or_less_than_its_header_accounts_for_is_refused(dump, tmp_path):
    from safetensors.torch import load

    blob = read_member(dump, "batch-000.safetensors.zst")
    assert load(blob)
    for data, words in ((blob + b"\0" * 64, "holds more than"), (blob[:-8], "ends after")):
        resign(dump, "batch-000.safetensors.zst", _zstd_of(data))
        for verb in (["verify", dump], ["replay", dump, *REPLAY, "-o", tmp_path / "report"]):
            result = run(verb)
            assert_exit(result, ExitCode.BAD_INPUT)
            assert words in result.stderr and "batch-000.safetensors.zst" in result.stderr
    resign_member(dump, "batch-000.safetensors.zst", blob)  # compressed as the writer does: it reads again
    assert_exit(run(["verify", dump]), ExitCode.OK)


def _listed_twice(dump: Path, name: str) -> None:
    """manifest.json with `name` listed twice: a bad hash first, the true entry last (which json.loads keeps)."""
    text = (dump / "manifest.json").read_text()
    entry = json.loads(text)["files"][name]
    bad = json.dumps({**entry, "sha256": "0" * 64})
    (dump / "manifest.json").write_text(text.replace('"files": {', f'"files": {{"{name}": {bad}, ', 1))


@pytest.mark.parametrize("twice", ["file", "rank"])
def test_a_key_twice_in_the_manifest_is_refused_by_every_command(dump, tmp_path, twice):
    if twice == "file":
        _listed_twice(dump, "history.json")
    else:
        text = (dump / "manifest.json").read_text()
        (dump / "manifest.json").write_text(text.replace('"rank": 0', '"rank": 1, "rank": 0', 1))
    for verb in (["inspect", dump], ["verify", dump], ["replay", dump, *REPLAY, "-o", tmp_path / "report"]):
        result = run(verb)
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "manifest.json has the key" in result.stderr and "twice" in result.stderr


def test_a_key_twice_in_a_re_signed_json_file_or_tensor_header_is_refused(dump, tmp_path):
    resign(dump, "history.json", (dump / "history.json").read_bytes().replace(b"{", b'{"capacity": 1, ', 1))
    result = run(["verify", dump])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "history.json has the key 'capacity' twice" in result.stderr
    replay = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(replay, ExitCode.BAD_INPUT)
    assert "twice" in replay.stderr


def _overlapping(dump: Path) -> tuple[str, str]:
    """model.safetensors re-signed with its second tensor's byte range moved 4 bytes into the first's."""
    blob = (dump / "model.safetensors").read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    header[second]["data_offsets"] = [o - 4 for o in header[second]["data_offsets"]]
    resign(dump, "model.safetensors", _safetensors_head(header) + blob[8 + length :])
    return first, second


def test_overlapping_data_offsets_are_refused_by_verify_and_inspect_as_by_replay(dump, tmp_path):
    first, second = _overlapping(dump)
    for verb in (["inspect", dump], ["verify", dump], ["replay", dump, *REPLAY, "-o", tmp_path / "report"]):
        result = run(verb)
        assert_exit(result, ExitCode.BAD_INPUT)
        assert f"'{first}' and '{second}' overlap" in result.stderr, (verb[0], result.stderr[-1500:])


def test_inspect_writes_damaged_on_stderr_and_one_error_line(dump):
    (dump / "scheduler.json").write_bytes((dump / "scheduler.json").read_bytes()[:-10])
    result = run(["inspect", dump])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "DAMAGED: scheduler.json" in result.stderr and "DAMAGED" not in result.stdout
    assert "forensics dump" in result.stdout  # the summary is still shown
    assert result.stderr.strip().splitlines()[-1].startswith("Error:") and "scheduler.json" in result.stderr


def test_a_step_directory_whose_ranks_disagree_is_refused_by_inspect_and_verify(dump):
    other = dump.parent / "rank-00001"
    shutil.copytree(dump, other)
    edit_manifest(dump, lambda m: m.update(world_size=2))
    edit_manifest(other, lambda m: m.update(rank=1, world_size=2, step=7))
    for verb in ("inspect", "verify"):
        result = run([verb, dump.parent])
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "its rank dumps are not of one step (step 6 in rank(s) [0]; step 7 in rank(s) [1])" in result.stderr


def test_a_sharded_layout_in_a_version_1_manifest_names_the_version(dump):
    edit_manifest(dump, lambda m: m.update(format_version=1, layout={"kind": "sharded", "tensors": {}, "shards": {}}))
    result = run(["inspect", dump])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert (
        "'layout' (a sharded state) needs format_version 2 or later, but the manifest says format_version 1"
        in result.stderr
        and "got 'sharded'" not in result.stderr
    )


def test_a_skeleton_nested_10000_deep_is_called_too_deep_not_invalid(dump, tmp_path):
    resign_member(dump, "batch-000.json.zst", b"[" * 10_000 + b"]" * 10_000)
    for verb in (["verify", dump], ["replay", dump, *REPLAY, "-o", tmp_path / "report"]):
        result = run(verb)
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "batch-000.json.zst is nested too deep" in result.stderr and "not valid JSON" not in result.stderr


@pytest.mark.parametrize("lr", ["Infinity", '{"__float__": "inf"}', "-1"])
def test_a_learning_rate_that_is_not_finite_is_refused(dump, tmp_path, lr):
    text = (dump / "optimizer.json").read_text()
    meta = json.loads(text)
    edited = json.dumps({**meta, "param_groups": [{**g, "lr": "LR"} for g in meta["param_groups"]]})
    resign(dump, "optimizer.json", edited.replace('"LR"', lr).encode())
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert "optimizer.json" in result.stderr
    assert ("bare Infinity" if lr == "Infinity" else "learning rate is") in result.stderr


def test_a_tied_weight_re_typed_to_int32_is_refused_whichever_twin_loads_first(dump, tmp_path):
    import torch

    blob = (dump / "model.safetensors").read_bytes()
    key = "transformer.wte.weight"  # tied to lm_head.weight, which comes first in the file
    resign(dump, "model.safetensors", retype_tensor(blob, key, torch.int32))
    result = run(["replay", dump, *REPLAY, "-o", tmp_path / "report"])
    assert_exit(result, ExitCode.BAD_INPUT)
    assert f"the dtype of tensor {key} in the dump (int32) does not match" in result.stderr


def test_a_setuid_archive_member_is_refused_by_replay_as_by_verify(dump, tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(dump.iterdir()):
            info = tar.gettarinfo(str(path), arcname=f"rank-00000/{path.name}")
            info.mode = 0o4755 if path.name == "history.json" else 0o644
            with open(path, "rb") as handle:
                tar.addfile(info, handle)
    archive = tmp_path / "suid.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
    for verb in (["verify", archive], ["inspect", archive], ["replay", archive, *REPLAY, "-o", tmp_path / "r"]):
        result = run(verb)
        assert_exit(result, ExitCode.BAD_INPUT)
        assert "rank-00000/history.json' has mode 4755 (setuid" in result.stderr
    assert not (tmp_path / "r").exists()


def test_a_dump_that_fails_for_want_of_space_leaves_no_empty_step_directory(tmp_path, helpers):
    """The file-size limit makes the write fail as a full disk does (EFBIG for ENOSPC: the same path out)."""
    import signal

    from forensics.core.errors import CaptureError

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CaptureError, match="no dump written"):
            helpers.write_synthetic_dump(tmp_path / "dumps")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert not list((tmp_path / "dumps").rglob("step-*")), list((tmp_path / "dumps").rglob("*"))
    helpers.write_synthetic_dump(tmp_path / "dumps")  # with room again, the same dump is written
    assert len(list((tmp_path / "dumps").rglob("step-*"))) == 1
