"""A job whose last step spikes, so that its spike dump is still being written in the background when the job ends:
by reaching the end of the script (`exit`) or by SIGTERM (`sigterm`, sent to itself right after check()); or
(`nan_last`) whose last step is non-finite under the default GuardConfig with a fused AdamW, so that the sync-free
check still has it to judge when the script ends without guard.close(). Used by tests/capture/test_exit_flush.py:

    python tests/capture/exit_job.py DUMP_DIR exit|sigterm|nan_last
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from capture import DetectionConfig, Guard, GuardConfig, SpikeConfig

WIDTH = 2048  # 16 MiB of weights (+ 32 MiB of Adam state): written with the thread pool, long enough to be in flight


def main(dump_dir: str, how: str) -> None:
    torch.manual_seed(0)
    nan_last = how == "nan_last"
    model = torch.nn.Linear(64 if nan_last else WIDTH, 64 if nan_last else WIDTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=nan_last)
    config = GuardConfig(dump_dir=dump_dir, run_id="ending") if nan_last else \
        GuardConfig(dump_dir=dump_dir, run_id="ending", detection=DetectionConfig(loss_spike=SpikeConfig(window=8,
                                                                                                      warmup=4)))
    guard = Guard(model, optimizer, config=config)
    x = torch.randn(4, model.in_features, generator=torch.Generator().manual_seed(1))
    last = float("nan") if nan_last else 100.0  # the last step's target is far off, or not a number
    for step in range(8):
        batch = {"x": x, "sample_ids": [f"s{step}-{i}" for i in range(4)]}
        guard.record_batch(batch)
        loss = (model(x) - (last if step == 7 else 0.0)).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # never reached the end: SIGTERM ends the job once the dump is written
    # "exit": the script ends here, with the spike dump in flight and no guard.close(); "nan_last": with step 7 not
    # judged yet (its update was skipped on the device)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
