"""Debian's Chromium driven by Playwright, and the server as a subprocess: what
the chat page's tests (tests/test_chat_page*.py) and its benchmark
(bench/chat_page.py) share.

Chromium is Debian's (``apt-get install chromium``: /usr/bin/chromium), never a
browser Playwright downloads. The flags keep it off the network: without the
background-networking ones it tries Google's hosts at every start.
"""

from __future__ import annotations

import mlx_engine  # noqa: F401  (first: loads OpenBLAS before mlx.core)

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parent.parent


def launch(playwright):
    """A headless Debian Chromium under ``playwright`` (its sync API)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(*args: str, timeout: float = 300.0) -> Iterator[str]:
    """``python -m mlx_engine.server ARGS`` on a free port of 127.0.0.1, until it
    answers ``/health``; yields its base URL and stops it (SIGTERM) after."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="mlx-engine-server-", suffix=".log", delete=False)
    env = {**os.environ, "MLX_ENGINE_API_KEY": ""}
    cmd = [sys.executable, "-m", "mlx_engine.server", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, timeout, log.name)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        os.unlink(log.name)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {Path(log_path).read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health in {timeout:.0f} s: {Path(log_path).read_text()[-2000:]}")
