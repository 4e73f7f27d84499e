"""Real processes for the gateway tests: redis-server, and the app under uvicorn (a thread or a
`loraplex serve` subprocess), each on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from loraplex.bench.http_client import RedisServer  # noqa: F401 (the tests' Redis, shared with the benchmarks)

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


class ThreadServer:
    """A FastAPI app served by uvicorn in a thread of the test process (sharing its loaded engine)."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), timeout=120, what="uvicorn")
        if not self.server.started:
            raise RuntimeError("the app did not start (see the log above)")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class ServeProcess:
    """`python -m loraplex.cli serve` with LORAPLEX_* settings; stdout is kept for the admin key."""

    def __init__(self, env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        full_env = {**inherited, **env, "LORAPLEX_PORT": str(self.port), "PYTHONUNBUFFERED": "1"}
        self._out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", "--log-level", "warning"],
                                     cwd=REPO, env=full_env, stdout=self._out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 240.0) -> ServeProcess:
        """Wait for /health; a server that exits or is not up within `timeout` s is stopped (never left
        running after the test) and its log is in the error (a kernel build on a slow CPU, say)."""
        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"loraplex serve exited:\n{self.log.read_text()}")
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(up, timeout=timeout, interval=0.25, what="loraplex serve")
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}; its log:\n{self.log.read_text()[-3000:]}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
