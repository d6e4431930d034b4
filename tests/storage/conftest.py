"""A real S3 protocol server for the object-storage tests: moto's server mode in its own process, on a free port
of this machine, with s3fs as the client (the one a user's `pip install 'forensics[s3]'` brings).

The server and the credentials are set through the environment, as a user's job sets them (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...): the code under test is given nothing else, and the processes a test launches inherit them.
Each test gets a bucket of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest

START_TIMEOUT_S = 60


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]

    def bucket(self) -> str:
        """A new, empty bucket; returns its name."""
        import s3fs

        name = f"forensics-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
        return name

    def keys(self, prefix: str) -> list[str]:
        """Every object under `prefix` (bucket/key...), listed afresh."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        return sorted(fs.find(prefix))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1:<free port> for this test session (one per xdist worker)."""
    pytest.importorskip("s3fs", reason="pip install 'forensics[s3]' (s3fs) for the object-storage tests")
    pytest.importorskip("moto.server", reason="pip install 'moto[server]' for the object-storage tests")
    from forensics_test_helpers import free_port  # tests/helpers.py

    port = free_port()
    log = tmp_path_factory.mktemp("s3-server") / "moto.log"  # a file, never a pipe: a full pipe stalls the server
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"moto's S3 server did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "forensics-test",
        "AWS_SECRET_ACCESS_KEY": "forensics-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield S3Server(env["AWS_ENDPOINT_URL"], env)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture
def bucket(s3_server) -> str:
    return s3_server.bucket()
