"""Overload of a real `loraplex serve`: what clients get at 2x and 4x the rate it sustains.

Phases, each --duration seconds, the server idle before each:
    capacity   closed loop, as many clients as the engine's batch (LORAPLEX_MAX_NUM_SEQS): the rate the
               server sustains, R = 200s per second
    open 2x    Poisson arrivals at 2 R (the offered load does not fall when the server slows down)
    open 4x    Poisson arrivals at 4 R
    closed 2x  2 x max_num_seqs clients that honour retry-after (capped at 1 s)
    closed 4x  4 x max_num_seqs clients
Requests are chat completions, greedy, `ignore_eos`, max_tokens uniform in --max-tokens (8-300: the
load under which 500s were seen before the waiting queue was bounded), spread over --tenants tenants
with no quotas (so what sheds is the engine's queue, not a tenant's limit). The server runs with its
default settings but --threads torch threads and whatever `--env NAME=VALUE` adds.

For each phase: answers by status, sustained requests/s and output tokens/s (200s over the phase),
the share shed (503 `server_overloaded`), p50 / p99 latency of the admitted requests (send to answer),
the slowest refusal, and "undesigned": answers that are neither 200 nor a designed 429/503 with
retry-after (5xx, transport errors). Run it alone on the machine.

    python bench/overload.py --quick               # 10 s phases, smoke test
    python bench/overload.py                       # 60 s phases, about 7 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shlex
import sys
import time

import httpx

from loraplex.bench.http_client import LOCAL, serve_subprocess
from loraplex.bench.overload import LoadSpec, OverloadSummary, closed_loop, open_loop, summarize
from loraplex.bench.report import commit, cpu_flags


def _tenants(url: str, admin_key: str, n: int) -> tuple[dict[str, str], str]:
    """n tenants without quotas: (name -> key, the base model id)."""
    unlimited = dict.fromkeys(("rpm", "tpm", "max_concurrent_requests", "token_budget"))
    keys = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, **LOCAL) as admin:
        for i in range(n):
            tenant = admin.post("/admin/tenants", json={"name": f"load-{i}", "quota": unlimited}).raise_for_status()
            key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={"name": "bench"}).raise_for_status()
            keys[f"load-{i}"] = key.json()["key"]
        engine = admin.get("/admin/engine").raise_for_status().json()
    return keys, engine["model"]


def _wait_idle(url: str, admin_key: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, **LOCAL) as admin:
        while time.monotonic() < deadline:
            e = admin.get("/admin/engine").raise_for_status().json()
            if e["num_running"] == 0 and e["num_waiting"] == 0:
                return
            time.sleep(0.5)
    raise RuntimeError("the server did not become idle")


def _report(name: str, offered: str, s: OverloadSummary, rows: list[str]) -> None:
    rows.append(_row(name, offered, s))
    print(rows[-1], file=sys.stderr)
    for line in s.undesigned:
        print(f"  undesigned: {line}", file=sys.stderr)


def _row(name: str, offered: str, s: OverloadSummary) -> str:
    st = s.statuses
    other = s.num_requests - st.get(200, 0) - st.get(429, 0) - st.get(503, 0)

    def f(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"

    return (f"| {name} | {offered} | {s.num_requests} | {st.get(200, 0)} | {st.get(429, 0)} | {st.get(503, 0)} | "
            f"{other} | {s.sustained_rps:.2f} | {s.output_tokens_per_s:.0f} | {100 * s.share_shed:.0f}% | "
            f"{f(s.p50_latency_s)} / {f(s.p99_latency_s)} | {f(s.max_refusal_latency_s, 2)} | {s.num_undesigned} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 300), metavar=("LO", "HI"))
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server (OMP_NUM_THREADS)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="LORAPLEX_MAX_NUM_SEQS of the server")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="more server settings")
    ap.add_argument("--quick", action="store_true", help="10 s phases")
    args = ap.parse_args(argv)
    duration = 10.0 if args.quick else args.duration
    env = {"OMP_NUM_THREADS": str(args.threads), "LORAPLEX_MAX_NUM_SEQS": str(args.max_num_seqs)}
    env |= dict(e.split("=", 1) for e in args.env)
    rows = []
    with serve_subprocess(env) as server:
        keys, model = _tenants(server.url, server.admin_key, args.tenants)
        spec = LoadSpec(model=model, max_tokens=tuple(args.max_tokens))
        asyncio.run(closed_loop(server.url, keys, LoadSpec(model=model, max_tokens=(2, 2)), num_clients=1,
                                duration_s=0.1))  # warm-up
        capacity = summarize(asyncio.run(closed_loop(server.url, keys, spec, num_clients=args.max_num_seqs,
                                                     duration_s=duration)), duration)
        _report("capacity (closed)", f"{args.max_num_seqs} clients", capacity, rows)
        rate = capacity.sustained_rps
        print(f"capacity: {rate:.2f} req/s", file=sys.stderr)
        for factor in (2, 4):
            _wait_idle(server.url, server.admin_key)
            s = summarize(asyncio.run(open_loop(server.url, keys, spec, rate=factor * rate, duration_s=duration)),
                          duration)
            _report(f"open {factor}x", f"{factor * rate:.2f} req/s", s, rows)
        for factor in (2, 4):
            _wait_idle(server.url, server.admin_key)
            s = summarize(asyncio.run(closed_loop(server.url, keys, spec, num_clients=factor * args.max_num_seqs,
                                                  duration_s=duration)), duration)
            _report(f"closed {factor}x", f"{factor * args.max_num_seqs} clients", s, rows)
    print(f"`python bench/overload.py {shlex.join(argv if argv is not None else sys.argv[1:])}` at {commit()}; "
          f"CPU flags: {cpu_flags()}; {platform.processor() or platform.machine()}; server torch threads "
          f"{args.threads}, max_num_seqs {args.max_num_seqs}, phases of {duration:g} s, max_tokens "
          f"{args.max_tokens[0]}-{args.max_tokens[1]}, {args.tenants} tenants without quotas.\n")
    print("| phase | offered | answers | 200 | 429 | 503 | other | sustained req/s | output tok/s | shed | "
          "p50 / p99 latency of 200s (s) | slowest refusal (s) | undesigned |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
