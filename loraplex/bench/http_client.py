"""The HTTP system of the serving benchmark: a real `loraplex serve` process, driven over HTTP with streaming
(what a tenant sees: HTTP, auth, quotas, SSE on top of the engine).

`run_http` starts the server (`serve_subprocess`: a fresh LORAPLEX_HOME whose `models/` links to the
normal model cache, so nothing is downloaded or converted again), makes one unlimited tenant per
workload tenant with a key, uploads every adapter to the tenants whose requests use it, warms each
model up once (every adapter read and loaded), then gives the server the warm-up the in-process engine
gets (`Workload.warm_up`: the first 32 requests at once, 8 tokens each, prompts reversed), so that a
fresh server's first timed steps do not pay for first-touch allocations; then it replays the workload: each request is an asyncio task that sleeps until its arrival and streams `/v1/completions`
with the prompt's token ids, greedy, `ignore_eos` (each row makes exactly `output_len` tokens).

The client is aiohttp with `json.loads` on each SSE event, as vLLM's serving benchmark
(`vllm bench serve`, its `async_request_openai_completions`) and SGLang's read their servers: the
client shares the server's cores here, and what it spends is taken from the engine's threads. Over the
small preset's replay on a 2-core machine it took 0.22-0.26 CPU seconds against 0.67-0.78 s for the
`openai` SDK on its aiohttp transport (four runs each, 2026-12-06); the SDK's own parsing of our streams
is what tests/platform check.

Times are `time.perf_counter()` seconds from the start of the replay. first_token_s is the first chunk
with text (a token that decodes to no text, e.g. a special token, sends no chunk; a stream with no text
at all counts its finish chunk), finish_s the end of the stream (after the usage chunk), and
num_output_tokens the usage chunk's completion_tokens. The stream carries text, not token ids, so
records get `text` and leave `token_ids` empty.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from loraplex import isa
from loraplex.bench.metrics import RequestRecord, RunStats
from loraplex.bench.workload import BenchRequest, Workload

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT = httpx.Timeout(3600.0, connect=60.0)  # a request may queue for long under overload
LOCAL = dict(timeout=REQUEST_TIMEOUT, trust_env=False)  # 127.0.0.1: never through an HTTP(S)_PROXY
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Every bench server queues what it is sent, as the in-process engine does, so the systems compared serve
# the same requests: the server's default sheds past 10 s of estimated queue wait, which a slow CPU reaches
# at the presets' rates (what a bench compares is capacity, not the shedding policy). A caller that also
# sends more requests at once than the default waiting-queue bound raises LORAPLEX_MAX_NUM_WAITING_SEQS.
BENCH_SERVER_ENV = {"LORAPLEX_MAX_QUEUE_WAIT_S": "3600"}
UNLIMITED = dict.fromkeys(
    ("rpm", "tpm", "max_concurrent_requests", "token_budget", "max_adapters", "max_adapter_bytes")
)


def run_http(
    workload: Workload,
    adapter_dirs: dict[str, Path],
    *,
    engine_env: dict[str, str] | None = None,
    port: int | None = None,
    log_path: Path | None = None,
) -> tuple[list[RequestRecord], RunStats]:
    """Replay `workload` through a `loraplex serve` subprocess; records in workload order.

    adapter_dirs: adapter name -> PEFT directory, for every adapter the workload uses. engine_env,
    port, log_path: as `serve_subprocess`. A failed request becomes a record with `error`; a server
    that does not start, or a failed tenant, upload or warm-up, raises.
    """
    missing = sorted(set(workload.adapters) - set(adapter_dirs))
    if missing:
        raise ValueError(f"no directory in adapter_dirs for the workload's adapters {missing}")
    with serve_subprocess(engine_env, port=port, log_path=log_path) as server:
        with httpx.Client(base_url=server.url, headers=_auth(server.admin_key), **LOCAL) as admin:
            keys = _set_up_tenants(admin, workload, adapter_dirs)
            base_model = admin.get("/admin/engine").raise_for_status().json()["model"]
        return asyncio.run(_bench(server.url, server.admin_key, keys, base_model, workload, server.proc.pid))


@dataclass
class Server:
    url: str
    admin_key: str
    home: Path
    proc: subprocess.Popen


def server_environ(engine_env: dict[str, str] | None, *, home: Path, port: int, admin_key: str) -> dict[str, str]:
    """The environment of a bench server: this process's, less its LORAPLEX_* variables but for
    LORAPLEX_CPU_ISA (the bench's code paths, `loraplex.isa`), then `BENCH_SERVER_ENV`, then `engine_env`
    (which wins over both), then the server's home, address and admin key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_") or k == isa.ENV}
    return env | BENCH_SERVER_ENV | (engine_env or {}) | {
        "LORAPLEX_HOME": str(home),
        "LORAPLEX_HOST": "127.0.0.1",
        "LORAPLEX_PORT": str(port),
        "LORAPLEX_ADMIN_KEY": admin_key,
        "PYTHONUNBUFFERED": "1",
    }


@contextmanager
def serve_subprocess(engine_env: dict[str, str] | None = None, *, port: int | None = None,
                     log_path: Path | None = None) -> Iterator[Server]:
    """A `loraplex serve` subprocess on 127.0.0.1 with a fresh LORAPLEX_HOME whose `models/` links to the
    normal model cache (nothing is downloaded or converted again) and a new admin key; stopped (SIGTERM,
    then SIGKILL after 30 s) and its home deleted on exit.

    engine_env: LORAPLEX_* settings (LORAPLEX_MAX_LORAS, LORAPLEX_DTYPE, ...) and others such as
    OMP_NUM_THREADS, over `BENCH_SERVER_ENV`; the caller's own LORAPLEX_* variables are not passed on
    (no shared database or Redis) but for LORAPLEX_CPU_ISA. port: default a free one. log_path: the server's stdout and stderr (default a file in the
    home, deleted). Raises RuntimeError with the log's tail if the server does not start.
    """
    from loraplex.engine.loader import loraplex_home
    from loraplex.platform.security import new_key

    admin_key, port = new_key(), port or free_port()
    url = f"http://127.0.0.1:{port}"
    home = Path(tempfile.mkdtemp(prefix="loraplex-bench-http-"))
    try:
        models = loraplex_home() / "models"
        models.mkdir(parents=True, exist_ok=True)  # a model missing from the cache is converted there, once
        (home / "models").symlink_to(models, target_is_directory=True)
        env = server_environ(engine_env, home=home, port=port, admin_key=admin_key)
        log_path = Path(log_path) if log_path is not None else home / "serve.log"
        with open(log_path, "w") as log:
            cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--log-level", "warning"]
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_ready(proc, url, log_path)
                yield Server(url, admin_key, home, proc)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    finally:
        shutil.rmtree(home, ignore_errors=True)  # unlinks the models/ link, never follows it


class RedisServer:
    """`redis-server` without persistence; `kill()` and `start()` again on the same port."""

    def __init__(self, port: int | None = None):
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server (scripts/install test)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--databases", "256"],  # the tests give each app a database of its own
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30.0
        while not self._is_up():
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer on port {self.port} in 30 s")
            time.sleep(0.05)
        return self

    def _is_up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _tail(path: Path, num_chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loraplex serve exited with {proc.returncode}; log tail:\n{_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(
        f"loraplex serve did not answer /health in {START_TIMEOUT_S:g} s; log tail:\n{_tail(log_path)}"
    )


def _check(r: httpx.Response, what: str) -> dict:
    if r.status_code >= 400:
        raise RuntimeError(f"{what} failed with HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def _set_up_tenants(admin: httpx.Client, workload: Workload, adapter_dirs: dict[str, Path]) -> dict[str, str]:
    """One unlimited tenant and key per workload tenant; each adapter uploaded to the tenants using it.
    Returns tenant name -> key."""
    uses = {(r.tenant, r.adapter) for r in workload.requests}
    return make_tenants(admin, {t: sorted(a for u, a in uses if u == t and a is not None) for t, _ in uses},
                        adapter_dirs)


def make_tenants(admin: httpx.Client, adapters: dict[str, list[str]], adapter_dirs: dict[str, Path]
                 ) -> dict[str, str]:
    """One unlimited tenant and key per name of `adapters`, in name order, each given its adapters (uploaded
    from `adapter_dirs`) through the admin client `admin`. Returns tenant name -> key; raises on a failure."""
    keys = {}
    for name in sorted(adapters):
        tenant = _check(
            admin.post("/admin/tenants", json={"name": name, "quota": UNLIMITED}), f"tenant {name}"
        )
        key = _check(
            admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "bench"}), f"key of {name}"
        )
        keys[name] = key["key"]
    for name in sorted(adapters):
        for adapter in adapters[name]:
            directory = Path(adapter_dirs[adapter])
            files = [("file", (n, (directory / n).read_bytes())) for n in ADAPTER_FILES]
            r = admin.post("/v1/adapters", data={"name": adapter}, files=files, headers=_auth(keys[name]))
            _check(r, f"upload of {adapter} for {name}")
    return keys


async def _bench(
    url: str, admin_key: str, keys: dict[str, str], base_model: str, workload: Workload, server_pid: int
) -> tuple[list[RequestRecord], RunStats]:
    import aiohttp

    sessions = {}
    for tenant, key in keys.items():
        n = sum(r.tenant == tenant for r in workload.requests) + 8  # every request in flight at once
        sessions[tenant] = aiohttp.ClientSession(
            base_url=url, headers=_auth(key), connector=aiohttp.TCPConnector(limit=n),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT.connect,
                                          sock_read=REQUEST_TIMEOUT.read),
            trust_env=False,
        )
    try:
        # Warm-up, untimed: every model of every tenant once (each adapter registered and loaded), then
        # the warm-up of the in-process engine (`Workload.warm_up`) on this fresh server.
        one_each = {(r.tenant, r.adapter): r for r in workload.requests}  # per tenant and model
        for warm in ([BenchRequest(0.0, r.tenant, r.adapter, r.prompt_token_ids[:4], 2) for r in one_each.values()],
                     workload.warm_up()):
            for rec in await asyncio.gather(
                *(_stream(sessions[r.tenant], base_model, r, time.perf_counter()) for r in warm)
            ):
                if not rec.ok:
                    raise RuntimeError(f"warm-up of {rec.adapter or base_model} failed: {rec.error}")
        async with httpx.AsyncClient(base_url=url, headers=_auth(admin_key), **LOCAL) as admin:
            before = (await admin.get("/admin/engine")).raise_for_status().json()
            cpu0, server_cpu0, start = time.process_time(), process_cpu_s(server_pid), time.perf_counter()
            records = await asyncio.gather(
                *(_stream(sessions[r.tenant], base_model, r, start) for r in workload.requests)
            )
            cpu1, server_cpu1 = time.process_time(), process_cpu_s(server_pid)
            after = (await admin.get("/admin/engine")).raise_for_status().json()
    finally:
        for session in sessions.values():
            await session.close()
    stats = _run_stats(before, after)
    stats.client_cpu_s = cpu1 - cpu0
    if server_cpu0 is not None and server_cpu1 is not None:
        stats.server_cpu_s = server_cpu1 - server_cpu0
    return list(records), stats


async def _stream(session, base_model: str, r: BenchRequest, start: float) -> RequestRecord:
    """Send `r` at start + arrival_s on the aiohttp `session` and read its stream; every failure (a
    status other than 200, an `error` event in the stream, a stream without finish_reason or usage, a
    usage chunk without completion_tokens, a broken connection) becomes the record's error."""
    rec = RequestRecord(r.arrival_s, None, None, r.prompt_len, 0, r.adapter)
    await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
    body = {"model": r.adapter or base_model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    pieces, finish_reason, usage = [], None, None
    try:
        async with session.post("/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return rec
            async for line in resp.content:  # SSE: one `data: <json>` line per event, then a blank one
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"error event: {chunk['error']}"
                    return rec
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") or ""
                    if rec.first_token_s is None and (text or choice.get("finish_reason")):
                        rec.first_token_s = time.perf_counter() - start
                    pieces.append(text)
                    finish_reason = choice.get("finish_reason") or finish_reason
                usage = chunk.get("usage") or usage
        rec.finish_s = time.perf_counter() - start
        if usage is None or finish_reason is None:
            rec.error = "the stream ended without a finish_reason and a usage chunk"
            return rec
        rec.num_output_tokens = int(usage["completion_tokens"])
    except Exception as exc:  # any failure is the request's, never the run's
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.text = "".join(pieces)
    return rec


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process `pid` has used so far, from /proc/<pid>/stat
    (proc(5): utime and stime, fields 14 and 15, in clock ticks); None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces; it ends at the last ')'
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_stats(before: dict, after: dict) -> RunStats:
    """Differences of the engine's counters over the timed run (GET /admin/engine)."""

    def delta(*path: str) -> int | None:
        a, b = after, before
        for key in path:
            a, b = a.get(key) if isinstance(a, dict) else None, b.get(key) if isinstance(b, dict) else None
        return None if a is None or b is None else a - b

    return RunStats(
        num_steps=delta("num_steps") or 0,
        num_batched_rows=delta("num_batched_rows") or 0,
        adapter_hits=delta("adapters", "tiers", "slots", "hits"),
        adapter_misses=delta("adapters", "tiers", "slots", "misses"),
        num_preemptions=delta("num_preemptions"),
    )
