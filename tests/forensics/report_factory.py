"""Synthetic "forensics-report/1" reports, one per verdict kind, for renderer and writer tests."""

from __future__ import annotations

import copy
import math
from typing import Any

NAN, INF = math.nan, math.inf

# Module names of transformers' GPT2LMHeadModel(n_layer=2), as the replay engine would report them.
GPT2_MODULES = [
    "transformer.wte",
    "transformer.wpe",
    *(
        f"transformer.h.{i}.{m}"
        for i in range(2)
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    ),
    "transformer.ln_f",
    "lm_head",
]


def _per_sample(ids: list, culprits: list, culprit_loss: float) -> list[dict]:
    rows = []
    for i, sid in enumerate(ids):
        bad = sid in culprits
        loss = culprit_loss if bad else 3.5 + 0.01 * i
        rows.append(
            {
                "sample_id": sid,
                "micro_batch": i // 4,
                "index": i % 4,
                "loss": loss,
                "grad_norm": NAN if bad and not math.isfinite(culprit_loss) else 1.0 + 0.1 * i,
                "finite": math.isfinite(loss),
            }
        )
    return rows


def _per_layer(culprit_module: str | None, bad_value: float) -> list[dict]:
    rows = []
    for i, m in enumerate(GPT2_MODULES):
        hit = m == culprit_module
        rows.append(
            {
                "module": m,
                "grad_norm": bad_value if hit else 0.05 * (i + 1),
                "output_absmax": INF if hit and not math.isfinite(bad_value) else 2.0 + i,
            }
        )
    return rows


def make_report(
    kind: str = "bad_sample", *, sample_ids: list | None = None, culprits: list | None = None, **overrides: Any
) -> dict:
    """A complete report of the given verdict kind, with float nan/inf left as Python floats.

    Args:
        kind: a verdict kind (see forensics.report.VERDICT_KINDS).
        sample_ids: the ids of the step's samples (default: 8 string ids, "shard-0192/rec-5541<i>").
        culprits: the culprit ids (default depends on kind: one for bad_sample, none otherwise).
        overrides: top-level keys to replace (a dict value is merged into the section).
    """
    ids = list(sample_ids) if sample_ids is not None else [f"shard-0192/rec-5541{i}" for i in range(8)]
    if culprits is None:
        culprits = [ids[5]] if kind == "bad_sample" else []
    n_mb = max(1, math.ceil(len(ids) / 4))
    r: dict[str, Any] = {
        "schema": "forensics-report/1",
        "created_at": "2026-11-26T01:30:02Z",
        "dump": {
            "path": "crash_dumps/run-7/step-000041217",
            "run_id": "run-7",
            "step": 41217,
            "rank": 3,
            "world_size": 8,
            "missing_ranks": [],
            "num_micro_batches": n_mb,
        },
        "trigger": {
            "kind": "nonfinite_loss",
            "value": NAN,
            "threshold": None,
            "micro_batch": 1,
            "detail": "loss of micro-batch 1 is nan",
        },
        "environment": {
            "capture": {
                "python": "3.12.3",
                "torch": "2.11.0",
                "cuda": "12.8",
                "gpus": [{"name": "NVIDIA H100 80GB HBM3", "sm_count": 132}] * 8,
                "hostname": "node-17",
                "git_commit": "abc1234",
            },
            "replay": {"device": "cpu", "torch": "2.13.0", "gpu": None},
            "warnings": ["replayed on cpu, captured on NVIDIA H100 80GB HBM3: kernels differ"],
        },
        "reproduced": True,
        "fidelity": {
            "mode": "tolerance",
            "tolerance": 1e-4,
            "attempts": 1,
            "recorded_losses": [3.51, NAN][:n_mb],
            "replayed_losses": [3.5100002, NAN][:n_mb],
            "max_abs_diff": 2e-7,
            "recorded_grad_norm": NAN,
            "replayed_grad_norm": NAN,
            "bitwise_equal": False,
        },
        "verdict": {"kind": kind, "headline": "", "explanation": "", "suggestions": []},
        "culprit": {
            "samples": [],
            "module": None,
            "op": None,
            "phase": None,
            "parameter": None,
            "optimizer_state": None,
            "stats": {"inputs_absmax": None, "outputs_absmax": None, "params_absmax": None},
            "traceback": None,
        },
        "precision": {"autocast_dtype": "bfloat16", "fp32_reproduces": True},
        "bisection": {
            "runs": 5,
            "candidates": len(ids),
            "culprit_size": len(culprits),
            "budget": 2 * math.ceil(math.log2(max(2, len(ids)))) + 4,
        },
        "per_sample": _per_sample(ids, culprits, NAN),
        "per_layer": _per_layer(None, 0.0),
        "history": {
            "step": list(range(41208, 41218)),
            "loss": [3.9, 3.8, 3.8, 3.7, 3.7, 3.6, 3.6, 3.55, 3.52, NAN],
            "grad_norm": [1.1, 0.9, 1.0, 0.95, 1.0, 0.9, 1.05, 1.0, 0.98, INF],
        },
        "history_pattern": "sudden_jump",
        "timings": {"total_s": 12.5, "passes": 9},
    }
    c, v = r["culprit"], r["verdict"]
    c["samples"] = [
        {
            "sample_id": sid,
            "micro_batch": ids.index(sid) // 4 if sid in ids else 0,
            "index": ids.index(sid) % 4 if sid in ids else 0,
            "rank": 3,
        }
        for sid in culprits
    ]
    if kind == "bad_sample":
        c.update(
            module="transformer.h.1.mlp.c_fc",
            op="aten::addmm",
            phase="forward",
            stats={"inputs_absmax": 3.1e38, "outputs_absmax": INF, "params_absmax": 0.42},
        )
        r["per_layer"] = _per_layer(c["module"], NAN)
        v.update(
            headline=f"Sample {culprits[0]!r} alone makes step 41217 non-finite."
            if culprits
            else "Culprit samples make step 41217 non-finite.",
            explanation="Replaying micro-batch 1 without the culprit gives a finite loss.\n\n"
            "With it alone, the forward overflows in the MLP.",
            suggestions=["Filter this sample (blocklist written).", "Keep bf16."],
        )
    elif kind == "numerical_precision":
        r["precision"] = {"autocast_dtype": "float16", "fp32_reproduces": False}
        c.update(
            module="transformer.h.0.attn.c_attn",
            op="aten::baddbmm",
            phase="forward",
            stats={"inputs_absmax": 70000.0, "outputs_absmax": INF, "params_absmax": 1.3},
        )
        r["per_layer"] = _per_layer(c["module"], INF)
        r["bisection"] = None
        v.update(
            headline="fp16 overflow in attention: step 41217 is finite in fp32.",
            explanation="Attention logits exceed 65504, the float16 maximum.",
            suggestions=["Use bfloat16 instead of float16.", "Scale attention logits down."],
        )
    elif kind == "optimizer_update":
        r["trigger"].update(kind="nonfinite_param", detail="parameter lm_head.weight is nan after the step")
        r["fidelity"].update(
            recorded_losses=[3.51, 3.52][:n_mb],
            replayed_losses=[3.51, 3.52][:n_mb],
            recorded_grad_norm=1.2,
            replayed_grad_norm=1.2,
        )
        c.update(
            module="lm_head",
            op="aten::_foreach_div",
            phase="optimizer",
            parameter="lm_head.weight",
            optimizer_state="exp_avg_sq == 0 with eps == 0",
        )
        r["per_sample"] = _per_sample(ids, [], 3.5)
        v.update(
            headline="The AdamW update divides by zero for lm_head.weight (eps = 0).",
            explanation="Forward and backward are finite; the update makes the weight nan.",
            suggestions=["Set eps to 1e-8."],
        )
    elif kind == "model_state":
        c.update(
            parameter="transformer.h.0.ln_1.weight",
            stats={"inputs_absmax": None, "outputs_absmax": None, "params_absmax": NAN},
        )
        v.update(
            headline="The weights were already non-finite before step 41217.",
            suggestions=["Resume from an earlier checkpoint."],
        )
    elif kind == "not_reproduced":
        r["reproduced"] = False
        r["fidelity"].update(attempts=3, replayed_losses=[3.51, 3.49][:n_mb], replayed_grad_norm=1.1, max_abs_diff=None)
        r["bisection"] = None
        r["precision"] = {"autocast_dtype": "bfloat16", "fp32_reproduces": None}
        r["per_sample"] = None
        r["per_layer"] = None
        r["history_pattern"] = "insufficient_history"
        v.update(
            headline="The replay of step 41217 is finite: the failure did not reproduce.",
            explanation="Suspect hardware or distributed state.",
            suggestions=["Replay on the same GPU model.", "Check the node for ECC errors."],
        )
    elif kind == "spike_no_single_cause":
        r["trigger"].update(
            kind="loss_spike",
            value=87234.5,
            threshold=20.0,
            micro_batch=0,
            detail="loss 87234.5 is above 20.0 (10x the running median)",
        )
        r["fidelity"].update(
            recorded_losses=[87234.5, 3.5][:n_mb],
            replayed_losses=[87234.5, 3.5][:n_mb],
            recorded_grad_norm=512.0,
            replayed_grad_norm=512.0,
            mode="bitwise",
            tolerance=None,
            bitwise_equal=True,
            max_abs_diff=0.0,
        )
        r["per_sample"] = _per_sample(ids, [ids[2]], 9.5e4)
        r["per_sample"][3]["loss"] = 5.0e4
        r["per_layer"] = _per_layer("transformer.h.1.mlp.c_proj", 300.0)
        r["history"]["loss"][-1] = 87234.5
        r["history"]["grad_norm"][-1] = 512.0
        r["precision"] = {"autocast_dtype": None, "fp32_reproduces": None}
        v.update(
            headline="Step 41217's loss spike reproduces, but no single sample explains it.",
            explanation="Two samples have very high loss; removing either one leaves a spike.",
            suggestions=["Inspect the highest-loss samples.", "Lower the learning rate."],
        )
    elif kind == "exception":
        r["schema"] = "forensics-report/2"
        r["trigger"].update(
            kind="exception",
            value=math.nan,
            threshold=None,
            micro_batch=1,
            detail="IndexError during the forward: index out of range in self",
        )
        r["culprit"].update(
            samples=[{"sample_id": ids[5], "micro_batch": 1, "index": 1, "rank": 3}],
            module="model.embed_tokens",
            op="aten::embedding",
            phase="forward",
        )
        r["per_sample"] = None
        r["per_layer"] = None
        r["precision"] = None
        r["exception"] = {
            "type": "IndexError",
            "message": "index out of range in self",
            "during": "forward",
            "module": "model.embed_tokens",
            "op": "aten::embedding",
            "micro_batch": 1,
            "detail": "token id 300 \u2265 vocabulary size 128 at position 16",
            "bad_values": [{"what": "token id", "value": 300, "limit": 128}],
        }
        v.update(
            headline=f"Sample '{ids[5]}' alone makes step 41217 raise IndexError in the forward pass at "
            "`model.embed_tokens` (aten::embedding): token id 300 \u2265 vocabulary size 128 at "
            "position 16.",
            explanation="The replay raised IndexError where the job did.",
            suggestions=["Filter the sample and fix the record."],
        )
    elif kind == "instability_ahead":
        r["schema"] = "forensics-report/3"
        r["trigger"].update(
            kind="precursor",
            value=4.25,
            threshold=0.11,
            micro_batch=None,
            detail="attention-logit bound of transformer.h.0 has stayed above its baseline",
        )
        r["reproduced"] = False
        r["fidelity"] = {"mode": "not_replayed", "reason": "a precursor dump holds a healthy step"}
        r["culprit"].update(samples=[], module="transformer.h.0", op=None, phase=None)
        r["per_sample"] = r["per_layer"] = r["precision"] = None
        r["precursor"] = {
            "fired": None,
            "ranked": 1,
            "columns": 20,
            "steps": [1, 2, 3, 4],
            "ranking": [
                {
                    "layer": "transformer.h.0",
                    "statistic": "attention_logit_bound",
                    "words": "attention-logit bound",
                    "started": 2,
                    "baseline": 0.1,
                    "last": 4.0,
                    "growth": 40.0,
                }
            ],
            "series": [
                {
                    "layer": "transformer.h.0",
                    "statistic": "attention_logit_bound",
                    "started": 2,
                    "baseline": 0.1,
                    "values": [0.1, 0.5, 2.0, 4.0],
                }
            ],
        }
        v.update(
            headline="Instability ahead at step 41217: the attention-logit bound of `transformer.h.0` started to "
            "grow first, at step 2.",
            explanation="1 of 20 per-layer statistics left their baseline.",
            suggestions=["Add QK-norm."],
        )
    elif kind == "trigger_sample":
        r["schema"] = "forensics-report/4"
        r["trigger"].update(kind="grad_norm_spike", value=17.7, threshold=3.1)
        r["culprit"].update(samples=[{"sample_id": ids[5], "micro_batch": 1, "index": 1, "rank": 3, "trigger": True}])
        r["evidence"] = {
            "bad_data": False,
            "against": [],
            "earlier_state": None,
            "ordinary": "its loss 4.198 against 4.1-4.24 for the other 15; its gradient norm 17.7 against 0.24-0.8",
        }
        v.update(
            headline=f"Sample '{ids[5]}' alone is the first to make the gradient norm spike at step 41217, but "
            "nothing marks the record as bad: the model's state is what fails, and no sample is to "
            "blame.",
            explanation="First to cross: sample 'x' alone. Its record looks like the others.",
            suggestions=["Do not filter it: no blocklist is written.", "Lower the learning rate."],
        )
    elif kind == "silent_corruption":
        r["schema"] = "forensics-report/5"
        r["trigger"].update(kind="silent_corruption", value=None, threshold=None)
        r["reproduced"] = False
        r["culprit"].update(samples=[], module="transformer.h.1.mlp.c_fc", op=None, phase=None)
        r["per_sample"] = r["per_layer"] = r["precision"] = None
        r["silent"] = {
            "class": "transient",
            "check": "recompute",
            "module": "transformer.h.1.mlp.c_fc",
            "wrong": "job",
            "drain_rank": 3,
            "rank": 3,
            "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "host": "node-17"},
        }
        v.update(
            headline="Silent corruption at step 41217, rank 3: a transient fault hit the job's own run (first at "
            "`transformer.h.1.mlp.c_fc`); the replay agrees with the other computation.",
            explanation="The job ran the step twice; the two runs part at transformer.h.1.mlp.c_fc.",
            suggestions=["Re-run step 41217.", "Watch rank 3's device."],
        )
    else:
        raise ValueError(f"unknown verdict kind {kind!r}")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(r.get(key), dict):
            r[key].update(value)
        else:
            r[key] = value
    return copy.deepcopy(r)
