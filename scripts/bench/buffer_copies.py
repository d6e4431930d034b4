"""Benchmark: the per-step cost of copying the model's buffers before the forward (capture/state/buffers.py).

A ResNet-shaped CNN (BatchNorm after every convolution) trained with the Guard, step time with the
pre-forward buffer copy on and off (interleaved rounds), and the copy alone against one plain `copy_` of the
same bytes. GPU: 32 blocks of 256 channels, batch 64 x 64x64 images, bf16 autocast; CPU: 16 blocks of 32
channels, batch 16 x 32x32.
Usage: python -m scripts.bench.buffer_copies [--rounds 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig
from scripts.bench.common import machine, median, timed


def cnn(blocks: int, width: int) -> torch.nn.Module:
    layers = [torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
    for _ in range(blocks):
        layers += [
            torch.nn.Conv2d(width, width, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(),
        ]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks, width, batch, side = (32, 256, 64, 64) if device == "cuda" else (16, 32, 16, 32)
    torch.manual_seed(0)
    model = cnn(blocks, width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=tempfile.mkdtemp(), detection=DetectionConfig(on_nonfinite="continue")),
    )
    data = {
        "image": torch.randn(batch, 3, side, side, device=device),
        "label": torch.randint(0, 10, (batch,), device=device),
        "sample_ids": list(range(batch)),
    }

    def steps() -> None:
        for _ in range(args.steps):
            guard.record_batch(data)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(data["image"]), data["label"])
            guard.record_loss(loss)
            loss.backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()

    steps()  # warm-up
    times: dict[str, list[float]] = {"buffers copied": [], "buffers not copied": []}
    for _ in range(args.rounds):
        for mode in times:
            guard.buffers.off = mode == "buffers not copied"
            times[mode].append(timed(steps, device) / args.steps)
    guard.buffers.off = False
    live = [b for b in model.buffers()]
    nbytes = sum(b.numel() * b.element_size() for b in live)
    take = median([timed(guard.buffers.take, device) for _ in range(50)])
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    plain = median([timed(lambda: flat.copy_(source), device) for _ in range(50)])
    guard.close()
    step = {mode: median(values) for mode, values in times.items()}
    print(
        json.dumps(
            {
                "machine": machine(),
                "buffers": len(live),
                "buffer_bytes": nbytes,
                "step_ms": {mode: round(1e3 * t, 3) for mode, t in step.items()},
                "step_ratio_copied_over_not": round(step["buffers copied"] / step["buffers not copied"], 4),
                "copy_ms": round(1e3 * take, 4),
                "one_plain_copy_of_the_same_bytes_ms": round(1e3 * plain, 4),
                "copy_share_of_step": round(take / step["buffers not copied"], 5),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
