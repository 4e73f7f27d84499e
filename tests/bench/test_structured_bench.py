"""`loraplex bench --preset structured` on a tiny spec: the same tokens in every run, masks counted only on
constrained rows, and a report with both tables."""

from __future__ import annotations

import pytest

from loraplex.bench import structured

pytestmark = pytest.mark.slow


def test_a_tiny_run_has_the_same_tokens_at_every_fraction_and_writes_both_tables(tmp_path, tokenizer):
    spec = structured.StructuredSpec(num_requests=4, max_tokens=6, repeats=1, dtype="float32")
    runs, dtype = structured.run_throughput(spec, threads=1)
    assert [r.fraction for r in runs] == [0.0, 0.5, 1.0] and dtype == "float32"
    assert all(r.num_tokens == 4 * 6 and r.finish == {"length": 4} for r in runs)
    # every step samples all 4 rows (prefill, then 5 decodes); constrained rows are masked in each
    assert [r.num_masked_rows for r in runs] == [0, 2 * 6, 4 * 6]
    compiles = structured.compile_times(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert [row["schema"] for row in compiles[0]] == list(structured.SCHEMAS)
    assert all(row["ll_compile_ms"] > 0 and row["ll_cached_us"] < row["ll_compile_ms"] * 1e3 for row in compiles[0])
    out = tmp_path / "structured.md"
    structured.write_report(out, runs, compiles, spec, command="loraplex bench --preset structured", threads=1,
                            dtype=dtype)
    text = out.read_text()
    assert "| 50% | 24 |" in text and "| 100% | 24 |" in text and "CPU flags:" in text
    assert "| person (nested, enum, bounds) |" in text
