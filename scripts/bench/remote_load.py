"""Replay loading from object storage: `load_session` on a dump at an s3:// URL (ranged reads, verified as they
stream) against downloading the same dump whole first and against loading it from local disk, in the same run.

    python -m scripts.bench.remote_load --dir /tmp/bench --hidden 768 --layers 8

Writes the Llama-shaped dump of scripts/bench/replay_load.py on disk, starts moto's S3 server on this machine (an
in-memory store: it bounds the throughput, so the ratios say more than the GB/s), uploads the dump, then in fresh
processes: the replay load from disk, the replay load from the URL, and `s3fs get` of the whole dump (what a user
without URL support does first). Each reports its wall time and its own peak RSS (VmHWM).
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

from scripts.bench.replay_load import LOAD, PEAK, write

DOWNLOAD = (
    PEAK
    + """
import json, sys, tempfile, time
import s3fs
start = time.perf_counter()
s3fs.S3FileSystem().get(sys.argv[1], tempfile.mkdtemp() + "/", recursive=True)
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_gb": peak_rss_gb()}))
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
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
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
        local = _child(LOAD, str(dump), "cpu", env={})
        remote = _child(LOAD, url, "cpu", env=env)
        download = _child(DOWNLOAD, url, env=env)
    finally:
        server.terminate()
    print(
        json.dumps(
            {
                "dump_gb": round(gb, 3),
                "upload_gb_s": round(gb / upload_s, 3),
                "download_s": round(download["seconds"], 2),
                "download_peak_rss_gb": round(download["peak_rss_gb"], 2),
                "local_load_s": round(local["seconds"], 2),
                "local_load_peak_rss_gb": round(local["peak_rss_gb"], 2),
                "remote_load_s": round(remote["seconds"], 2),
                "remote_load_peak_rss_gb": round(remote["peak_rss_gb"], 2),
                "remote_load_vs_download": round(remote["seconds"] / download["seconds"], 3),
                "remote_rss_vs_dump": round(remote["peak_rss_gb"] / gb, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
