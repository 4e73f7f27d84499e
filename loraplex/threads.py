"""How many CPU threads the engine's PyTorch ops use, and how they wait between parallel regions.

`usable_cpus()` counts the CPUs this process may run on: its affinity mask (`taskset`, a container's
cpuset), capped by a cgroup v2 CPU quota (`cpu.max`, quota / period rounded up), so a container limited
to 2 CPUs on a 64-core host runs 2 threads, not 64 (PyTorch's default is the host's core count).

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


def set_wait_policy() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for this process unless it already chose (OMP_WAIT_POLICY or
    GOMP_SPINCOUNT set). True if the setting takes effect: torch (and its OpenMP) not yet loaded."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    return "torch" not in sys.modules


def usable_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may use: the affinity mask, capped by a cgroup v2 `cpu.max` quota (`cpu_max`,
    "<quota> <period>" in microseconds, or "max"). At least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            n = min(n, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def configure(num_threads: int | None = None) -> int:
    """Set PyTorch's intra-op threads to `num_threads`, or to `usable_cpus()` when None; the number set.
    Raises ValueError for a count below 1."""
    import torch

    n = usable_cpus() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n
