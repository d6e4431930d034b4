"""Example: a torchtitan model (its Llama 3 `Transformer`, debug size) sharded with torchtitan's own `apply_fsdp`
(FSDP2 over every rank), trained with a per-token loss mask, guarded by forensics.

    torchrun --nproc_per_node=2 scripts/examples/torchtitan_example.py --dump-dir /tmp/dumps --run-id titan
    forensics replay /tmp/dumps/titan/step-000000003 --rank 1 --trust --path scripts/examples

Runs on CPU (gloo) or GPUs (nccl). Needs `pip install torchtitan==0.2.0` (its Llama with SDPA attention).
The data pipeline gives each token a loss weight (a quality score, as many pretraining pipelines do); in step 3
rank 1 reads a corrupted record whose weights are NaN. Its micro-batch loss is NaN, every rank agrees on the step
and writes its own shards (no gather), and `forensics replay` names the record on one device. The replay builds
the model with `build_model` and the loss with `masked_loss` below (`--trust` lets it import them).
"""

from __future__ import annotations


import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

import _common
from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, IndexedDataset

VOCAB, SEQ = 128, 16


def build_model(seed: int = 0) -> torch.nn.Module:
    """torchtitan's Llama 3 Transformer at debug size (random init, nothing downloaded)."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(
        TransformerModelArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, use_flex_attn=False
        )
    )
    model.init_weights()
    return model


def masked_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Next-token cross-entropy weighted per token (the job's loss; replay imports it by name)."""
    logits = model(batch["tokens"])
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none"
    )
    weights = batch["weights"].flatten()
    return (per_token * weights).sum() / weights.sum()


class WeightedTokens(torch.utils.data.Dataset):
    """`n` records {"tokens", "labels" (SEQ ids), "weights" (SEQ loss weights)}; record `poison` has NaN weights."""

    def __init__(self, n: int, poison: int | None = None):
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.weights = torch.rand(n, SEQ, generator=g) + 0.5
        if poison is not None and poison >= 0:
            self.weights[poison, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"tokens": self.tokens[index, :-1], "labels": self.tokens[index, 1:], "weights": self.weights[index]}


def main() -> None:
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    args = _common.parser(__doc__).parse_args()
    rank, world, device = _common.init_distributed()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    model = build_model().to(device)
    # torchtitan's default mixed precision: bf16 compute, fp32 gradient reduction (replay computes the same way)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_common.LR)
    # --- forensics: one line to create the guard (the recipe names this file's model factory and loss) ---
    guard = Guard(
        model,
        optimizer,
        loss_fn=masked_loss,
        config=GuardConfig(
            dump_dir=args.dump_dir,
            run_id=args.run_id,
            detection=DetectionConfig(on_nonfinite=args.policy, max_grad_norm=_common.CLIP),
            dumping=DumpConfig(
                max_dumps=args.max_dumps,
                state_layout=args.layout,
                shard_replicas=args.replicas,
                recipe={"factory": "torchtitan_example:build_model", "loss": "torchtitan_example:masked_loss"},
            ),
        ),
    )

    samples = world * args.steps * args.accum * args.micro_batch
    dataset = IndexedDataset(WeightedTokens(samples, poison=args.poison))
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=DistributedSampler(dataset, shuffle=False))
    batches = iter(loader)
    with _common.reported(rank, guard) as timer:  # one report line per rank; the Guard closed
        for _step in range(args.steps):
            for index in range(args.accum):
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(batches).items()}
                guard.record_batch(batch)  # forensics
                model.set_requires_gradient_sync(index == args.accum - 1)
                loss = masked_loss(model, batch)
                guard.record_loss(loss)  # forensics
                (loss / args.accum).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), _common.CLIP)
            timer.restart()
            if guard.check(grad_norm=grad_norm):  # forensics
                optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
