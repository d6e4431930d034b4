"""Harness of the integration tests: launch an example under torchrun; a plain-torch reference of its training.

The examples (scripts/examples/) all train the same tiny GPT-2 on the same per-rank samples with the
same AdamW, warm-up and clipping; `reference` replays that training in one process with plain torch,
so a dump's weights and optimizer moments can be checked against state computed without the framework.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "scripts" / "examples"
WORLD, STEPS, ACCUM, MICRO = 2, 6, 2, 2
POISON, BAD_STEP, BAD_MB = 29, 3, 1  # rank 1 reads sample 29 in step 3, micro-batch 1 (DistributedSampler)
LAUNCH_TIMEOUT = 150  # seconds; a hang fails the test instead of the suite


def requires(*modules: str) -> None:
    """Skips the calling test when a framework it runs is not installed (the examples import it)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


def load_common():
    name = "forensics_examples_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / "_common.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass
class Launch:
    returncode: int
    output: str
    reports: dict[int, dict]  # rank -> the example's JSON report line

    def explain(self) -> str:
        return f"exit code {self.returncode}; output tail:\n{self.output[-6000:]}"


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra or {})
    return env


def launch(script: str, args: list[str], **kwargs) -> Launch:
    """Runs scripts/examples/<script> under torchrun (or `runner`) and collects each rank's report line."""
    return launch_script(str(EXAMPLES / script), args, **kwargs)


def launch_script(path: str, args: list[str], *, nproc: int = WORLD, env: dict | None = None,
                  timeout: int = LAUNCH_TIMEOUT, runner: list[str] | None = None) -> Launch:
    """Runs the script at `path` under torchrun (or `runner`, e.g. [python] for one process)."""
    if runner is None:
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    try:
        done = subprocess.run([*runner, path, *args], cwd=str(REPO), env=_env(env),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{path} hung: no exit within {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    output = done.stdout + done.stderr
    reports = {}
    decoder = json.JSONDecoder()
    for chunk in done.stdout.split("forensics-example ")[1:]:  # ranks share stdout: lines may abut
        report, _ = decoder.raw_decode(chunk)
        reports[report["rank"]] = report
    return Launch(done.returncode, output, reports)


def rank_samples(rank: int, world: int = WORLD) -> list[list[int]]:
    """The micro-batches (dataset indices) a DistributedSampler(shuffle=False) gives `rank`."""
    total = world * STEPS * ACCUM * MICRO
    indices = list(range(rank, total, world))
    return [indices[i:i + MICRO] for i in range(0, len(indices), MICRO)]


def reference_state() -> dict:
    """Plain-torch weights and AdamW state (by parameter name) right before step BAD_STEP."""
    common = load_common()
    torch.manual_seed(0)
    model = common.tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=common.LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.warmup)
    dataset = common.EmbedsDataset(WORLD * STEPS * ACCUM * MICRO, poison=POISON)
    per_rank = [rank_samples(rank) for rank in range(WORLD)]
    for step in range(BAD_STEP):
        for rank in range(WORLD):
            for index in per_rank[rank][step * ACCUM:(step + 1) * ACCUM]:
                items = [dataset[i] for i in index]
                loss = model(inputs_embeds=torch.stack([it["inputs_embeds"] for it in items]),
                             labels=torch.stack([it["labels"] for it in items])).loss
                (loss / (ACCUM * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": state,
            "lr": optimizer.param_groups[0]["lr"]}
