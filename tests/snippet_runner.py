"""Runs scripts in fresh forked processes that start with torch, transformers and forensics already imported.

tests/test_docs.py runs every README / INTEGRATIONS snippet in a process of its own (frameworks keep global state);
an interpreter that imports torch and transformers first spends most of a snippet's time there. This server imports
them once, then forks a child per request: each snippet still gets its own process (its own globals, frameworks,
process group, exit handlers), without the imports.

Protocol (one JSON object per line): the test writes {"script": PATH, "cwd": DIR}; the server answers
{"pid": CHILD} when the child starts and {"code": EXIT_CODE} when it ends. The child writes its output to
DIR/stdout.txt and DIR/stderr.txt and exits as an interpreter does (exit handlers run, threads are joined).
Usage: python snippet_runner.py EXAMPLES_DIR
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

sys.path.insert(0, sys.argv[1])  # the prelude's `import _common`

import torch  # noqa: E402,F401  (imported for the children)
import transformers  # noqa: E402

import _common  # noqa: E402,F401
import capture  # noqa: E402,F401
import forensics  # noqa: E402,F401

transformers.GPT2LMHeadModel  # the lazy module: load the model's code too


def child(script: str, cwd: str) -> int:
    """Runs `script` as __main__ in `cwd`; returns its exit code."""
    os.chdir(cwd)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - the script's failure is its exit code and traceback, as in python
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = child(request["script"], request["cwd"])
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(code)  # a normal interpreter exit in the child: atexit handlers, thread joins
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
