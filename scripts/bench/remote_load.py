"""Replay from object storage: a whole `run_replay` of a dump at an s3:// URL (each file fetched once into a
verified local copy, forensics/format/spool.py) against downloading the dump first and replaying the download, and
against replaying it from local disk, in the same run; and the same three for `load_session` alone.

    python -m scripts.bench.remote_load --dir /tmp/bench --hidden 384 --layers 4

Writes the Llama-shaped dump of scripts/bench/replay_load.py on disk, starts moto's S3 server on this machine (an
in-memory store: it bounds the throughput, so the ratios say more than the GB/s), uploads the dump, then in fresh
processes: from disk, from the URL, and `s3fs get` of the whole dump followed by the same from the download (what a
user without URL support does). Each reports its wall time and its own peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.replay_load import LOAD, PEAK, REPLAY, write

DOWNLOAD = (
    PEAK
    + """
import json, shutil, subprocess, sys, tempfile, time
import s3fs
target = tempfile.mkdtemp()
start = time.perf_counter()
s3fs.S3FileSystem().get(sys.argv[1], target + "/dump", recursive=True)
seconds = time.perf_counter() - start
then = subprocess.run([sys.executable, "-c", sys.argv[2], target + "/dump", "cpu"], capture_output=True, text=True,
                      check=True)
shutil.rmtree(target)
print(json.dumps({"seconds": seconds, "peak_rss_gb": peak_rss_gb(), "then": json.loads(then.stdout.splitlines()[-1])}))
"""
)


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


def _child(script: str, *args: str, env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/forensics_bench_remote")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--what", default="load,replay", help="load, replay or both (comma-separated)")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)  # a fresh dump each run
    dump = write(Path(args.dir), args.hidden, args.layers)
    gb = sum(p.stat().st_size for p in dump.iterdir()) / 2**30
    server, env = _server()
    try:
        os.environ.update(env)
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        start = time.perf_counter()
        fs.put(str(dump), "bench/dump", recursive=True)
        upload_s = time.perf_counter() - start
        url = "s3://bench/dump"
        rows = {}
        for what, script in (("load", LOAD), ("replay", REPLAY)):
            if what not in args.what.split(","):
                continue
            local = _child(script, str(dump), "cpu", env={})
            remote = _child(script, url, "cpu", env=env)
            download = _child(DOWNLOAD, url, script, env=env)
            then = download["then"]
            rows[what] = {
                "local_s": round(local["seconds"], 2),
                "url_s": round(remote["seconds"], 2),
                "download_s": round(download["seconds"], 2),
                "download_then_s": round(download["seconds"] + then["seconds"], 2),
                "url_vs_download_then": round(remote["seconds"] / (download["seconds"] + then["seconds"]), 3),
                "peak_rss_gb_local_url_download_then": [
                    round(local["peak_rss_gb"], 2),
                    round(remote["peak_rss_gb"], 2),
                    round(then["peak_rss_gb"], 2),
                ],
                **({"verdicts": [local["verdict"], remote["verdict"], then["verdict"]]} if "verdict" in local else {}),
            }
    finally:
        server.terminate()
    print(json.dumps({"dump_gb": round(gb, 3), "upload_gb_s": round(gb / upload_s, 3), **rows}))


if __name__ == "__main__":
    main()
