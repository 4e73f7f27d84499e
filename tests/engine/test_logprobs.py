"""Log-probabilities of output tokens (`SamplingParams.logprobs`): log_softmax of the model's own logits in
fp32, checked against transformers' logits for the same tokens on the real default model."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.request import Request
from loraplex.engine.sampler import sample_rows, token_logprobs
from loraplex.engine.sampling_params import ParamError
from tests.helpers import chat_ids


def test_token_logprobs_are_log_softmax_with_the_top_k_most_likely_first():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 4
    reqs = [Request([1], SamplingParams(logprobs=k)) for k in (3, None, 0)]
    tokens = [7, 8, 9]
    out = token_logprobs(logits, reqs, tokens)
    ref = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    assert out[0].token_id == 7 and out[0].logprob == pytest.approx(ref[0, 7].item(), abs=1e-6)
    top = ref[0].topk(3)
    assert [t for t, _ in out[0].top] == top.indices.tolist()
    assert [lp for _, lp in out[0].top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out[2].top == () and out[2].logprob == pytest.approx(ref[2, 9].item(), abs=1e-6)


def test_a_row_whose_sampling_fails_has_no_logprobs_and_the_others_keep_theirs():
    logits = torch.randn(2, 20)
    logits[1, 3] = float("nan")
    reqs = [Request([1], SamplingParams(temperature=0, logprobs=2)) for _ in range(2)]
    tokens, errors, logprobs = sample_rows(logits, reqs)
    assert tokens[0] == logits[0].argmax().item() and errors[1] is not None
    assert logprobs[0].token_id == tokens[0] and logprobs[1] is None


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ParamError) as e:
        SamplingParams(logprobs=bad)
    assert e.value.param == "logprobs"


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=32 << 20)


def reference_logprobs(plain_hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log_softmax for each output token, given every token before it."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = plain_hf_model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.slow
def test_greedy_logprobs_match_transformers_and_the_token_is_the_argmax(llm, plain_hf_model, tokenizer):
    prompts = [chat_ids(tokenizer, "Name three colours."), chat_ids(tokenizer, "What is 2 + 3?")]
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=5), SamplingParams(max_tokens=8, temperature=0)]
    with_lp, without = llm.generate(prompts, params)
    assert without.logprobs is None  # a neighbour that did not ask gets none, and its tokens are its own
    assert without.token_ids == llm.generate([prompts[1]], params[1])[0].token_ids
    ref = reference_logprobs(plain_hf_model, prompts[0], with_lp.token_ids)
    assert len(with_lp.logprobs) == len(with_lp.token_ids)
    for i, (token, lp) in enumerate(zip(with_lp.token_ids, with_lp.logprobs, strict=True)):
        assert lp.token_id == token == ref[i].argmax().item()
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        top = ref[i].topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.slow
def test_sampled_tokens_get_the_raw_logprobs_before_temperature(llm, plain_hf_model, tokenizer):
    prompt = chat_ids(tokenizer, "Tell me a fun fact about owls.")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.5, top_k=20, seed=3, logprobs=0))[0]
    ref = reference_logprobs(plain_hf_model, prompt, out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert lp.top == () and lp.logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-4)


@pytest.mark.slow
def test_streamed_deltas_carry_each_tokens_logprobs_once(llm, tokenizer):
    engine = llm.engine
    req = engine.add_request(chat_ids(tokenizer, "Say hi."), SamplingParams(max_tokens=6, temperature=0, logprobs=2,
                                                                            ignore_eos=True))
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == req.request_id:
                assert len(out.delta_logprobs) == len(out.delta_token_ids)
                deltas += out.delta_logprobs
                last = out
    assert last.finished and deltas == last.logprobs and [lp.token_id for lp in deltas] == last.token_ids
