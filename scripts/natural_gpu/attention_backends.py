"""Why the new user's GPT-2 GPU dumps (tests/data/natural_gpu/gpt2_newuser_*) have a NaN gradient norm on the GPU and a
finite one on the CPU (issue 50): each dump's step replayed with the replay's own tools (load_session, StepRunner,
localize_backward) under each scaled-dot-product-attention kernel, eager attention, and fp32:

    PYTHONPATH=. python -m scripts.natural_gpu.attention_backends OUT [--device cuda:0] [--device cpu]

Per dump and device: the job's kernels (SDPA's own choice) — grad norm, whether the gradients themselves hold NaN/Inf
(NaN/Inf elements per parameter) or only their norm overflows, the first backward node that made a non-finite gradient
(anomaly mode), the attention kernels the profiler saw; then the same step with SDPA held to one backend (math,
efficient, flash, cudnn), with eager attention, and in fp32; and the attention logits' largest magnitude per layer
(fp64 from the replayed q, k) against 88 (the largest argument exp survives in fp32) times fp32's rounding there.
Writes OUT/attention_backends.json and prints one line per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from forensics.format import open_dump  # noqa: E402
from forensics.replay.load.session import load_session  # noqa: E402
from forensics.replay.localize.forward_backward import localize_backward  # noqa: E402
from forensics.replay.run.execute import StepRunner  # noqa: E402

DATA = REPO / "tests" / "data" / "natural_gpu"


def _attention(model: torch.nn.Module, impl: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = impl


def _grads(runner: StepRunner) -> dict[str, Any]:
    bad = {}
    for name, p in runner.model.named_parameters():
        g = p.grad
        if g is None:
            continue
        nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
        if nan or inf:
            bad[name] = {"nan": nan, "inf": inf, "of": g.numel()}
    finite = [p.grad.detach().abs().max().item() for _, p in runner.model.named_parameters() if p.grad is not None]
    return {"nonfinite": bad, "largest_abs": max((v for v in finite if math.isfinite(v)), default=None)}


def _run(runner: StepRunner, what: str, context: Any = None, fp32: bool = False) -> dict[str, Any]:
    try:
        with context if context is not None else contextlib.nullcontext():
            result = runner.run(fp32=fp32, keep_grads=True)
            grads = _grads(runner)
    except RuntimeError as exc:  # a backend this GPU or these shapes do not support
        return {"what": what, "error": str(exc).splitlines()[0][:200]}
    return {
        "what": what,
        "loss": result.losses[0],
        "grad_norm": result.grad_norm,
        "grads_finite": result.grads_finite,
        "norm_overflow": result.norm_overflow,
        **grads,
    }


def _kernels(runner: StepRunner) -> list[str]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.session.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        runner.run()
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if any(k in n.lower() for k in ("attention", "fmha", "flash", "sdpa", "softmax")))


def _logits(runner: StepRunner) -> list[dict[str, Any]]:
    model = runner.model
    qkv: dict[int, torch.Tensor] = {}
    blocks = getattr(getattr(model, "transformer", None), "h", [])
    handles = [
        b.attn.c_attn.register_forward_hook(lambda m, i, o, k=k: qkv.__setitem__(k, o.detach()))
        for k, b in enumerate(blocks)
    ]
    try:
        runner.run(backward=False)
    finally:
        for h in handles:
            h.remove()
    heads = int(getattr(getattr(model, "config", None), "n_head", 1))
    rows = []
    for k, t in sorted(qkv.items()):
        batch, seq, width = t.shape
        d = width // 3 // heads
        q, key, _ = t.double().split(width // 3, dim=2)
        q = q.view(batch, seq, heads, d).transpose(1, 2)
        key = key.view(batch, seq, heads, d).transpose(1, 2)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=t.device).tril()
        s = ((q @ key.transpose(-1, -2)) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        top = float(s[..., causal].abs().max())
        # a fused kernel's backward recomputes P = exp(S - logsumexp) from logits computed again in another order: one
        # fp32 rounding apart here (the fp32 product vs the fp64 one rounded), exp of the difference overflows
        s32 = ((q.float() @ key.float().transpose(-1, -2)) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(s32, dim=-1, keepdim=True)
        recomputed = torch.exp(s.float() - lse)[..., causal]
        rows.append(
            {
                "layer": k,
                "logit_absmax": top,
                "fp32_rounding_there": top * 2**-24,
                "exp_limit": 88.7,
                "recomputed_probabilities_inf": int(torch.isinf(recomputed).sum()),
                "of": recomputed.numel(),
            }
        )
    return rows


def replay_one(path: Path, device: str) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    session = load_session(open_dump(path), device=device)
    runner = StepRunner(session)
    out: dict[str, Any] = {
        "dump": path.name,
        "device": device,
        "recorded": {"losses": session.recorded_losses, "grad_norm": session.recorded_grad_norm},
        "autocast": session.autocast,
    }
    runs = [_run(runner, "job's kernels (SDPA picks)")]
    finding = localize_backward(runner)
    out["first_nonfinite_backward"] = (
        None
        if finding is None
        else {
            "backward_node": finding.backward_node,
            "module": finding.module,
            "op": finding.op,
            "parameter": finding.parameter,
        }
    )
    out["attention_kernels"] = _kernels(runner)
    for backend in ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"):
        runs.append(_run(runner, f"SDPA held to {backend}", sdpa_kernel([getattr(SDPBackend, backend)])))
    _attention(runner.model, "eager")
    runs.append(_run(runner, "eager attention"))
    _attention(runner.model, "sdpa")
    runs.append(_run(runner, "fp32 (no autocast), SDPA picks", fp32=True))
    out["runs"] = runs
    out["logits"] = _logits(runner)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", action="append", default=None)
    args = parser.parse_args()
    devices = args.device or (["cuda:0", "cpu"] if torch.cuda.is_available() else ["cpu"])
    results = []
    for path in sorted(DATA.glob("gpt2_newuser_*.tar.zst")):
        for device in devices:
            row = replay_one(path, device)
            results.append(row)
            print(f"== {path.name} on {device}: first non-finite backward {row['first_nonfinite_backward']}")
            print(f"   attention kernels: {row['attention_kernels']}")
            for run in row["runs"]:
                if "error" in run:
                    print(f"   {run['what']:34s} not run: {run['error']}")
                    continue
                print(
                    f"   {run['what']:34s} loss {run['loss']:.4g} grad norm {run['grad_norm']:.4g} grads finite "
                    f"{run['grads_finite']} (norm overflow {run['norm_overflow']}) non-finite "
                    f"{dict(list(run['nonfinite'].items())[:3])}"
                )
            for layer in row["logits"]:
                print(
                    f"   layer {layer['layer']}: |attention logit| up to {layer['logit_absmax']:.3g}, fp32 rounding "
                    f"there {layer['fp32_rounding_there']:.3g} (exp overflows fp32 past {layer['exp_limit']}); "
                    f"probabilities recomputed from the logsumexp one rounding apart: "
                    f"{layer['recomputed_probabilities_inf']} of {layer['of']} inf"
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_backends.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
