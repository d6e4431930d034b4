"""A GPT-2 from a config trained at a learning rate far too high — nothing wrong with the data (issue 50, item 1).

What a new user ran: `GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, ...))`, plain SGD at lr 18, bf16 autocast on
the CPU, eight samples per step from a shuffled `IndexedDataset` of random token sequences, the default GuardConfig
(plus a host snapshot every 4 steps, so that the replay can feed the culprits to an earlier state). The loss grows
geometrically and goes non-finite within ~10 steps. Its NaN dump must replay with no record blamed: no `bad_sample`,
no blocklist, no sample named as anything but the first to cross (tests/natural/test_gpt2_lr.py). On a GPU:

    python tests/natural/gpt2_lr_job.py OUTDIR [--lr 18] [--fp32] [--device cuda] [--replay-on cuda,cpu]

prints one JSON line per replay device (the verdict, the samples named, whether a blocklist was written) and exits 1
unless every replay blames no record and all give the same verdict kind (scripts/gpu_newuser.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SEED = (
    104  # a seed whose bf16 run at lr 18 replayed as bad_sample before issue 50 (dev box, one thread as in the tests)
)
SAMPLES, SEQ, VOCAB, BATCH = 64, 16, 64, 8


class RandomTokens:
    """Map-style dataset of {"input_ids", "labels"}: uniform random tokens, nothing odd in any record."""

    def __init__(self, n: int = SAMPLES, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, VOCAB, (SEQ,), generator=gen) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        ids = self.items[index]
        return {"input_ids": ids, "labels": ids}


def train(
    out: str | Path,
    lr: float = 18.0,
    bf16: bool = True,
    device: str = "cpu",
    seed: int = SEED,
    transient_nan_at: int | None = None,
) -> list:
    """The run; returns the Guard's dumps (the last is the crash's). `transient_nan_at`: at that step, one gradient
    value is NaN once, after backward (what a bit flip on the device would leave; the weights and data are fine)."""
    import transformers

    from forensics.capture import Guard, GuardConfig, IndexedDataset, RecordConfig
    from forensics.core.errors import TrainingFaultError

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).to(device)  # dropout on, as GPT2Config() has it
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(out), run_id=f"gpt2-lr{lr:g}", recording=RecordConfig(snapshot_every=4)),
    )
    loader = torch.utils.data.DataLoader(
        IndexedDataset(RandomTokens()), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    kind = torch.device(device).type
    step = 0
    try:
        for _ in range(5):
            for batch in loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                guard.record_batch(batch)
                with torch.autocast(kind, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                    guard.record_loss(loss)
                loss.backward()
                if step == transient_nan_at:
                    with torch.no_grad():
                        model.lm_head.weight.grad[0, 0] = float("nan")
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
                step += 1
    except TrainingFaultError:
        pass
    finally:
        guard.close()
    return list(guard.dumps)


def replay(dump: str | Path, out: str | Path, device: str = "cpu") -> dict:
    """`forensics replay DUMP --device DEVICE -o OUT` through the CLI; what a user reads from it (JSON-safe)."""
    from click.testing import CliRunner

    from forensics.cli import main

    result = CliRunner().invoke(main, ["replay", str(dump), "--device", device, "-o", str(out)])
    report = json.loads((Path(out) / "report.json").read_text()) if (Path(out) / "report.json").exists() else {}
    blocklist = Path(out) / "blocklist.jsonl"
    samples = (report.get("culprit") or {}).get("samples") or []
    return {
        "device": device,
        "exit_code": result.exit_code,
        "verdict": (report.get("verdict") or {}).get("kind"),
        "headline": (report.get("verdict") or {}).get("headline"),
        "samples": [s.get("sample_id") for s in samples],
        "triggers": [bool(s.get("trigger")) for s in samples],
        "blocklist": blocklist.read_text().split() if blocklist.exists() else [],
        "bad_data": (report.get("evidence") or {}).get("bad_data"),
        "suggestions": (report.get("verdict") or {}).get("suggestions") or [],
        "output": result.output[-2000:] if result.exit_code not in (0, 3, 4) else "",
    }


def problems(out: dict) -> list[str]:
    """What is wrong with one replay's outcome for a run with nothing wrong in its data (empty: it holds)."""
    found = []
    if out["verdict"] in (None, "bad_sample", "exception"):
        found.append(f"verdict {out['verdict']}")
    if out["blocklist"]:
        found.append(f"blocklist {out['blocklist']}")
    if out["bad_data"]:
        found.append("evidence.bad_data is true")
    if not all(out["triggers"]):
        found.append(f"samples named as culprits, not triggers: {out['samples']}")
    if any(s.startswith("Filter ") for s in out["suggestions"]):
        found.append("a 'Filter' suggestion")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--lr", type=float, default=18.0)
    parser.add_argument("--fp32", action="store_true", help="no autocast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--replay-on", default="cpu", help="comma-separated replay devices")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    dumps = train(args.out, args.lr, not args.fp32, args.device, args.seed)
    if not dumps:
        print(json.dumps({"lr": args.lr, "fp32": args.fp32, "problems": ["no dump: the run did not fail"]}))
        return 1
    outs = []
    for device in args.replay_on.split(","):
        out = replay(dumps[-1], Path(args.out) / f"report-{device.replace(':', '')}", device)
        out.update(lr=args.lr, fp32=args.fp32, trained_on=args.device, dump=str(dumps[-1]), problems=problems(out))
        print(json.dumps(out))
        outs.append(out)
    same = len({o["verdict"] for o in outs}) == 1
    if not same:
        print(
            json.dumps(
                {"problems": ["the replays disagree: " + ", ".join(f"{o['device']}: {o['verdict']}" for o in outs)]}
            )
        )
    return 0 if same and not any(o["problems"] for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
