"""Log-probabilities of prompt tokens (`SamplingParams.prompt_logprobs`, what `/v1/completions` with `echo`
returns and lm-eval-harness scores with): checked against transformers' and PEFT's logits on the real
default model, through chunked prefill, the prefix cache and preemption."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.adapters.synthetic import randomize_lora_weights
from loraplex.engine import sampler
from loraplex.engine.request import Request
from loraplex.engine.sampler import prompt_token_logprobs
from loraplex.engine.sampling_params import ParamError
from tests.helpers import chat_ids


def test_prompt_token_logprobs_are_log_softmax_in_chunks_and_flag_rows_that_are_not_finite(monkeypatch):
    monkeypatch.setattr(sampler, "PROMPT_LOGITS_ROWS", 3)  # 7 rows: three chunks of logits
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 40, generator=gen) * 3
    hidden[5, 2] = float("inf")
    calls = []

    def logits_of(h):
        calls.append(h.shape[0])
        return h.clone()

    targets, ks = [3, 1, 4, 1, 5, 9, 2], [2, 0, 2, 5, 2, 2, 1]
    lps, finite = prompt_token_logprobs(logits_of, hidden, targets, ks)
    assert calls == [3, 3, 1]
    assert finite == [True] * 5 + [False, True]
    ref = torch.log_softmax(hidden, dim=-1)
    for r in (0, 1, 2, 3, 4, 6):
        assert lps[r].token_id == targets[r]
        assert lps[r].logprob == pytest.approx(ref[r, targets[r]].item(), abs=1e-6)
        top = ref[r].topk(ks[r])
        assert [t for t, _ in lps[r].top] == top.indices.tolist()
        assert [v for _, v in lps[r].top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_the_rows_a_chunk_scores_skip_what_is_scored_and_the_prompts_last_position():
    req = Request(list(range(10, 20)), SamplingParams(prompt_logprobs=1))
    assert req.prompt_logprobs == [None] and req.needs_prompt_logprobs
    assert req.prompt_logprob_rows(0, 4) == range(0, 4)  # positions 0..3 score tokens 1..4
    req.prompt_logprobs += [None] * 4
    assert req.prompt_logprob_rows(0, 8) == range(4, 8)  # recomputed after preemption: 0..3 are scored
    assert req.prompt_logprob_rows(8, 11) == range(8, 9)  # position 9 scores the first output token
    req.prompt_logprobs += [None] * 5
    assert not req.needs_prompt_logprobs and not req.prompt_logprob_rows(0, 10)
    assert not Request([1, 2, 3], SamplingParams()).prompt_logprob_rows(0, 3)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.0])
def test_prompt_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ParamError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: the model's log_softmax at positions 0..P-2, each scoring the prompt token after it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i, lp in enumerate(prompt_logprobs[1:]):
        token = prompt[i + 1]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4), f"prompt token {i + 1}"
        top = ref[i].topk(k)
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t for t, _ in lp.top] == top.indices.tolist()


@pytest.fixture(scope="module")
def llm(model_path):
    # 16 tokens per step: every prompt here is prefilled in several chunks
    return LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=32 << 20,
               max_num_batched_tokens=16, max_num_seqs=4)


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_over_chunks_beside_requests_that_do_not_ask(llm, plain_hf_model,
                                                                                         tokenizer):
    prompts = [chat_ids(tokenizer, "Name three colours of the rainbow, please."), chat_ids(tokenizer, "What is 2 + 3?")]
    alone = llm.generate([prompts[1]], SamplingParams(max_tokens=6, temperature=0))[0]
    asked, other = llm.generate(prompts, [SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=3),
                                          SamplingParams(max_tokens=6, temperature=0)])
    assert len(prompts[0]) > 32  # three chunks or more
    assert_matches(asked.prompt_logprobs, prompts[0], reference(plain_hf_model, prompts[0]), 3)
    assert other.prompt_logprobs is None and other.token_ids == alone.token_ids
    # its output is the same as without prompt_logprobs
    assert asked.token_ids == llm.generate([prompts[0]], SamplingParams(max_tokens=6, temperature=0))[0].token_ids


@pytest.mark.slow
def test_a_cached_prompt_is_computed_again_for_its_logprobs_and_its_blocks_serve_others(llm, plain_hf_model,
                                                                                       tokenizer):
    prompt = chat_ids(tokenizer, "Write one sentence about the sea and the sky above it.")
    first = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]  # its blocks are cached now
    bm = llm.engine.block_manager
    looked_up = bm.num_cached_query_tokens
    scored = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0  # the cached prefix would have had no hidden states
    assert bm.num_cached_query_tokens == looked_up  # not a lookup, so not a miss in the hit rate
    assert_matches(scored.prompt_logprobs, prompt, reference(plain_hf_model, prompt), 0)
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16 and again.token_ids == first.token_ids


@pytest.mark.slow
def test_preempted_requests_keep_their_prompt_logprobs_once(model_path, tokenizer):
    texts = ["Tell me a fun fact about owls.", "How many legs does a spider have?", "Give me a word that rhymes with cat."]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=2)
    roomy = LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, max_num_batched_tokens=16, max_num_seqs=4)
    expected = roomy.generate(prompts, params)
    # blocks of 16 tokens for one or two requests at a time: the newest is preempted and recomputed
    blocks = -(-(max(len(p) for p in prompts) + 24) // 16)
    tight = LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, max_num_batched_tokens=16, max_num_seqs=4,
                num_kv_blocks=blocks + 1)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, exp, prompt in zip(outs, expected, prompts, strict=True):
        assert out.token_ids == exp.token_ids
        assert len(out.prompt_logprobs) == len(prompt)
        for a, b in zip(out.prompt_logprobs[1:], exp.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.slow
def test_an_adapters_prompt_logprobs_match_peft(model_path, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    randomize_lora_weights(model, torch.Generator().manual_seed(7), b_std=0.05)
    model.save_pretrained(tmp_path)
    model.eval()
    engine = LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, max_num_batched_tokens=16, max_num_seqs=4)
    engine.load_adapter("tuned", tmp_path)
    prompt = chat_ids(tokenizer, "Write one sentence about the sea.")
    with_adapter, without = engine.generate([prompt, prompt], SamplingParams(max_tokens=1, temperature=0,
                                                                             prompt_logprobs=1),
                                            adapters=["tuned", None])
    ref = reference(model, prompt)
    assert_matches(with_adapter.prompt_logprobs, prompt, ref, 1)
    with model.disable_adapter():
        base_ref = reference(model, prompt)
    assert_matches(without.prompt_logprobs, prompt, base_ref, 1)
    assert (ref - base_ref).abs().max() > 0.1  # the adapter changes the scores
