"""A job whose last step spikes, so that its spike dump is still being written in the background when the job ends:
by reaching the end of the script (`exit`) or by SIGTERM (`sigterm`, sent to itself right after check()); or
(`nan_last`) whose last step is non-finite under the default GuardConfig with a fused AdamW, so that the sync-free
check still has it to judge when the script ends without guard.close(). Used by tests/capture/test_exit_flush.py:

    python tests/capture/exit_job.py DUMP_DIR exit|sigterm|nan_last

Signals while a dump is being written (issue 43): `flush_exit SIGNALS` ends the script with the spike dump in flight
and sends itself SIGNALS (e.g. TERM,INT) during the exit flush; `flush_sigterm SIGNALS` waits at the end of the script
and sends SIGNALS (the first one starting the flush) while the dump is written; `sync_nan SIGNALS` has a non-finite
last step dumped synchronously (policy 'raise') and sends SIGNALS while that write is under way. The signals are sent
0.2 s apart from inside the write (the dump's first JSON file, after its weights), so they land mid-write whatever
the machine's speed:

    python tests/capture/exit_job.py DUMP_DIR flush_exit|flush_sigterm|sync_nan TERM,TERM|TERM,INT|INT
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig, SpikeConfig
from forensics.format import writer

WIDTH = 2048  # 16 MiB of weights (+ 32 MiB of Adam state): written with the thread pool, long enough to be in flight
GAP_S = 0.2  # between two signals


def send_during_the_write(signals: list[signal.Signals], ready: threading.Event) -> None:
    """Sends `signals` to this process from inside the dump's first JSON write (once `ready` is set: the job is where
    the case wants it), GAP_S apart; the write then goes on. The write itself is the real one."""
    write_json, sent = writer._DumpDir.write_json, []

    def write_json_under_signals(self, name, obj):
        if not sent:
            sent.append(name)
            ready.wait(30)
            for signum in signals:
                time.sleep(GAP_S)
                os.kill(os.getpid(), signum)
            time.sleep(GAP_S)
        return write_json(self, name, obj)

    writer._DumpDir.write_json = write_json_under_signals


def main(dump_dir: str, how: str, signals: list[signal.Signals]) -> None:
    torch.manual_seed(0)
    nan_last = how in ("nan_last", "sync_nan")
    small = how == "nan_last"
    model = torch.nn.Linear(64 if small else WIDTH, 64 if small else WIDTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=small)
    if how == "sync_nan":
        config = GuardConfig(dump_dir=dump_dir, run_id="ending", detection=DetectionConfig(sync_free=False))
    elif nan_last:
        config = GuardConfig(dump_dir=dump_dir, run_id="ending")
    else:
        config = GuardConfig(
            dump_dir=dump_dir, run_id="ending", detection=DetectionConfig(loss_spike=SpikeConfig(window=8, warmup=4))
        )
    ready = threading.Event()
    if signals:
        send_during_the_write(signals, ready)
    if how in ("flush_sigterm", "sync_nan"):
        ready.set()
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
    if how == "flush_sigterm":
        time.sleep(60)  # never reached the end: the signals sent during the write end the job once it is written
    if how == "flush_exit":
        atexit.register(ready.set)  # runs before the writer's exit flush (registered earlier: atexit is LIFO)
    # "exit": the script ends here, with the spike dump in flight and no guard.close(); "nan_last": with step 7 not
    # judged yet (its update was skipped on the device)


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        [signal.Signals["SIG" + s] for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [],
    )
