"""Headless Chromium for the run-page tests: the DOM after the page's script ran, and every console message."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install -y chromium (Debian/Ubuntu), then re-run"


def browser() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def render(page: Path, timeout: float = 60.0) -> tuple[str, list[str], float]:
    """(the DOM after the page's script ran, the console's messages, seconds it took)."""
    exe = browser()
    assert exe is not None, INSTALL
    start = time.perf_counter()
    done = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    took = time.perf_counter() - start
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console, took
