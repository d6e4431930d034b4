"""Replay from object storage against downloading first: the whole `forensics replay` command (interpreter start,
imports, model build, replay, report) at an s3:// URL, against `s3fs get` of the whole dump followed by the same
command on the download, and the command on a dump already on disk; interleaved rounds in one run, medians.

    python -m scripts.bench.remote_load --dir /tmp/bench --hidden 384 --layers 4 --rounds 3

Writes the Llama-shaped dump of scripts/bench/replay_load.py on disk, starts moto's S3 server on this machine (an
in-memory store: it bounds the throughput, so the ratios say more than the GB/s; it copies the whole object for each
ranged GET, so many GETs of a large file cost more there than on a real store), uploads the dump, then per round, in
fresh processes and in alternating order, each against a fresh server: the URL replay; the download (`s3fs get`, recursive, as a user would) then
the local replay of it; the replay from disk. Each process reports its own peak RSS (VmHWM) and the GETs it sent
(count, and the bytes the store answered with: s3fs's get_object calls); wall times are the parent's clock around
each process, so they hold every second a user waits. The machine's load average is printed with each round (other
processes on the cores slow every arm alike: that is why the rounds interleave).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.replay_load import write

COUNTED = """
import atexit, json, os, sys
gets = {"count": 0, "bytes": 0}
if os.environ.get("BENCH_COUNT_GETS"):
    import s3fs.core
    original = s3fs.core.S3FileSystem._call_s3
    async def counting(self, method, *args, **kwargs):
        response = await original(self, method, *args, **kwargs)
        if method == "get_object":
            gets["count"] += 1
            gets["bytes"] += int(response.get("ContentLength") or 0)
        return response
    s3fs.core.S3FileSystem._call_s3 = counting
def done():
    peak = next(int(l.split()[1]) / 2**20 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    with open(os.environ["BENCH_RESULT"], "w") as out:
        json.dump({"peak_rss_gb": peak, "gets": gets["count"], "got_bytes": gets["bytes"]}, out)
atexit.register(done)
"""
"""Run first in each measured process: counts its GETs, writes its peak RSS and the counts at exit."""

REPLAY = COUNTED + "from forensics.cli import main\nmain(sys.argv[1:], prog_name='forensics')\n"
DOWNLOAD = COUNTED + "import s3fs\ns3fs.S3FileSystem().get(sys.argv[1], sys.argv[2], recursive=True)\n"


def _server() -> tuple[subprocess.Popen, dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(Path(tempfile.gettempdir()) / "forensics-bench-moto.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stderr=log)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), 0.3).close()
            return server, env
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto's server did not start")


def _timed(script: str, *args: str, env: dict, count: bool = False) -> dict:
    """Runs `script` in a fresh interpreter; its wall time on this clock, its peak RSS and GETs."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        extra = {"BENCH_RESULT": result.name, **({"BENCH_COUNT_GETS": "1"} if count else {})}
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, env={**os.environ, **env, **extra}
        )
        seconds = time.perf_counter() - start
        if done.returncode not in (0, 3, 4):  # replay: a culprit named, not reproduced (this dump's NaN), no culprit
            raise SystemExit(f"{args[:2]} exited {done.returncode}: {done.stderr[-3000:]}")
        return {"seconds": seconds, **json.loads(Path(result.name).read_text()), "exit": done.returncode}


def _replay(dump: str, out: Path, env: dict, count: bool) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    row = _timed(REPLAY, "replay", dump, "--device", "cpu", "--no-rng-check", "-o", str(out), env=env, count=count)
    row["verdict"] = json.loads((out / "report.json").read_text())["verdict"]["kind"]
    return row


def _round(serve, dump: Path, work: Path, url_first: bool) -> dict:
    """One round: each arm against a server of its own, started and loaded before its clock starts (moto's server
    grows with what it served: an arm after another ran measurably slower, whichever it was)."""

    def from_url() -> dict:
        with serve() as (url, env):
            return _replay(url, work / "report-url", env, count=True)

    def download_then() -> dict:
        target = work / "download"
        shutil.rmtree(target, ignore_errors=True)
        with serve() as (url, env):
            got = _timed(DOWNLOAD, url, str(target), env=env, count=True)
        then = _replay(str(target), work / "report-download", {}, count=False)
        return {"download": got, "then": then, "seconds": got["seconds"] + then["seconds"]}

    rows: dict = {"load_average": os.getloadavg()[0]}
    for name, arm in (("url", from_url), ("download_then", download_then))[:: 1 if url_first else -1]:
        rows[name] = arm()
    rows["disk"] = _replay(str(dump), work / "report-disk", {}, count=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/forensics_bench_remote")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)  # a fresh dump each run
    dump = write(Path(args.dir) / "dump", args.hidden, args.layers)
    sizes = {p.name: p.stat().st_size for p in dump.iterdir()}
    gb = sum(sizes.values()) / 2**30
    uploads: list[float] = []

    @contextlib.contextmanager
    def serve():
        """A fresh moto server holding the dump; its URL and environment."""
        server, env = _server()
        try:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            import s3fs

            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            fs.mkdir("bench")
            start = time.perf_counter()
            fs.put(str(dump), "bench/dump", recursive=True)
            uploads.append(time.perf_counter() - start)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
            yield "s3://bench/dump", env
        finally:
            server.terminate()
            server.wait(30)

    work = Path(args.dir) / "work"
    work.mkdir(parents=True, exist_ok=True)
    rounds = []
    for index in range(args.rounds):
        rounds.append(_round(serve, dump, work, url_first=index % 2 == 0))
        print(json.dumps({"round": index, **rounds[-1]}), file=sys.stderr)
    upload_s = statistics.median(uploads)

    def median(pick) -> float:
        return round(statistics.median(pick(r) for r in rounds), 2)

    ratios = [r["url"]["seconds"] / r["download_then"]["seconds"] for r in rounds]
    print(
        json.dumps(
            {
                "dump_gb": round(gb, 3),
                "files": len(sizes),
                "upload_gb_s": round(gb / upload_s, 3),
                "rounds": len(rounds),
                "load_average": [round(r["load_average"], 1) for r in rounds],
                "url_s": median(lambda r: r["url"]["seconds"]),
                "download_s": median(lambda r: r["download_then"]["download"]["seconds"]),
                "then_replay_s": median(lambda r: r["download_then"]["then"]["seconds"]),
                "download_then_s": median(lambda r: r["download_then"]["seconds"]),
                "disk_s": median(lambda r: r["disk"]["seconds"]),
                "url_vs_download_then": [round(x, 3) for x in ratios],
                "url_vs_download_then_median": round(statistics.median(ratios), 3),
                "peak_rss_gb_disk_url_download_then": [
                    median(lambda r: r["disk"]["peak_rss_gb"]),
                    median(lambda r: r["url"]["peak_rss_gb"]),
                    median(lambda r: r["download_then"]["then"]["peak_rss_gb"]),
                ],
                "download_peak_rss_gb": median(lambda r: r["download_then"]["download"]["peak_rss_gb"]),
                "url_gets_bytes": [(r["url"]["gets"], r["url"]["got_bytes"]) for r in rounds],
                "download_gets_bytes": [
                    (r["download_then"]["download"]["gets"], r["download_then"]["download"]["got_bytes"])
                    for r in rounds
                ],
                "dump_bytes": sum(sizes.values()),
                "verdicts": sorted(
                    {r[arm]["verdict"] for r in rounds for arm in ("url", "disk")}
                    | {r["download_then"]["then"]["verdict"] for r in rounds}
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
