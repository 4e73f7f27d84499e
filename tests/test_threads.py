"""Thread count from the CPUs the process may use, and the OpenMP wait policy set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loraplex import threads

CHILD = """
import os, sys
os.sched_setaffinity(0, {0})
import loraplex, torch
from loraplex import LLM
llm = LLM("smollm2-135m-shapes", load_format="dummy", dtype="float32", max_loras=1, num_kv_blocks=8)
print(os.environ.get("OMP_WAIT_POLICY"), torch.get_num_threads(), llm.engine.num_threads)
"""


def run_child(env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_engine_threads_follow_the_affinity_mask_and_sleep_when_waiting():
    assert run_child({}) == ["PASSIVE", "1", "1"]  # one CPU allowed: one thread, not the machine's count


def test_a_policy_the_environment_chose_is_kept():
    assert run_child({"OMP_WAIT_POLICY": "ACTIVE"}) == ["ACTIVE", "1", "1"]
    assert run_child({"GOMP_SPINCOUNT": "10000"}) == ["None", "1", "1"]


def test_cgroup_quota_caps_the_count(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    allowed = len(os.sched_getaffinity(0))
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: 2 threads
    assert threads.usable_cpus(cpu_max) == min(allowed, 2)
    cpu_max.write_text("50000 100000\n")
    assert threads.usable_cpus(cpu_max) == 1
    cpu_max.write_text("max 100000\n")
    assert threads.usable_cpus(cpu_max) == allowed
    assert threads.usable_cpus(tmp_path / "missing") == allowed


def test_configure_refuses_no_threads():
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        threads.configure(0)
