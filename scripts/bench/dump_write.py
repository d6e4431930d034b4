"""Benchmark: writing a ~1.5 GB model + Adam state as a forensics dump vs torch.save vs raw writers of the same bytes.

Every writer writes the same bytes-worth of state to the same directory in one process, interleaved rounds whose
order rotates (a writer that follows another's 1.5 GB meets a busier disk: on a VM the host's write cache):
`raw` (os.write of the state's own bytes from host memory into one file + fsync: the disk's limit for these
bytes through the page cache; each writer's file is removed after its timing), `raw+sha256` (the same bytes through
the dump writer's HashingWriter into the file the dump writer opens, O_DIRECT where the file system takes it: the chunk
sha256s on its thread pool beside the write, so the hash's own cost is raw+sha256 / raw direct), `raw direct` (the
same bytes with O_DIRECT through the dump writer's aligned buffers, forensics/format/direct_io.py: the disk's limit
without the page cache), `dd` (`dd if=/dev/zero bs=64M conv=fsync` of the same size, where dd exists), `torch.save`
(+ fsync),
the forensics dump (`write_dump` of the collected state) and `guard.check`: the path a job takes, a Guard's check()
that dumps the same state (a non-finite loss, policy 'continue', so the write is synchronous: the stall a job sees,
manifest, flight recorder, re-check and all), and `guard.check buffered`: the same with every file through the page
cache (the writer before O_DIRECT). Also measures sha256 on one core and on every core, and the training
stall of a non-fatal (spike) dump: the time `Guard.check` takes to return when the dump is copied and written by the
background thread.
`--busy N` starts N processes that keep a core busy each (a data loader's workers, another job) for the whole
measurement, the writers' competition on a small machine; they are stopped at the end. Reported per round: each
writer's time over raw's, the load average, each writer's CPU seconds; and sha256's speed beside the busy processes,
from which the least time a write that hashes every byte can take (`hash_floor_vs_raw`).
`--writers raw,raw+sha256,guard.check` times only those (and no spike dump): shorter runs, more rounds.
Usage: python -m scripts.bench.dump_write [--dir /tmp] [--rounds 3] [--params 125] [--device cuda:0] [--busy N]
       [--writers W,W] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SpikeConfig
from forensics.format.writer import DumpContent, write_dump
from forensics.core.rng import capture_rng
from scripts.bench.common import machine, median


def build(params_m: int, device: str):
    """An MLP stack of `params_m` million fp32 parameters with a stepped Adam (state = 2x params)."""
    width = 2048
    layers = max(1, params_m * 1_000_000 // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer, width


def fsync_dir_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--params", type=int, default=125, help="millions of parameters (125 -> ~1.5 GB)")
    parser.add_argument(
        "--device",
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="where the state lives (cuda:N on a GPU machine)",
    )
    parser.add_argument("--busy", type=int, default=0, help="processes that keep a core busy each meanwhile")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument(
        "--writers",
        help="comma-separated subset of the writers to time (raw is always timed): a shorter run, e.g. "
        "raw,raw+sha256,guard.check",
    )
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for process in busy:
            process.kill()
            process.wait()


def run(args: argparse.Namespace) -> None:
    device = args.device
    if device.startswith("cuda"):
        device = str(torch.device(device) if ":" in device else torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.set_device(torch.device(device))
    model, optimizer, width = build(args.params, device)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    work = tempfile.mkdtemp(dir=args.dir, prefix="fx-bench-")
    host_state = [
        t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        for p in model.parameters()
        for t in (p, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
    ]

    def raw_write():  # the state's own bytes, already in host memory, one os.write per tensor
        path = os.path.join(work, "raw.bin")
        removals.append(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for array in host_state:
                view, done = memoryview(array), 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def raw_direct():  # the same bytes with O_DIRECT through the dump writer's aligned buffers: no page cache
        from forensics.format.direct_io import open_direct

        path = os.path.join(work, "raw-direct.bin")
        removals.append(path)
        out = open_direct(path)
        if out is None:
            raise SystemExit(f"{args.dir} refuses O_DIRECT: leave 'raw direct' out (--writers)")
        with out:
            for array in host_state:
                out.write(memoryview(array))
            out.flush()
            os.fsync(out.fileno())

    def raw_hashed():  # the state's bytes through the dump writer's HashingWriter into the file the dump's writer
        # opens (O_DIRECT where the file system takes it): the hash's own cost on the dump's write path
        from forensics.format.digest import HashingWriter
        from forensics.format.direct_io import open_direct

        path = os.path.join(work, "raw-hashed.bin")
        removals.append(path)
        direct = open_direct(path)
        with direct or open(path, "wb", buffering=0) as handle:
            out = HashingWriter(handle)
            for array in host_state:
                out.write(memoryview(array))
            handle.flush()
            out.hexdigest()
            os.fsync(handle.fileno())

    blocks = -(-state_bytes // (64 << 20))

    def dd_write():  # dd of the same size rounded up to whole 64 MiB blocks (its time is scaled back below)
        path = os.path.join(work, "dd.bin")
        removals.append(path)
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={blocks}", "conv=fsync"],
            check=True,
            capture_output=True,
        )

    def torch_save():
        path = os.path.join(work, "state.pt")
        removals.append(path)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=work, run_id="bench"))

    def forensics_dump():
        state = guard.state.collect(
            __import__("forensics.capture.state.snapshot", fromlist=["HostCopy"]).HostCopy(enabled=False)
        )
        content = DumpContent(
            manifest={"run_id": "bench", "step": 0, "rank": 0, "world_size": 1, "trigger": {}, "micro_batches": []},
            model=state["model"],
            optimizer=state["optimizer"],
            rng=[capture_rng()],
            micro_batches=[],
            history={},
        )
        removals.append(write_dump(content, work).parent.parent)

    check_guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=work,
            run_id="check",
            detection=DetectionConfig(on_nonfinite="continue"),
            dumping=DumpConfig(max_dumps=1 << 20),
        ),
        loss_fn=mlp_loss,
    )
    x = torch.randn(2, width, device=device)
    guarded_steps = iter(range(1 << 20))

    def guard_check():  # what a job sees: check() returns once its dump is written
        check_guard.record_batch({"x": x, "sample_ids": [0, 1]})
        check_guard.record_loss(torch.tensor(float("nan"), device=device))
        check_guard.check(grad_norm=torch.tensor(1.0, device=device), step=next(guarded_steps))
        removals.append(os.path.join(work, "check"))

    def guard_check_buffered():  # the same check() with every file through the page cache (the writer before O_DIRECT)
        from forensics.format import direct_io

        kept, direct_io.MIN_BYTES = direct_io.MIN_BYTES, 1 << 62
        try:
            guard_check()
        finally:
            direct_io.MIN_BYTES = kept

    writers = {
        "raw": raw_write,
        "raw+sha256": raw_hashed,
        "raw direct": raw_direct,
        "torch.save": torch_save,
        "forensics": forensics_dump,
        "guard.check": guard_check,
        "guard.check buffered": guard_check_buffered,
    }
    if shutil.which("dd"):
        writers["dd"] = dd_write
    if args.writers:
        chosen = {"raw", *args.writers.split(",")}
        unknown = chosen - set(writers)
        if unknown:
            raise SystemExit(f"unknown writers {sorted(unknown)}; known: {', '.join(writers)}")
        writers = {name: fn for name, fn in writers.items() if name in chosen}
    results: dict[str, list[float]] = {name: [] for name in writers}
    cpu: dict[str, list[float]] = {name: [] for name in writers}  # the process's CPU seconds (all its threads)
    loads: list[float] = []  # the 1-minute load average at the end of each round
    removals: list = []  # what a writer wrote, removed after its timing (deleting 1.5 GB is no part of a write)
    order = list(writers)
    for round_index in range(args.rounds):  # the order rotates: no writer always follows the same one
        for name in order[round_index % len(order) :] + order[: round_index % len(order)]:
            fn = writers[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            results[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            for path in removals:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            removals.clear()
            os.sync()  # the removal's journal commit (and discards, on a file system mounted with them) done
        loads.append(round(os.getloadavg()[0], 2))

    spike = spike_stall(model, optimizer, work, width, device) if not args.writers else None
    guard.close()
    check_guard.close()  # its run log is written now, under `work`, not at exit after `work` is gone
    shutil.rmtree(work, ignore_errors=True)

    gb = state_bytes / 1e9
    if "dd" in results:
        results["dd"] = [t * state_bytes / (blocks * (64 << 20)) for t in results["dd"]]
    times = {name: median(values) for name, values in results.items()}
    speeds = sha256_speeds()
    hash_wall = gb / max(speeds.values())  # the hash alone, beside the busy processes, on the threads it gets

    def vs(name: str, base: str) -> float | None:  # median time ratio
        return round(times[name] / times[base], 3) if name in times and base in times else None

    def per_round(name: str, base: str = "raw") -> list[float] | None:
        return [round(a / b, 3) for a, b in zip(results[name], results[base])] if name in results else None

    check_rounds = per_round("guard.check")
    summary = {
        "machine": machine(),
        "device": device,
        "dir": args.dir,
        "state_gb": round(gb, 3),
        "rounds": args.rounds,
        "busy_processes": args.busy,
        "load_average_per_round": loads,
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "seconds": {name: round(t, 3) for name, t in times.items()},
        "gb_s": {name: round(gb / t, 3) for name, t in times.items()},
        "cpu_seconds": {name: round(median(values), 3) for name, values in cpu.items()},
        "check_vs_raw": vs("guard.check", "raw"),
        "check_vs_raw_per_round": per_round("guard.check"),
        "check_vs_raw_per_round_median": round(median(check_rounds), 3) if check_rounds else None,
        "check_vs_raw_direct": vs("guard.check", "raw direct"),
        "check_buffered_vs_raw": vs("guard.check buffered", "raw"),
        "check_buffered_vs_raw_per_round": per_round("guard.check buffered"),
        "check_vs_check_buffered_per_round": per_round("guard.check", "guard.check buffered")
        if "guard.check buffered" in results
        else None,
        "check_vs_dd": vs("guard.check", "dd"),
        "stall_vs_raw": vs("forensics", "raw"),
        "stall_vs_raw_per_round": per_round("forensics"),
        "stall_vs_dd": vs("forensics", "dd"),
        "forensics_vs_torch_save": vs("torch.save", "forensics"),
        "raw_direct_vs_raw": vs("raw direct", "raw"),
        "hashed_vs_raw": vs("raw+sha256", "raw"),
        "hashed_vs_raw_per_round": per_round("raw+sha256"),
        "hashed_vs_raw_direct": vs("raw+sha256", "raw direct"),
        "hashed_vs_raw_direct_per_round": per_round("raw+sha256", "raw direct") if "raw direct" in results else None,
        "check_vs_hashed": vs("guard.check", "raw+sha256"),
        "sha256_gb_s": speeds,
        "hash_cpu_s_one_core": round(gb / speeds["one_core"], 3),
        "hash_wall_s_beside_busy": round(hash_wall, 3),
        "hash_floor_vs_raw": round(max(1.0, hash_wall / times["raw"]), 3),
        "spike_stall_s": round(spike[0], 4) if spike else None,
        "spike_background_write_s": round(spike[1], 3) if spike else None,
        "spike_dumps_written": spike[2] if spike else None,
    }
    print(f"machine: {summary['machine']}; target dir {args.dir}")
    print(f"state: {gb:.2f} GB (fp32 weights + Adam exp_avg + exp_avg_sq), on {device}; medians of {args.rounds}")
    for name, t in times.items():
        print(f"  {name:<11} {t:7.2f} s  {gb / t:6.2f} GB/s  {summary['cpu_seconds'][name]:6.2f} CPU-s")
    print(f"{args.busy} busy processes beside the writer; load average per round {loads}")
    if "forensics" in times:
        print(
            f"write_dump / raw write of the same bytes: {summary['stall_vs_raw']} (dd: {summary['stall_vs_dd']}); "
            f"per round {summary['stall_vs_raw_per_round']}; forensics vs torch.save: "
            f"{summary['forensics_vs_torch_save']}x faster"
        )
    if "guard.check" in times:
        print(
            f"Guard check() that dumps / raw: {summary['check_vs_raw']} (per-round median "
            f"{summary['check_vs_raw_per_round_median']}; raw direct: {summary['check_vs_raw_direct']}; dd: "
            f"{summary['check_vs_dd']}); per round {summary['check_vs_raw_per_round']}"
        )
    if "guard.check buffered" in times:
        print(
            f"Guard check() through the page cache (the writer before O_DIRECT) / raw: "
            f"{summary['check_buffered_vs_raw']}, per round {summary['check_buffered_vs_raw_per_round']}; "
            f"check() / that, per round {summary['check_vs_check_buffered_per_round']}"
        )
    if "raw+sha256" in times:
        print(
            f"the hash: raw write + sha256 on the writer's threads / raw write {summary['hashed_vs_raw']}, per round "
            f"{summary['hashed_vs_raw_per_round']}; / raw direct {summary['hashed_vs_raw_direct']}, per round "
            f"{summary['hashed_vs_raw_direct_per_round']}; Guard check() / (raw + sha256) {summary['check_vs_hashed']}"
        )
    print(
        f"sha256 beside the busy processes {speeds} GB/s: {summary['hash_cpu_s_one_core']:.2f} s on one thread, "
        f"{hash_wall:.2f} s at best: a write that hashes every byte takes at least {summary['hash_floor_vs_raw']} x raw"
    )
    if spike:
        print(
            f"spike dump training stall: {spike[0]:.3f} s; background write finished {spike[1]:.2f} s later; "
            f"dumps written: {spike[2]}"
        )
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)


def spike_stall(model, optimizer, work: str, width: int, device: str) -> tuple[float, float, int]:
    """Training stall of a spike dump written in the background (continue policy): (seconds check() took, seconds
    the background write went on after it, dumps written)."""
    stall_guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=work,
            run_id="stall",
            detection=DetectionConfig(loss_spike=SpikeConfig(window=8, warmup=4, min_ratio=1.5)),
        ),
    )
    x = torch.randn(4, width, device=device)
    for value in (1.0, 1.0, 1.0, 1.0, 1.0):
        stall_guard.record_batch({"x": x, "sample_ids": [0, 1, 2, 3]})
        stall_guard.record_loss(torch.tensor(value, device=device))
        stall_guard.check(grad_norm=torch.tensor(1.0, device=device))
    stall_guard.record_batch({"x": x, "sample_ids": [0, 1, 2, 3]})
    stall_guard.record_loss(torch.tensor(100.0, device=device))
    start = time.perf_counter()
    stall_guard.check(grad_norm=torch.tensor(1.0, device=device))
    stall = time.perf_counter() - start
    start = time.perf_counter()
    stall_guard.close()
    return stall, time.perf_counter() - start, len(stall_guard.dumps)


def mlp_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The loss the Guard's in-job re-check recomputes for the bench's MLP."""
    return model(batch["x"]).float().pow(2).mean()


def sha256_speeds() -> dict[str, float]:
    """GB/s of sha256 over 512 MiB on one core and in 4 MiB pieces on every core (what the writer can reach)."""
    data = memoryview(os.urandom(1 << 20) * 512)
    pieces = [data[i : i + (4 << 20)] for i in range(0, len(data), 4 << 20)]
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    one = time.perf_counter() - start
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        start = time.perf_counter()
        list(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces))
        every = time.perf_counter() - start
    return {"one_core": round(len(data) / one / 1e9, 2), f"{os.cpu_count()}_threads": round(len(data) / every / 1e9, 2)}


if __name__ == "__main__":
    main()
