"""Issue 32's two step configurations for scripts/bench/capture_overhead.py: plain vs guarded vs guarded with precursors.

Each mode trains its own copy of the model with its own optimizer (the same initial weights and batches), so no
Guard's hooks sit on another mode's model and a compiled model never recompiles between modes. Rounds interleave
the modes (the order rotates each round: no mode always follows the same one); each round times `steps` steps of
each mode after a device sync; the table shows the median over rounds of each mode's step time, its ratio to
plain (the median of per-round ratios, paired within a round, so drift between rounds cancels), the spread of
plain between rounds, and the wall time per step spent inside the Guard's calls (record_batch + record_loss + check;
check() includes its one read, i.e. waiting for the backward to finish on a GPU, and with several ranks the
agreement all-reduce: on a GPU this column is mostly that wait, not the Guard's own work). Under torchrun every rank runs the same and
rank 0 prints (the step time is the slowest rank's: each step ends in the optimizer's collectives).
"""

from __future__ import annotations

import copy
import cProfile
import dataclasses
import gc
import io
import os
import pstats
import random
import tempfile
import time

from typing import Any

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig, PrecursorConfig
from scripts.bench.common import machine, median, sync
from scripts.bench.guard_pieces import Pieces

MODES = ("plain", "synced", "guarded", "synchronous", "precursors")
"""plain: no read of its own; synced: the loop reads the grad norm before optimizer.step() (a NaN check by hand, one
sync: what any exact check before the step costs); guarded: the default GuardConfig (with a fused optimizer in one
process or several: the sync-free check); synchronous: DetectionConfig(sync_free=False), the check that reads the step
before optimizer.step(); precursors: with PrecursorConfig() (which keeps the synchronous check)."""
LLAMA_1B47 = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=26,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
)  # 1.467 B parameters
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
)


class Timed:
    """Host seconds spent inside the Guard's calls."""

    def __init__(self, guard: Guard):
        self.guard, self.seconds = guard, 0.0
        self.by_method: dict[str, float] = {}
        self.on_cpu: dict[str, float] = {}  # the calling thread's CPU time in them (the rest: waiting)
        self.profiler: cProfile.Profile | None = None  # set: the Guard's calls (only they) run under cProfile
        self.calls = 0  # check() calls: the steps

    def __call__(self, method: str, *args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        self.calls += method == "check"
        if self.profiler is not None:
            self.profiler.enable()
        try:
            return getattr(self.guard, method)(*args, **kwargs)
        finally:
            if self.profiler is not None:
                self.profiler.disable()
            spent = time.perf_counter() - start
            self.seconds += spent
            self.by_method[method] = self.by_method.get(method, 0.0) + spent
            self.on_cpu[method] = self.on_cpu.get(method, 0.0) + time.thread_time() - cpu


def nanogpt(tiny: bool, device: torch.device, compile_model: bool, batch: int = 12, fused: bool = True):
    """GPT-2 small as nanoGPT pre-trains it (dropout 0), 4 micro-batches x `batch` x 1024 tokens (12: a 127 ms step on
    an H200; 6: about 70 ms, issue 55's short step); AdamW fused on CUDA unless `fused` is False (foreach: the
    default GuardConfig then checks synchronously); or a tiny stand-in."""
    from transformers import GPT2Config, GPT2LMHeadModel

    size = (
        dict(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=512)
        if tiny
        else dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50304)
    )  # nanoGPT's padded vocabulary
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to(device)
    micro, batch, seq = (4, 2, 64) if tiny else (4, batch, 1024)
    fused = fused and device.type == "cuda"
    data = [torch.randint(0, size["vocab_size"], (batch, seq), device=device) for _ in range(micro)]

    def make(fused_here: bool | None = None):
        """A copy of the model and its AdamW (`fused_here`: fused or foreach, on any device; None: `fused`)."""
        m = copy.deepcopy(model)
        on = fused if fused_here is None else fused_here
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=on, foreach=None if on else True)
        return (torch.compile(m) if compile_model else m), optimizer

    def loss_of(m, ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return m(input_ids=ids, labels=ids).loss

    words = (
        f"GPT-2 {'tiny' if tiny else 'small (124M)'}, {'torch.compile, ' if compile_model else ''}bf16 autocast, "
        f"{micro} micro-batches x {batch} x {seq} tokens, AdamW{' (fused)' if fused else ' (foreach)'}, "
        "clip_grad_norm_, check(grad_norm=...)"
    )
    return make, data, loss_of, words


def fsdp2_llama(tiny: bool, device: torch.device):
    """A Llama of 1.47 B parameters (or a tiny one) sharded by FSDP2 over every rank, bf16 compute / fp32 reduce."""
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = transformers.LlamaConfig(**(LLAMA_TINY if tiny else LLAMA_1B47), max_position_embeddings=1024)
    micro, batch, seq = (2, 2, 32) if tiny else (2, 2, 1024)
    rank = torch.distributed.get_rank()
    generator = torch.Generator(device="cpu").manual_seed(1 + rank)  # each rank its own data
    data = [torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device) for _ in range(micro)]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def make():
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def loss_of(m, ids):
        return m(input_ids=ids, labels=ids).loss

    params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters()) if tiny else 1_467_000_000
    words = (
        f"FSDP2 bf16 Llama {params / 1e9:.3g} B, {torch.distributed.get_world_size()} ranks, {micro} micro-batches x "
        f"{batch} x {seq} tokens per rank, AdamW{' (fused)' if device.type == 'cuda' else ''}, clip_grad_norm_, "
        "check(grad_norm=...)"
    )
    return make, data, loss_of, words


def run_config(
    config: str,
    rounds: int,
    steps: int,
    tiny: bool = False,
    compile_model: bool = True,
    only: tuple[str, ...] = (),
    profile: int = 0,
    pin: bool = False,
    batch: int = 12,
    fused: bool = True,
    stop_at: float = 0.0,
    pieces: int = 0,
    warm_rounds: int = 0,
) -> None:
    """Times the configuration's modes (MODES; `only`: those of them, plain always included); `profile`: then traces
    that many more steps of each mode with torch.profiler and prints (rank 0) where the host and the device spent them;
    `pin`: each local rank runs on its own share of the host's cores (as numactl / a launcher's CPU binding does);
    `stop_at` (> 0): a time.perf_counter() after which no round starts (at most `rounds`, at least 3), so a run ends
    in time whatever its compile and step took; `warm_rounds`: interleaved rounds run first and discarded;
    `pieces`: then times each piece of the Guard's calls (scripts/bench/guard_pieces.py) over that many steps."""
    distributed = config == "fsdp2"
    if distributed:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.sched_setaffinity(0, cores[local * share : (local + 1) * share] or cores)
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    make, data, loss_of, words = (
        fsdp2_llama(tiny, device) if distributed else nanogpt(tiny, device, compile_model, batch, fused)
    )
    dump_dir = tempfile.mkdtemp(prefix="fx-overhead-")
    runs = {}
    modes = tuple(m for m in MODES if not only or m in only or m == "plain")
    for mode in modes:
        model, optimizer = make()
        guard = (
            None
            if mode in ("plain", "synced")
            else Guard(
                model,
                optimizer,
                config=GuardConfig(
                    dump_dir=dump_dir,
                    run_id=mode,
                    detection=DetectionConfig(sync_free=False if mode == "synchronous" else None),
                    precursors=PrecursorConfig() if mode == "precursors" else None,
                ),
            )
        )
        runs[mode] = (model, optimizer, Timed(guard) if guard is not None else None)

    def step(mode: str) -> None:
        model, optimizer, timed = runs[mode]
        for ids in data:
            if timed:
                timed("record_batch", {"input_ids": ids})
            loss = loss_of(model, ids)
            if timed:
                timed("record_loss", loss)
            (loss / len(data)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if mode == "synced" and not torch.isfinite(norm).item():
            return
        if timed is None or timed("check", grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for mode in modes:  # compile, allocator, the detectors' warm-up (32 steps), a few precursor samples
        for _ in range(40 if not tiny else 34):
            step(mode)
    sync(str(device))
    gc.collect()
    gc.freeze()  # the models' objects (millions with several FSDP2 models) leave the collector's walks: a walk that
    # lands in one mode's round would count against that mode
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    host: dict[str, list[float]] = {mode: [] for mode in modes}
    if not distributed:
        print("the rounds begin", flush=True)  # (a log marker: a recompilation after it lands in a round)
    late = stop_at and not distributed and time.perf_counter() > stop_at  # compiling took it all: no warm rounds
    for index in range(0 if late else -warm_rounds, rounds):
        if index == 0:  # the warm rounds are discarded
            times, host = {m: [] for m in modes}, {m: [] for m in modes}
        elif index >= 3 and stop_at and time.perf_counter() > stop_at and not distributed:
            break  # (under torchrun every rank must run the same rounds: no time limit there)
        for mode in modes[index % len(modes) :] + modes[: index % len(modes)]:
            timed = runs[mode][2]
            before = timed.seconds if timed else 0.0
            sync(str(device))
            start = time.perf_counter()
            for _ in range(steps):
                step(mode)
            sync(str(device))
            times[mode].append((time.perf_counter() - start) / steps)
            host[mode].append(((timed.seconds - before) / steps) if timed else 0.0)
    spent = {  # the Guard's calls in the warm-up and the rounds (before any timer of the passes below)
        mode: (dict(run[2].by_method), dict(run[2].on_cpu), run[2].calls)
        for mode, run in runs.items()
        if run[2] is not None and run[2].calls
    }
    if distributed:  # a step is as long as its slowest rank
        table = torch.tensor([times[m] for m in modes], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
        times = {m: table[i].tolist() for i, m in enumerate(modes)}
    printing = not distributed or torch.distributed.get_rank() == 0
    if printing:  # first: a run stopped by its time limit in the passes below still has its ratios
        report(config, words, device, len(times["plain"]), steps, times, host)
    traces = {mode: trace(lambda mode=mode: step(mode), profile, device) for mode in modes} if profile else {}
    inside = {}
    for mode in modes if profile else ():  # then the Guard's own calls under cProfile (Python-level, host only)
        timed = runs[mode][2]
        if timed is not None:
            timed.profiler = cProfile.Profile()
            for _ in range(profile):
                step(mode)
            timed.profiler.create_stats()
            text = io.StringIO()
            pstats.Stats(timed.profiler, stream=text).sort_stats("tottime").print_stats(25)
            inside[mode] = text.getvalue()
            timed.profiler = None
    pieced = {}
    for mode in modes if pieces else ():  # each piece of the Guard's calls timed (after the rounds: the timers cost)
        timed = runs[mode][2]
        if timed is not None:
            watch = Pieces(timed.guard, model_hooks=not compile_model)
            sync(str(device))
            for _ in range(pieces):
                step(mode)
            sync(str(device))
            pieced[mode] = watch.table(pieces)
            watch.remove()
    for mode in modes:
        if runs[mode][2] is not None:
            runs[mode][2].guard.close()
    if printing:
        for mode, listing in pieced.items():
            print(
                f"{mode}: the Guard's pieces, host time per step over {pieces} steps (a piece includes those under it)"
            )
            print(listing)
        for mode, (wall, cpu, total) in spent.items():
            print(
                f"{mode}: inside the Guard per step (wall / on the thread's CPU, warm-up and timed rounds), "
                + ", ".join(
                    f"{name} {s / total * 1e6:.0f} / {cpu[name] / total * 1e6:.0f} us" for name, s in wall.items()
                )
            )
        if traces:
            print(profile_report(traces, profile))
        for mode, text in inside.items():
            print(f"--- cProfile of the Guard's calls in {profile} {mode} steps (by own time)\n{text}")
    if distributed:
        torch.distributed.destroy_process_group()


def trace(step: Any, steps: int, device: torch.device) -> Trace:
    """`steps` calls of `step` under torch.profiler (the device's kernels too on CUDA): wall time, the device's
    kernel time (the sum over its kernels, every stream: overlapping NCCL and compute kernels both count) and each operator's calls and host self time, per step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(str(device))
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        sync(str(device))
    wall = time.perf_counter() - start
    events = profiler.key_averages()
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]  # the kernels themselves
    busy = sum(getattr(e, "self_device_time_total", 0) or 0 for e in kernels) / 1e6  # (operators carry it too)
    ops = {e.key: (e.count / steps, e.self_cpu_time_total / steps) for e in events}
    return Trace(wall / steps, busy / steps, ops)


@dataclasses.dataclass
class Trace:
    """One mode's profiled steps, per step: wall and kernel seconds (all streams), {operator: (calls, host self microseconds)}."""

    wall: float
    busy: float
    ops: dict[str, tuple[float, float]]


def profile_report(traces: dict[str, Trace], steps: int) -> str:
    """Each mode's wall / kernel / host time per step under the profiler, and for each mode but plain the
    operators whose host time or calls grew most against plain: where a guarded step's extra time goes."""
    lines = [f"--- torch.profiler, {steps} steps of each mode (per step; host = operators' self time)"]
    for mode, t in traces.items():
        calls, host = sum(c for c, _ in t.ops.values()), sum(h for _, h in t.ops.values())
        lines.append(
            f"{mode:<12} wall {t.wall * 1e3:8.1f} ms  kernels {t.busy * 1e3:8.1f} ms  host "
            f"{host / 1e3:8.1f} ms in {calls:8.0f} operator calls"
        )
    plain = traces["plain"].ops
    for mode, t in traces.items():
        if mode == "plain":
            continue
        grown = sorted(
            ((h - plain.get(k, (0.0, 0.0))[1], c - plain.get(k, (0.0, 0.0))[0], k) for k, (c, h) in t.ops.items()),
            reverse=True,
        )
        lines.append(f"{mode} vs plain, operators with the most added host time (us per step, calls per step):")
        lines += [f"  {dh:+9.1f} us {dc:+7.1f} calls  {key[:90]}" for dh, dc, key in grown[:15]]
        more = sorted(((c - plain.get(k, (0.0, 0.0))[0], k) for k, (c, h) in t.ops.items()), reverse=True)
        lines.append(
            f"{mode} vs plain, operators with the most added calls: "
            + ", ".join(f"{key[:50]} {dc:+.1f}" for dc, key in more[:10] if dc > 0)
        )
    return "\n".join(lines)


def report(config: str, words: str, device: torch.device, rounds: int, steps: int, times: dict, host: dict) -> None:
    plain = times["plain"]
    spread = (max(plain) - min(plain)) / median(plain)
    print(f"machine: {machine()}")
    print(f"config {config}: {words}; device {device}")
    print(
        f"{rounds} interleaved rounds x {steps} steps per mode (order rotating); plain step spread between rounds "
        f"{100 * spread:.1f} %"
    )
    intervals: list[str] = []
    print(
        f"{'mode':<12} {'step (median)':>14} {'ratio vs plain':>15} {'quartiles':>13} {'in Guard calls':>15}  "
        "per-round ratios"
    )
    for mode in times:
        ratios = sorted(t / p for t, p in zip(times[mode], plain))
        quartiles = f"{ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios)) // 4]:.3f}"
        if mode != "plain":
            low, high = median_interval(ratios)
            intervals.append(f"{mode} {median(ratios):.4f} (95 % interval of the median {low:.4f}-{high:.4f})")
        print(
            f"{mode:<12} {median(times[mode]) * 1e3:11.2f} ms {median(ratios):15.4f} {quartiles:>13} "
            f"{median(host[mode]) * 1e6:12.0f} us  "
            f"{' '.join(f'{t / p:.3f}' for t, p in zip(times[mode], plain))}"
        )
    print(
        "ratio vs plain, median of paired rounds, with a bootstrap interval (2,000 resamples of the rounds): "
        + "; ".join(intervals)
    )
    if "precursors" in times and "guarded" in times:
        on_top = [(pc - g) / p for pc, g, p in zip(times["precursors"], times["guarded"], plain)]
        print(
            f"precursors on top of guarded (PrecursorConfig() defaults, every 8th step sampled): "
            f"{100 * median(on_top):+.2f} % of a plain step (median of rounds)"
        )


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of `values` (resampled with replacement, a fixed seed)."""
    draw = random.Random(seed)
    medians = sorted(median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def host_cost(rounds: int, steps: int, micro: int) -> None:
    """The host time a guarded step adds on the CPU (12 x Linear(256), AdamW, one thread, check(grad_norm=...)):
    plain and guarded steps interleaved (two copies of the model), and the time inside the Guard's calls alone."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    data = torch.randn(micro, 8, 256)
    runs = {}
    for mode in ("plain", "guarded"):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = (
            Guard(
                model,
                optimizer,
                config=GuardConfig(dump_dir=tempfile.mkdtemp(prefix="fx-host-")),
                loss_fn=squared_output,
            )
            if mode == "guarded"
            else None
        )
        runs[mode] = (model, optimizer, Timed(guard) if guard is not None else None)

    def step(mode: str) -> None:
        model, optimizer, timed = runs[mode]
        for index in range(micro):
            batch = {"x": data[index], "sample_ids": [index]}
            if timed:
                timed("record_batch", batch)
            loss = squared_output(model, batch)
            if timed:
                timed("record_loss", loss)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if timed is None or timed("check", grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(60):
        step("plain"), step("guarded")
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    inside: list[float] = []
    for index in range(rounds):
        for mode in ("plain", "guarded") if index % 2 == 0 else ("guarded", "plain"):
            timed = runs[mode][2]
            before = timed.seconds if timed else 0.0
            start = time.perf_counter()
            for _ in range(steps):
                step(mode)
            times[mode].append((time.perf_counter() - start) / steps)
            if timed:
                inside.append((timed.seconds - before) / steps)
    added = [g - p for g, p in zip(times["guarded"], times["plain"])]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(
        f"12 x Linear(256), AdamW, {micro} micro-batch(es) of 8, one thread; {rounds} interleaved rounds x {steps} steps"
    )
    print(
        f"plain {median(times['plain']) * 1e6:.0f} us, guarded {median(times['guarded']) * 1e6:.0f} us per step; "
        f"added (median of paired rounds) {median(added) * 1e6:.0f} us; inside the Guard's calls "
        f"{median(inside) * 1e6:.0f} us per step"
    )


def squared_output(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"]).pow(2).mean()
