"""The replica check: where every rank holds the same parameters (DDP), their digests must agree across ranks.

Every `replica_every` steps, at check() (before the optimizer: the replicas have applied the same updates), each
rank digests each parameter on its device (forensics/core/silent.tensor_digest: one int64 per parameter, no copy to
the host) and one all-reduce (MAX of the digests and of their negation) gives every rank the largest and smallest
digest of each parameter: they differ where some replica differs. Only then, a second all-reduce counts the ranks at
the largest digest, so a majority names the replica that drifted; with two replicas there is no majority, and the
rank whose own parameters changed since its last optimizer update (a digest taken right after the update that
precedes a check, by an optimizer hook installed for that update only) is the one that drifted. A step that is not
checked and does not precede a check runs nothing of this check. Each rank sends and receives O(#parameters) numbers, whatever the world
size.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from forensics.core.silent import tensor_digest

MAX_NAMED = 64  # parameters listed in silent.json (the count says how many more)


class ReplicaCheck:
    """Digests the parameters across replicas every `every` steps (module docstring). Nothing of it runs on a step
    that neither is checked nor precedes a check: the optimizer hook that takes the after-update digest is installed
    at the check() of the step before a checked one and removes itself once it has run."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, every: int, add_hook: Any, device: torch.device):
        self.params = [(name, p) for name, p in model.named_parameters()]
        self.every, self.device = every, device
        self.after_update: torch.Tensor | None = None
        self.target = getattr(optimizer, "optimizer", optimizer)  # a wrapper (accelerate) holds the torch optimizer
        self._hook: Any = None
        add_hook(types.SimpleNamespace(remove=self._disarm))  # close() removes a hook left armed

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def digests(self) -> torch.Tensor:
        return torch.stack([tensor_digest(p)[0].to(self.device) for _, p in self.params])

    def _arm(self) -> None:
        if self._hook is None and hasattr(self.target, "register_step_post_hook"):
            self._hook = self.target.register_step_post_hook(self._updated)

    def _disarm(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _updated(self, *args: Any) -> None:
        self._disarm()
        self.after_update = self.digests()

    def check(self, step: int, world_size: int) -> dict | None:
        """This rank's side of the check of `step`: None when every replica agrees, else the evidence (the same
        parameters on every rank; `drifted`: this rank's copy is the odd one)."""
        self._disarm()  # a step whose update did not run (the skip policy) leaves no after-update digest
        if self.due(step + 1):
            self._arm()
        after, self.after_update = self.after_update, None
        if not self.due(step) or not self.params:
            return None
        mine = self.digests()
        both = torch.cat([mine, -mine])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        high, low = both[: len(mine)], -both[len(mine) :]
        differ = (high != low).nonzero().flatten().tolist()
        if not differ:
            return None
        at_high = (mine == high).to(torch.int64)
        torch.distributed.all_reduce(at_high, op=torch.distributed.ReduceOp.SUM)
        mine_h, high_h, low_h, count_h = mine.tolist(), high.tolist(), low.tolist(), at_high.tolist()
        changed = (mine != after).tolist() if after is not None else None
        rows: list[dict] = []
        changed_names: list[str] = []
        odd_by_vote = tie = False
        for i in differ:
            majority = high_h[i] if count_h[i] * 2 > world_size else low_h[i] if count_h[i] * 2 < world_size else None
            tie = tie or majority is None
            odd_by_vote = odd_by_vote or (majority is not None and mine_h[i] != majority)
            if changed is not None and changed[i]:
                changed_names.append(self.params[i][0])
            if len(rows) < MAX_NAMED:
                rows.append(
                    {
                        "name": self.params[i][0],
                        "digest": mine_h[i],
                        "largest": high_h[i],
                        "smallest": low_h[i],
                        "ranks_at_largest": count_h[i],
                    }
                )
        drifted = odd_by_vote or bool(tie and changed_names)
        how = (
            "majority" if odd_by_vote else "changed since its update" if drifted else "undecided" if tie else "majority"
        )
        return {
            "params": rows,
            "differing": len(differ),
            "checked": len(self.params),
            "world_size": world_size,
            "changed_since_update": changed_names[:MAX_NAMED] if changed is not None else None,
            "drifted": drifted,
            "how": how,
        }
