"""Test worker (torchrun, gloo): tests/natural's `spiky_late` scenario on two ranks under DDP — nothing planted.

Each rank trains the tiny transformer on its own seeded data, whose every 7th batch comes from a harder source
(spikes that recover), at a learning rate that keeps rising, until the run dies by itself; the DEFAULT GuardConfig
plus PrecursorConfig() (opt-in) and the recipe. The run log, the dumps and the precursor's are what
tests/integrations/test_timeline_run.py turns into one run page. Usage: timeline_worker.py DUMP_DIR
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

NATURAL = Path(__file__).resolve().parents[1] / "natural"
sys.path.insert(0, str(NATURAL))

from natural_job import SCENARIOS, batches, recipe  # noqa: E402
from natural_models import build, lm_loss  # noqa: E402

from forensics.capture import DumpConfig, Guard, GuardConfig, PrecursorConfig  # noqa: E402
from forensics.core.errors import TrainingFaultError  # noqa: E402

RUN_ID = "spiky-two-ranks"


def main() -> None:
    dump_dir = sys.argv[1]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    scenario = SCENARIOS["spiky_late"]
    torch.manual_seed(0)
    model = build(0, **scenario.model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=scenario.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 + scenario.lr_growth * s)
    config = GuardConfig(
        dump_dir=dump_dir,
        run_id=RUN_ID,
        precursors=PrecursorConfig(),
        dumping=DumpConfig(recipe=recipe(scenario)),
    )
    guard = Guard(ddp, optimizer, schedule, config=config, loss_fn=lm_loss)
    try:
        for _, batch in zip(range(scenario.steps), batches(scenario.data, seed=1 + rank)):
            guard.record_batch(batch)
            loss = lm_loss(ddp, batch)
            guard.record_loss(loss)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), math.inf)
            if guard.check(grad_norm=norm):
                optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    except TrainingFaultError:
        pass
    finally:
        guard.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
