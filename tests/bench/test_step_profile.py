"""The step profile times decode steps of exactly the batch it names (real default model, fp32)."""

from __future__ import annotations

import pytest

from loraplex import LLM
from loraplex.bench import step_profile


@pytest.fixture(scope="module")
def llm(model_path):
    # chunks of 16 tokens: 8 prompts of 16 tokens take 8 to 16 prefill steps, in which the first rows decode
    # (each decode takes one token of the chunk)
    return LLM(str(model_path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16,
               kv_cache_memory=32 << 20, enable_prefix_caching=False)


def test_every_timed_step_decodes_all_rows(llm):
    engine = llm.engine
    before_steps, before_rows = engine.num_steps, engine.num_batched_rows
    timers, step_s = step_profile.steady_decode(llm, 8, 16, None, 3)
    assert step_s > 0 and timers.seconds["projections"] > 0
    assert not engine.has_unfinished_requests()  # the requests were aborted after the timed steps
    assert engine.num_batched_rows - before_rows >= 8 * 3 and engine.num_steps - before_steps >= 3 + 8
    assert step_profile.decode_out_len(8, 16, 3, 16) == 3 + 2 + 16  # 16 prefill steps of 8 tokens at most


def test_a_batch_that_shrank_before_the_timed_steps_is_refused(llm, monkeypatch):
    # the old output length (steps + 8 = 11 tokens): the first rows finish during the other rows' prefills
    monkeypatch.setattr(step_profile, "decode_out_len", lambda rows, context, steps, chunk: steps + 8)
    with pytest.raises(RuntimeError, match=r"the timed steps decoded \d+ rows, not 3 x 8"):
        step_profile.steady_decode(llm, 8, 16, None, 3)
    assert not llm.engine.has_unfinished_requests()


def fused_mlp(model) -> bool:
    """Whether the gate/up GEMM runs with SiLU x up in its epilogue (our packed GEMM: AVX2 + FMA)."""
    from loraplex.engine import model as model_mod

    gate_up = model.layers[0].mlp.gate_up_proj
    return bool(model_mod.FUSED_ELEMENTWISE and getattr(gate_up, "packed_glu", 0)
                and getattr(gate_up, "packed_rows", None) is not None)


def test_every_projection_gemm_is_timed(llm):
    # q/k/v, o, gate/up and down of every layer in every timed step: with our packed GEMM the gate/up one
    # runs with SiLU x up in its epilogue (silu_mul_linear), around base_linear, and was once left out of
    # "projections" (half a layer's GEMM FLOPs counted as norms and activations)
    model = llm.engine.model
    if not fused_mlp(model):
        pytest.skip("needs our packed GEMM (a CPU with AVX2 + FMA), whose calls these counts name")
    steps = 3
    timers, _ = step_profile.steady_decode(llm, 8, 16, None, steps)
    assert timers.calls["projections"] == 4 * len(model.layers) * steps
    assert timers.calls["attention"] == len(model.layers) * steps


def test_the_last_layer_of_a_prefill_is_timed(llm):
    # a prompt step samples one row, so its last layer takes q/k/v's columns (k and v for every row, q for
    # the sampled one) and attends that row alone: two linear_columns calls and paged_attention_rows, once
    # counted in the forward's rest
    model = llm.engine.model
    if not fused_mlp(model):
        pytest.skip("needs our packed GEMM (a CPU with AVX2 + FMA), whose calls these counts name")
    timers, _ = step_profile.one_prefill(llm, 16, None)
    assert timers.calls["projections"] == 4 * len(model.layers) + 1
    assert timers.calls["attention"] == len(model.layers)
