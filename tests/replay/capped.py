"""Test worker: runs a script as `python SCRIPT ARGS...` would, or the forensics CLI (`--cli ARGS...`), under a cap
on its address space (RLIMIT_AS: a "device" of a few GB, so that an allocation far beyond it fails at once).

Run as a process forked from tests/fork_server.py (torch and transformers imported once for the test session); the
cap is set in that process before the script runs, as `preexec_fn` sets it for a fresh interpreter.
Usage: capped.py BYTES SCRIPT.py [args...]  |  capped.py BYTES --cli [forensics args...]
"""

from __future__ import annotations

import os
import resource
import runpy
import sys


def main() -> None:
    cap, what, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if what == "--cli":
        from forensics.cli import main as cli

        sys.argv = ["forensics", *args]
        cli()
        return
    script = os.path.abspath(what)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
