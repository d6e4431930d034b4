"""Starts test scripts and torchrun-style jobs as processes forked from a server that imported torch once.

Why: on the 2-core machine a test process spends most of its time importing torch and transformers (about 8 s of
CPU each; a two-rank job's training takes 2). The server (this file run as a script) imports them once per test
session, then forks a fresh child per script, or one child per rank for a multi-process job. Each child is still a
process of its own (its own globals, frameworks, process group, signal handlers and exit handlers), so what the
tests prove about separate processes holds; only the imports are shared.

A job of N ranks gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on a
TCPStore the server hosts, as torchrun's agent does: no port to choose and lose to another job) and torchrun's
failure handling: when a rank exits with an error, the others get SIGTERM, and SIGKILL 30 s later. Jobs whose test
is about torchrun itself (its rendezvous across nodes, its SIGTERM to a rank writing a dump) still run torchrun.

Protocol (one JSON object per line): the client writes a request {script, args, cwd, env, nproc, out, err}; the
server answers {"pids": [...]} once the processes started and {"code": EXIT_CODE} when all ended.
Usage: python fork_server.py MODULE...   (the modules to import first; the client: ForkServer)
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STOP_GRACE = 30  # seconds between SIGTERM and SIGKILL to the ranks left when one failed (torchrun's default)


# -- the server ------------------------------------------------------------------------------------------------------


def _child(request: dict, environ: dict) -> None:
    """In a forked child: becomes the script's process (cwd, environment, output files, argv, a fresh __main__) and
    runs it as `python script.py` would: an uncaught exception reaches sys.excepthook, exit handlers run."""
    import builtins
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    script = os.path.abspath(request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` sets it
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=script, __builtins__=builtins, __cached__=None, __loader__=None, __spec__=None, __package__=None
    )
    sys.modules["__main__"] = main
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    # an exception or SystemExit ends this process as it would end `python script.py`
    exec(code, main.__dict__)  # noqa: S102 - running the test's script is the point
    raise SystemExit(0)


def _start_store(world_size: int) -> tuple[int, int]:
    """A child hosting the job's TCPStore (as torchrun's agent does); returns (its pid, the store's port)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            from datetime import timedelta

            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=1800), wait_for_workers=False)
            os.write(write, f"{store.port}\n".encode())
            while True:
                time.sleep(3600)
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as answer:
        port = answer.readline().strip()
    if not port:
        raise RuntimeError("the TCPStore child did not start")
    return pid, int(port)


def _wait(pids: list[int]) -> int:
    """Waits for every pid; when one fails, the others get SIGTERM, then SIGKILL after STOP_GRACE (torchrun's way).
    Returns 0, or the first failure's exit code (1 for a signal)."""
    codes: dict[int, int] = {}
    stopping = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and stopping is None:
                    stopping = time.monotonic()
                    for other in pids:
                        if other not in codes:
                            _signal(other, signal.SIGTERM)
        if stopping is not None and time.monotonic() - stopping > STOP_GRACE:
            for other in pids:
                if other not in codes:
                    _signal(other, signal.SIGKILL)
        time.sleep(0.02)
    failed = [codes[pid] for pid in pids if codes[pid] != 0]
    return 0 if not failed else (failed[0] if failed[0] > 0 else 1)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _serve(request: dict) -> int:
    nproc = request["nproc"]
    if nproc == 1 and not request.get("distributed"):
        pid = os.fork()
        if pid == 0:
            _child(request, request["env"])
        print(json.dumps({"pids": [pid]}), flush=True)
        return _wait([pid])
    store, port = _start_store(nproc)
    pids = []
    for rank in range(nproc):
        environ = {
            **request["env"],
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "forensics-tests",
        }
        pid = os.fork()
        if pid == 0:
            _child(request, environ)
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    try:
        return _wait(pids)
    finally:
        _signal(store, signal.SIGKILL)
        os.waitpid(store, 0)


def _import(modules: list[str]) -> None:
    for module in modules:
        name, _, attribute = module.partition(":")
        loaded = importlib.import_module(name)
        if attribute:
            getattr(loaded, attribute)  # a lazy module's attribute: loads that code too


def serve(modules: list[str]) -> None:
    _import(modules)
    for line in sys.stdin:
        request = json.loads(line)
        try:  # a framework some jobs use (DeepSpeed, torchtitan): imported once, at its first job
            _import(request.get("preload", []))
        except Exception:  # noqa: BLE001 - not installed or broken: the job's own import fails and says why
            pass
        code = _serve(request)
        print(json.dumps({"code": code}), flush=True)


# -- the client ------------------------------------------------------------------------------------------------------


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


class Timeout(Exception):
    """The job did not end in time; it was killed. Carries its output so far."""

    def __init__(self, stdout: str, stderr: str):
        super().__init__("timed out")
        self.stdout, self.stderr = stdout, stderr


class ForkServer:
    """The server in a process of its own: run(...) starts a script (or N ranks of it) forked from it."""

    def __init__(self, modules: list[str], env: dict):
        self.process = subprocess.Popen(
            [sys.executable, __file__, *modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.lock = threading.Lock()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _answer(self, timeout: float) -> dict | None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if not line:
            raise RuntimeError(f"the fork server died: {self.process.stderr.read()[-3000:]}")
        return json.loads(line)

    def run(
        self,
        script: str,
        args: list[str],
        *,
        cwd: str,
        env: dict,
        out_dir: Path,
        nproc: int = 1,
        distributed: bool = False,
        timeout: float = 120,
        preload: list[str] = (),
    ) -> Completed:
        """Runs `script ARGS` in `cwd` with `env` (nproc ranks with torchrun's environment when nproc > 1 or
        `distributed`); its output goes to out_dir/stdout.txt and stderr.txt. Raises Timeout after `timeout` s.
        `preload`: modules the server imports first (once; it keeps them for later jobs), as `module[:attribute]`."""
        out_dir.mkdir(parents=True, exist_ok=True)
        out, err = out_dir / "stdout.txt", out_dir / "stderr.txt"
        for path in (out, err):
            path.write_text("")
        request = {
            "script": str(script),
            "args": [str(a) for a in args],
            "cwd": str(cwd),
            "env": env,
            "nproc": nproc,
            "distributed": distributed,
            "out": str(out),
            "err": str(err),
            "preload": list(preload),
        }
        with self.lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            started = self._answer(timeout)
            done = self._answer(timeout) if started else None
            if done is None:
                for pid in (started or {}).get("pids", []):
                    _signal(pid, signal.SIGKILL)
                if started:
                    self._answer(STOP_GRACE + 60)
            read = (out.read_text(errors="replace"), err.read_text(errors="replace"))
            if done is None:
                raise Timeout(*read)
            return Completed(done["code"], *read)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.reader.join(timeout=10)  # it ends at the server's end of output
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None and not pipe.closed and not (pipe is self.process.stdout and self.reader.is_alive()):
                pipe.close()


PRELOAD = ["torch", "transformers:GPT2LMHeadModel", "forensics.capture", "forensics", "_common", "accelerate"]
"""What the shared server imports first: what nearly every test script and example imports (and `_common`, the
examples' helpers, and Accelerate, for the Accelerate jobs and the Trainer's). DeepSpeed (about 12 s of CPU: it
imports MLflow, and its ZeRO optimizer check inductor) and torchtitan (12 s: datasets, inductor) come with the first
job that names them in `preload`. Each import leaves the server with its main thread alone (checked 2026-11-27): a
process should not fork with threads running."""

_shared: list[ForkServer] = []


def shared(repo: Path) -> ForkServer:
    """This test process's server, started on first use (closed at exit)."""
    if not _shared:
        import importlib.util

        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join(
                [str(repo), str(repo / "scripts" / "examples"), os.environ.get("PYTHONPATH", "")]
            ).rstrip(os.pathsep),
        }
        modules = [m for m in PRELOAD if m == "_common" or importlib.util.find_spec(m.partition(":")[0])]
        _shared.append(ForkServer(modules, env))
        atexit.register(_shared[0].close)
    return _shared[0]


if __name__ == "__main__":
    serve(sys.argv[1:])
