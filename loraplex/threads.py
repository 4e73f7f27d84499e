"""How many CPU threads the engine's PyTorch ops use, and how they wait between parallel regions.

`usable_cpus()` counts the CPUs this process may run on: its affinity mask (`taskset`, a container's
cpuset), capped by its cgroup's CPU quota (v2 `cpu.max` or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`,
quota / period rounded down: 1.5 CPUs run one thread, not two that the quota throttles), so a container
limited to 2 CPUs on a 64-core host runs 2 threads, not 64 (PyTorch's default is the host's core
count). `OMP_NUM_THREADS` in the environment wins over both, as it does for PyTorch.

OpenMP's wait policy: by default libgomp's threads spin for a while at the end of every parallel
region before they sleep. Alone on its cores that saves a wake-up; next to another busy process (a
benchmark client, a second server) a spinning thread takes the core that the thread it waits for needs.
loraplex sets `OMP_WAIT_POLICY=PASSIVE` (threads sleep at once; the OpenMP standard's setting, which
libgomp honours) unless the environment already sets a policy or `GOMP_SPINCOUNT`. Measured on a 2-core
AVX-512 machine (8 requests of 100 prompt tokens, 16 output tokens each, fp32, 2 threads), seconds
alone / next to one busy process: libgomp's default spin 1.88 / 19-20 (10x), GOMP_SPINCOUNT=10000
2.04 / 4.56, PASSIVE 2.30 / 3.70, one thread 3.47 / 3.60. PASSIVE costs about a fifth alone and saves
5x when shared; `OMP_WAIT_POLICY=ACTIVE` in the environment takes the spin back for a machine of its own. libgomp reads it when it is loaded,
that is when torch is first imported, so `loraplex/__init__.py` and the CLI call `set_wait_policy()`
before importing torch; a program that imported torch first keeps its policy (`set_wait_policy` then
returns False).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

WAIT_POLICY = "PASSIVE"


policy_set_here = False  # True once set_wait_policy wrote OMP_WAIT_POLICY (peers' subprocesses drop it)


def set_wait_policy() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for this process unless it already chose (OMP_WAIT_POLICY or
    GOMP_SPINCOUNT set) or torch (and its OpenMP) is already loaded, when the setting would only reach
    child processes. True if it was set."""
    global policy_set_here
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    policy_set_here = True
    return True


def peer_environ() -> dict[str, str]:
    """This process's environment for another program (the vLLM peer of a benchmark): without the wait
    policy loraplex chose for itself, so the peer runs with its own defaults."""
    env = dict(os.environ)
    if policy_set_here:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process's cgroup may use (quota / period), or None when it has no quota. Reads v2
    `cpu.max` ("<quota> <period>" in microseconds, or "max ...") in the process's own cgroup and at the
    root (a container's namespace), then v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: no quota)."""
    own = []
    try:
        for line in self_cgroup.read_text().splitlines():  # "0::/path" (v2) or "4:cpu,cpuacct:/path" (v1)
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                own.append((controllers, path.lstrip("/")))
    except (OSError, ValueError):
        pass
    v2 = [root / path / "cpu.max" for c, path in own if c == ""] + [root / "cpu.max"]
    v1_dirs = [root / d / path for c, path in own if c for d in ("cpu", "cpu,cpuacct")] + [root / "cpu"]
    for f in v2:
        try:
            quota, period = f.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError, ZeroDivisionError):
            continue
    for d in v1_dirs:
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
            return None if quota < 0 else quota / period
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs this process may use: the affinity mask, capped by the cgroup's CPU quota rounded down
    (`cgroup_quota`). At least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    quota = cgroup_quota(root, self_cgroup)
    if quota is not None:
        n = min(n, math.floor(quota))
    return max(1, n)


def configure(num_threads: int | None = None) -> int:
    """Set PyTorch's intra-op threads to `num_threads`; when None, to `OMP_NUM_THREADS` if the
    environment sets it, else `usable_cpus()`. Returns the number set. Raises ValueError for a count
    below 1."""
    import torch

    if num_threads is None and os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        num_threads = int(os.environ["OMP_NUM_THREADS"])
    n = usable_cpus() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n
