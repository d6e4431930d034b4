"""Test worker: runs an example, but the rank named by $FORENSICS_TEST_DIE_RANK dies halfway through writing its dump.

It calls os._exit(1) after model.safetensors is written and before the optimizer state is: the
rank's temporary dump directory is left half-filled, as after an OOM kill or a node failure.
The rank named by $FORENSICS_TEST_SLOW_RANK writes slowly (1 s per tensor file), so torchrun's
SIGTERM, sent when it sees the dead rank, reaches it in the middle of its own write.
Usage (under torchrun): die_in_write.py EXAMPLE.py [example args...]
"""

from __future__ import annotations

import os
import runpy
import sys
import time


def main() -> None:
    example, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("RANK") == os.environ.get("FORENSICS_TEST_DIE_RANK"):
        from forensics.format import writer

        original, calls = writer.write_safetensors, []

        def write_then_die(out, tensors, *rest, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # model.safetensors is on disk; die before optimizer.safetensors
                sys.stdout.flush()
                os._exit(1)
            return original(out, tensors, *rest, **kwargs)

        writer.write_safetensors = write_then_die
    if os.environ.get("RANK") == os.environ.get("FORENSICS_TEST_SLOW_RANK"):
        from forensics.format import writer

        original_slow = writer.write_safetensors

        def write_slowly(out, tensors, *rest, **kwargs):
            time.sleep(1.0)
            return original_slow(out, tensors, *rest, **kwargs)

        writer.write_safetensors = write_slowly
    sys.argv = [example, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(example)))
    runpy.run_path(example, run_name="__main__")


if __name__ == "__main__":
    main()
