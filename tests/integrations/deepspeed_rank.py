"""Test worker: runs a script as `python SCRIPT ARGS...` would, with DeepSpeed's CPU shared-memory collective off.

DeepSpeed JIT-compiles that op (`deepspeed_shm_comm`: C++ against torch's headers, about 90 s of CPU on the 2-core
machine, in every fresh environment) when its TorchBackend starts, for one collective, `inference_all_reduce`, which
only inference under AutoTP calls. ZeRO's training reduces and gathers through torch.distributed (gloo here, NCCL on
GPUs, where DeepSpeed's CUDA accelerator has no such op and never builds it). So the ranks train exactly as with it;
off, DeepSpeed takes the path it takes where the op is not available (its table of compatible ops says so, as it does
off Linux): `shm_comm_op` is None.
Usage: deepspeed_rank.py SCRIPT.py [args...]   (under the fork server or torchrun, like the script itself)
"""

from __future__ import annotations

import os
import runpy
import sys


def without_shm_op() -> None:
    """Marks DeepSpeed's CPU shared-memory op unavailable in this process (before DeepSpeed's comm starts)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> None:
    script, args = os.path.abspath(sys.argv[1]), sys.argv[2:]
    without_shm_op()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
