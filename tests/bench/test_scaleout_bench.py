"""The scale-out preset's draws and numbers (`bench/scaleout.py`), without Ray: the cluster side is
`tests/platform/scaleout`."""

from __future__ import annotations

from collections import Counter

from loraplex.bench.scaleout import COLD, Call, Run, ScaleOutSpec, draw, write_report


def test_the_draw_is_the_same_every_time_and_follows_the_zipf_weights():
    spec = ScaleOutSpec(num_requests=4000)
    calls = draw(spec, 2.0, vocab_size=1000)
    assert [(c.adapter, c.prompt) for c in calls] == [(c.adapter, c.prompt) for c in draw(spec, 2.0, 1000)]
    share = Counter(c.adapter for c in calls)
    # p(a0) = 1 / sum(1/k^2, k <= 32) = 0.62; p(a1) = p(a0) / 4
    assert abs(share["a0"] / 4000 - 0.62) < 0.03 and abs(share["a1"] / share["a0"] - 0.25) < 0.04
    assert all(32 <= len(c.prompt) <= 128 and 100 <= min(c.prompt) and max(c.prompt) < 1000 for c in calls)
    assert Counter(c.adapter for c in draw(spec, 1.0, 1000))["a0"] < share["a0"]


def test_a_runs_numbers_come_from_the_headers_of_its_calls(tmp_path):
    def call(adapter, replica, tier, sent, first, tokens=16):
        return Call(adapter, [1], sent_s=sent, first_s=first, done_s=first + 1, replica=replica, tier=tier,
                    completion_tokens=tokens)

    calls = [call("a0", "x", "disk", 0.0, 0.5), call("a0", "x", "slots", 0.1, 0.3),
             call("a1", "y", "disk", 0.2, 1.2), call("a1", "y", "loading", 0.2, 1.2),
             call("a2", "x", "cpu", 0.3, 0.4)]
    run = Run(1.0, 2, "affinity", calls, duration_s=4.0, start_s=20.0, names={"x": "r1", "y": "r2"})
    assert run.hit_rate == 1 / 5 and run.count(COLD) == 2 and run.count(("cpu",)) == 1
    assert run.tokens_per_s == 80 / 4.0
    assert run.per_replica() == {"r1": (3, 2), "r2": (2, 1)}
    assert round(run.ttft(50), 6) == 0.5
    out = tmp_path / "scale-out.md"
    write_report(out, [run], ScaleOutSpec(), command="loraplex bench --preset scale-out")
    text = out.read_text()
    assert "## Zipf alpha 1" in text and "CPU flags:" in text
    assert "| 2 replicas, affinity | 20.0% | 1 | 2 | 1 | r1 3 / 2, r2 2 / 1 | 20.0 | 500 | 1000 | 20 |" in text
