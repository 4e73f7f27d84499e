"""Greedy rows take their tokens from the lm_head's bf16 screen (`kernels/cpu_greedy.py`) on the real default
model in fp32: the same tokens as from the logits, beside rows that need their logits (logprobs,
temperature), and a row the screen leaves out goes through the logits."""

from __future__ import annotations

import pytest

from loraplex import SamplingParams
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kernels import cpu_ext, cpu_greedy
from tests.helpers import chat_ids

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None or not ext.avx512_bf16_available(),
                                reason="the screen runs on CPUs with AVX512-BF16 (the CPU kernels built)")

PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow.", "What is 2 + 3?",
           "Write one sentence about the sea.", "Tell me a fun fact about owls."]


@pytest.fixture(scope="module")
def engine(model_path):
    return LLMEngine(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=64 << 20,
                     enable_prefix_caching=False)


def _run(engine, tokenizer, screen: bool) -> list[tuple[list[int], list]]:
    """Every prompt greedy, plus greedy with logprobs and seeded sampling on the first two: tokens and
    logprobs per request, the screen on or off."""
    head = engine.model.lm_head
    saved = head.greedy_packed
    head.greedy_packed = saved if screen else None
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in PROMPTS]
    params += [SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True),
               SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)]
    prompts = PROMPTS + PROMPTS[:2]
    try:
        reqs = [engine.add_request(chat_ids(tokenizer, p), sp) for p, sp in zip(prompts, params, strict=True)]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        head.greedy_packed = saved
    return [(list(r.output_token_ids), [(lp.token_id, lp.logprob, lp.top) for lp in r.output_logprobs or []])
            for r in reqs]


def test_greedy_rows_get_the_tokens_of_the_logits_beside_rows_that_need_them(engine, tokenizer, monkeypatch):
    screened = []
    real = cpu_greedy.greedy_tokens

    def counted(head, hidden):
        out = real(head, hidden)
        screened.append(hidden.shape[0] if out is not None else 0)
        return out

    monkeypatch.setattr(cpu_greedy, "greedy_tokens", counted)
    on = _run(engine, tokenizer, screen=True)
    assert sum(screened) == 16 * len(PROMPTS)  # the plain greedy rows, every step; never the other two
    off = _run(engine, tokenizer, screen=False)
    assert on == off
    assert on[len(PROMPTS)][0] == on[0][0] and len(on[len(PROMPTS)][1]) == 16  # greedy + logprobs: the same tokens


def test_a_row_the_screen_leaves_out_gets_its_token_from_the_logits(engine, tokenizer, monkeypatch):
    want = _run(engine, tokenizer, screen=False)
    real = cpu_greedy.greedy_tokens

    def first_left_out(head, hidden):
        tokens, candidates = real(head, hidden)
        return [-1] + tokens[1:], candidates

    monkeypatch.setattr(cpu_greedy, "greedy_tokens", first_left_out)
    assert _run(engine, tokenizer, screen=True) == want
