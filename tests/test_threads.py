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


def test_omp_num_threads_wins_over_the_cpu_count():
    assert run_child({"OMP_NUM_THREADS": "2"})[1:] == ["2", "2"]  # one CPU allowed, but the environment chose
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import os; os.environ['OMP_NUM_THREADS'] = '3'; from loraplex import threads; print(threads.configure())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "3", out.stderr[-1000:]


def test_cgroup_quota_caps_the_count_v2_and_v1(tmp_path):
    allowed = len(os.sched_getaffinity(0))
    own = tmp_path / "self-cgroup"
    own.write_text("0::/app.slice/me\n")
    (tmp_path / "app.slice" / "me").mkdir(parents=True)
    cpu_max = tmp_path / "app.slice" / "me" / "cpu.max"  # the process's own v2 cgroup, not the root's
    for text, want in (("150000 100000", 1), ("250000 100000", 2), ("50000 100000", 1), ("max 100000", allowed)):
        cpu_max.write_text(text + "\n")
        assert threads.usable_cpus(tmp_path, own) == min(allowed, want), text
    v1 = tmp_path / "v1"
    (v1 / "cpu" / "docker" / "x").mkdir(parents=True)
    own.write_text("5:cpu,cpuacct:/docker/x\n3:memory:/docker/x\n")
    (v1 / "cpu" / "docker" / "x" / "cpu.cfs_period_us").write_text("100000\n")
    for quota, want in (("100000", 1), ("-1", allowed)):
        (v1 / "cpu" / "docker" / "x" / "cpu.cfs_quota_us").write_text(quota + "\n")
        assert threads.usable_cpus(v1, own) == min(allowed, want), quota
    assert threads.usable_cpus(tmp_path / "missing", tmp_path / "missing") == allowed


def test_the_peer_does_not_inherit_the_policy_loraplex_chose(monkeypatch):
    monkeypatch.setattr(threads, "policy_set_here", True)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OMP_WAIT_POLICY" not in threads.peer_environ()
    monkeypatch.setattr(threads, "policy_set_here", False)  # the user's own choice travels
    assert threads.peer_environ()["OMP_WAIT_POLICY"] == "PASSIVE"


def test_configure_refuses_no_threads():
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        threads.configure(0)
