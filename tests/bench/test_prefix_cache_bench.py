"""The prefix-cache preset's plan and numbers, without a server (its runs: `loraplex bench --preset prefix-cache`)."""

from __future__ import annotations

import pytest

from loraplex.bench.prefix_cache import PrefixSpec, Run, Turn, make_plan, pooled, shared_check, write_report


def test_the_plan_is_the_same_draw_every_time_and_the_system_prompts_are_long_enough(tokenizer):
    spec = PrefixSpec(system_tokens=300, num_tenants=3, users_per_tenant=2, turns=3, num_shared=4)
    a, b = make_plan(spec, tokenizer), make_plan(spec, tokenizer)
    assert a == b
    assert all(len(tokenizer.encode(s)) >= 300 for s in [*a.systems, a.shared_system])
    assert len(set(a.systems)) == 3 and a.adapters == [None, "helper-1", "helper-2"]
    assert sorted(a.questions) == [(t, u) for t in range(3) for u in range(2)]
    assert all(len(q) == 3 for q in a.questions.values()) and len(a.shared_questions) == 4


def turn(tenant, k, sent, first, prompt, cached, tokens=8, text="x"):
    return Turn(tenant, 0, k, sent, first, first + 1, prompt, cached, tokens, text)


def test_numbers_of_a_run_and_of_pooled_runs(tmp_path):
    shared = [turn(0, 0, 0.0, 2.0, 737, 0), turn(0, 1, 3.0, 3.2, 737, 720), turn(0, 2, 4.0, 4.4, 737, 704)]
    multi = [turn(0, 0, 0.0, 1.0, 700, 0), turn(0, 1, 2.0, 2.1, 740, 704), turn(1, 0, 0.0, 3.0, 700, 0)]
    on = Run(True, shared, multi, duration_s=12.0, engine_hits=704, engine_queries=2140)
    first, rest, fewest = shared_check(on)
    assert (first, round(rest, 6), fewest) == (2.0, 0.3, 704)
    assert on.tokens_per_s == 24 / 12 and on.hit_rate == 704 / 2140
    assert on.ttft(50, first_turn=False) == pytest.approx(0.1) and on.ttft(50, first_turn=True) == 2.0
    off = Run(False, [turn(0, i, 0.0, 2.0, 737, 0) for i in range(3)],
              [turn(t, k, 0.0, 2.0, 700, 0) for t, k in ((0, 0), (0, 1), (1, 0))], 20.0)
    both = pooled([on, off, on], True)
    assert len(both.turns) == 6 and both.duration_s == 24.0 and both.engine_hits == 1408
    out = tmp_path / "prefix-cache.md"
    write_report(out, [on, off], PrefixSpec(), command="loraplex bench --preset prefix-cache", threads=2)
    text = out.read_text()
    assert "| on #1 | 737 | 704 | 2000 | 300 | 0.15x |" in text
    assert "| output tokens/s | 1.67x |" in text  # 2.0 / 1.2
    assert "text for text: 3 of 3 (first turns: 2 of 2;" in text
