"""Test worker: runs an example, but the rank named by $FORENSICS_TEST_DIE_RANK dies halfway through writing its dump.

It calls os._exit(1) after model.safetensors is written and before the optimizer state is: the
rank's temporary dump directory is left half-filled, as after an OOM kill or a node failure.
The rank named by $FORENSICS_TEST_SLOW_RANK holds its first tensor file until torchrun's SIGTERM, sent when
torchrun sees the dead rank, has reached it (at most SIGTERM_WAIT seconds), so the SIGTERM always arrives in the
middle of its write. (A fixed 1 s per file lost that race on a busy machine: torchrun's monitor saw the dead rank
after the slow rank had finished.)
Usage (under torchrun): die_in_write.py EXAMPLE.py [example args...]
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

SIGTERM_WAIT = 120  # seconds the slow rank waits in its write for torchrun's SIGTERM


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

        original_slow, terminated = writer.write_safetensors, []

        def write_slowly(out, tensors, *rest, **kwargs):
            held = signal.getsignal(signal.SIGTERM)  # the Guard's: it holds SIGTERM back while the dump is written
            if callable(held) and not terminated:

                def note(signum, frame):
                    terminated.append(signum)
                    held(signum, frame)

                signal.signal(signal.SIGTERM, note)
                deadline = time.monotonic() + SIGTERM_WAIT
                while not terminated and time.monotonic() < deadline:
                    time.sleep(0.05)
            return original_slow(out, tensors, *rest, **kwargs)

        writer.write_safetensors = write_slowly
    sys.argv = [example, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(example)))
    runpy.run_path(example, run_name="__main__")


if __name__ == "__main__":
    main()
