"""The fairness preset's workload and numbers, without a model (its runs: `loraplex bench --preset fairness`)."""

from __future__ import annotations

import random

import pytest

from loraplex.bench.fairness import BIN_S, NOISY, QUIET, FairnessSpec, Record, Run, arrivals, plan, pooled


def test_the_plan_is_the_same_draw_in_every_run_and_the_noisy_rate_is_8x():
    spec = FairnessSpec(duration_s=200.0, quiet_rate=0.5)
    (quiet, noisy), (alone, none) = plan(spec, 1000, True), plan(spec, 1000, False)
    assert quiet == alone and none == []  # the quiet tenant's requests do not depend on the noisy one's
    assert sum(g for g, _ in quiet) >= spec.duration_s > sum(g for g, _ in quiet[:-1])  # think times fill it
    assert [t for t, _ in noisy] == sorted(t for t, _ in noisy) and noisy[-1][0] < spec.duration_s
    assert len(noisy) / len(quiet) == pytest.approx(8.0, rel=0.25)
    for items, (lo, hi) in ((quiet, spec.quiet_prompt), (noisy, spec.noisy_prompt)):
        assert all(lo <= len(ids) <= hi and all(0 <= t < 1000 for t in ids) for _, ids in items)
    assert plan(spec, 1000, True) == (quiet, noisy)


def test_poisson_arrivals_have_the_rate():
    times = arrivals(4.0, 500.0, random.Random(3))
    assert len(times) / 500.0 == pytest.approx(4.0, rel=0.1) and all(0 <= t < 500 for t in times)


def test_run_numbers_count_only_the_window():
    recs = [Record(QUIET, 0.0, 0.5, [0.5, 1.0, 11.0]), Record(NOISY, 1.0, 3.0, [3.0, 4.0, 6.0, 9.5]),
            Record(QUIET, 2.0, None, [])]
    run = Run("fair", recs, duration_s=10.0, num_preemptions=0)
    assert run.tokens_per_s() == pytest.approx(0.6)  # 6 tokens within 10 s; the one at 11 s is after it
    assert run.tokens_per_s(QUIET) == pytest.approx(0.2)
    assert run.ttft(QUIET, 50) == 0.5 and run.ttft(NOISY, 99) == pytest.approx(2.0)
    xs, ys = run.served_by_bin(NOISY)
    assert xs == [BIN_S / 2, BIN_S * 1.5] and ys == [2 / BIN_S, 2 / BIN_S]


def test_runs_of_one_policy_pool_end_to_end():
    a = Run("fair", [Record(QUIET, 1.0, 1.5, [1.5, 9.0])], duration_s=10.0, num_preemptions=2)
    b = Run("fair", [Record(QUIET, 2.0, 4.0, [4.0])], duration_s=10.0, num_preemptions=1)
    other = Run("fcfs", [Record(QUIET, 0.0, 9.0, [9.0])], duration_s=10.0, num_preemptions=0)
    both = pooled([a, other, b], "fair")
    assert (both.duration_s, both.num_preemptions, len(both.records)) == (20.0, 3, 2)
    assert both.records[1].arrival_s == 12.0 and both.records[1].token_times == [14.0]
    assert both.ttft(QUIET, 100) == pytest.approx(2.0) and both.tokens_per_s() == pytest.approx(3 / 20)
