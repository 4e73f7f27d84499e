"""`echo` on /v1/completions with the official `openai` client: each prompt's text and, with `logprobs`, its
tokens' log-probabilities before the completion's (OpenAI's legacy API, vLLM), as lm-eval-harness's
`local-completions` scores a continuation; checked against transformers' log_softmax on the same tokens
(the session's engine runs fp32)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris"


@pytest.fixture
def client(server, make_tenant):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=make_tenant().key, max_retries=0)


def prompt_reference(plain_hf_model, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: log_softmax at positions 0..P-2, each scoring the prompt token after it."""
    with torch.no_grad():
        logits = plain_hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_lm_eval_harness_loglikelihood_request(client, plain_hf_model, tokenizer):
    """lm-eval-harness's `local-completions` payload for a loglikelihood request, and its parsing: the
    continuation's summed log-probability and whether greedy decoding would produce it."""
    ctx, cont = tokenizer.encode(CONTEXT), tokenizer.encode(CONTINUATION)
    prompt = ctx + cont
    r = client.completions.create(model=BASE_MODEL, prompt=[prompt], temperature=0, max_tokens=1, logprobs=1,
                                  seed=1234, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    assert choice.text.startswith(tokenizer.decode(prompt)) and "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ref = prompt_reference(plain_hf_model, prompt)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = lp.top_logprobs[i]
        best = ref[i - 1].argmax().item()
        assert top[tokenizer.decode([best])] == pytest.approx(ref[i - 1, best].item(), abs=1e-4)
        assert top[lp.tokens[i]] == lp.token_logprobs[i] and len(top) <= 2
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 1

    # lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs
    n = len(ctx)
    loglikelihood = sum(lp.token_logprobs[n:-1])
    is_greedy = all(tok == max(top.values()) for tok, top in zip(lp.token_logprobs[n:-1], lp.top_logprobs[n:-1],
                                                                 strict=True))
    expected = sum(ref[i - 1, prompt[i]].item() for i in range(n, len(prompt)))
    assert loglikelihood == pytest.approx(expected, abs=1e-3)
    assert is_greedy == all(ref[i - 1].argmax().item() == prompt[i] for i in range(n, len(prompt)))


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, tokenizer):
    text = CONTEXT + CONTINUATION
    prompt = tokenizer.encode(text)
    r = client.completions.create(model=BASE_MODEL, prompt=text, max_tokens=0, logprobs=3, echo=True)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt) and choice.logprobs.token_logprobs[0] is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 0, len(prompt))
    assert all(len(top) <= 4 for top in choice.logprobs.top_logprobs[1:])
    scored = client.completions.create(model=BASE_MODEL, prompt=text, max_tokens=2, logprobs=3, echo=True,
                                       temperature=0)
    assert scored.choices[0].logprobs.token_logprobs[:len(prompt)] == pytest.approx(choice.logprobs.token_logprobs)
    assert scored.choices[0].text.startswith(text) and len(scored.choices[0].text) > len(text)


def test_echo_without_logprobs_returns_the_prompt_then_the_completion(client):
    kw = dict(model=BASE_MODEL, prompt=["One, two, three,", "Red, green,"], max_tokens=4, temperature=0)
    plain = client.completions.create(**kw)
    echoed = client.completions.create(**kw, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [p + plain.choices[i // 2].text
                                                for i, p in enumerate(["One, two, three,"] * 2 + ["Red, green,"] * 2)]
    assert all(c.logprobs is None for c in echoed.choices)
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_streamed_echo_sends_what_the_json_answer_holds(client, max_tokens):
    kw = dict(model=BASE_MODEL, prompt="The capital of France is", max_tokens=max_tokens, logprobs=2, echo=True,
              temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    parts = [ch for c in chunks for ch in c.choices]
    assert parts[0].text == "The capital of France is"  # the prompt comes first, in a chunk of its own
    assert "".join(ch.text for ch in parts) == whole.text
    assert [ch.finish_reason for ch in parts if ch.finish_reason] == [whole.finish_reason]
    streamed = [ch.logprobs for ch in parts if ch.logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == whole.logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset
    assert chunks[-1].usage.completion_tokens == max_tokens


def test_max_tokens_0_needs_echo(server, make_tenant):
    tenant = make_tenant()
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "echo": False})]:
        r = tenant.client.post(path, json={"model": BASE_MODEL, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "max_tokens must be an integer >= 1, got 0 (0 is allowed with echo: "
                                                "true, to score the prompt alone).", "type": "invalid_request_error",
                                     "param": "max_tokens", "code": None}
    r = tenant.chat(max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = tenant.client.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "Hi", "max_tokens": -1,
                                                    "echo": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be an integer >= 1, got -1"
    r = tenant.client.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "Hi", "echo": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"


def test_only_the_first_choice_of_each_prompt_asks_the_engine_to_score_it():
    from loraplex.platform.completion import sampling_params
    from loraplex.platform.openai_schemas import CompletionRequest

    body = CompletionRequest(model=BASE_MODEL, prompt=["a", "b"], n=3, echo=True, logprobs=2)
    params = sampling_params(49152, body, 2, 0)
    assert [p.prompt_logprobs for p in params] == [2, None, None, 2, None, None]
    assert {p.max_tokens for p in params} == {1}
    no_logprobs = CompletionRequest(model=BASE_MODEL, prompt="a", n=2, echo=True)
    assert [p.prompt_logprobs for p in sampling_params(49152, no_logprobs, 1, 4)] == [None, None]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_share_one_scoring_of_their_prompt(client, plain_hf_model, tokenizer, stream):
    prompts = ["One, two, three, four,", "The capital of France is"]
    kw = dict(model=BASE_MODEL, prompt=prompts, n=3, max_tokens=3, logprobs=1, echo=True, temperature=0.8, seed=5)
    whole = client.completions.create(**kw)
    for i, choice in enumerate(whole.choices):
        ids = tokenizer.encode(prompts[i // 3])
        ref = prompt_reference(plain_hf_model, ids)
        assert choice.text.startswith(prompts[i // 3])
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                              abs=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        for i, choice in enumerate(whole.choices):
            parts = [ch for c in chunks for ch in c.choices if ch.index == i]
            assert parts[0].text == prompts[i // 3] and "".join(p.text for p in parts) == choice.text
            assert [t for p in parts if p.logprobs for t in p.logprobs.tokens] == choice.logprobs.tokens
            assert [o for p in parts if p.logprobs for o in p.logprobs.text_offset] == choice.logprobs.text_offset


@pytest.mark.parametrize("body", [
    # a token-id prompt that ends inside a character (2 of the 3 bytes of 是): the completion is decoded apart
    {"prompt": [36218, 17097, 242], "echo": True},
    # a stop string: the stream holds back text that may start it, and the offsets count the tokens anyway
    {"prompt": "Count: one, two, three,", "stop": [" six"]},
])
def test_streamed_text_offsets_are_the_unstreamed_ones_and_point_into_the_text(client, tokenizer, body):
    kw = dict(model=BASE_MODEL, max_tokens=8, logprobs=1, temperature=0, **body)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert token.startswith("bytes:") or whole.text[offset:].startswith(token) or offset >= len(whole.text)
    chunks = list(client.completions.create(**kw, stream=True))
    assert [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset] == lp.text_offset


def test_a_stream_holds_a_choice_until_its_prompts_first_choice_has_scored_the_prompt(tokenizer):
    """The engine may finish choice 1 of a prompt before choice 0, the one that scores the prompt (say,
    choice 0 was preempted): choice 1's chunks wait for the scores, then go out in order; if choice 0
    fails first, choice 1 gets its error instead and its engine request is aborted."""
    import asyncio
    from types import SimpleNamespace

    from loraplex.engine.request import RequestOutput
    from loraplex.engine.sampler import TokenLogprobs
    from loraplex.platform.completion import Completion, sampling_params
    from loraplex.platform.completion_response import stream
    from loraplex.platform.openai_schemas import CompletionRequest

    ids = tokenizer.encode("Hello world, hi")
    body = CompletionRequest(model=BASE_MODEL, prompt=ids, n=2, echo=True, logprobs=1, max_tokens=1, stream=True)
    c = Completion("completion", body, (ids,), 1, tuple(sampling_params(49152, body, 1, 1)), "cmpl-x", 0)
    scores = [None] + [TokenLogprobs(t, -0.5 - k, ((t, -0.5 - k),)) for k, t in enumerate(ids[1:])]

    def out(rid, token, prompt_logprobs=None, error=None):
        return RequestOutput(rid, ids, [token], tokenizer.decode([token]), "abort" if error else "length", None,
                             delta_text=tokenizer.decode([token]), delta_token_ids=[token], error=error,
                             logprobs=[TokenLogprobs(token, -1.0)], delta_logprobs=[TokenLogprobs(token, -1.0)],
                             prompt_logprobs=prompt_logprobs)

    aborted = []

    def run(batches):
        async def gen_batches():
            for b in batches:
                yield b

        gen = SimpleNamespace(service=SimpleNamespace(tokenizer=tokenizer, abort_nowait=lambda *ids: aborted.extend(ids)),
                              choices=[None, None], request_ids=["r0", "r1"], batches=gen_batches, cancel=lambda: None)

        async def main():
            finalized = asyncio.get_running_loop().create_future()
            finalized.set_result(None)
            events = [e async for e in stream(c, gen, finalized)]
            return [json.loads(line.removeprefix("data: ")) for e in events for line in e.split("\n\n")
                    if line and line != "data: [DONE]"]

        return asyncio.run(main())

    events = run([[(1, out("r1", 42))], [(0, out("r0", 43, scores))]])
    by_choice = {i: [e["choices"][0] for e in events if e.get("choices") and e["choices"][0]["index"] == i]
                 for i in (0, 1)}
    assert [e["choices"][0]["index"] for e in events] == [0, 0, 0, 1, 1, 1]  # choice 1 waited for choice 0
    for i in (0, 1):
        chunks = by_choice[i]
        assert chunks[0]["text"] == tokenizer.decode(ids) and chunks[1]["text"] == tokenizer.decode([43 - i])
        assert chunks[0]["logprobs"]["token_logprobs"] == [None] + [lp.logprob for lp in scores[1:]]
        assert chunks[1]["logprobs"]["token_logprobs"] == [-1.0]
        assert chunks[1]["logprobs"]["text_offset"] == [len(tokenizer.decode(ids))]
        assert chunks[2]["finish_reason"] == "length"
    assert not aborted

    events = run([[(1, out("r1", 42))], [(0, out("r0", 43, error="RuntimeError: boom"))], [(1, out("r1", 44))]])
    assert [e["error"]["code"] for e in events] == ["engine_error", "engine_error"]  # both, once each
    assert aborted == ["r1"]
    events = run([[(0, out("r0", 43, error="RuntimeError: boom"))], [(1, out("r1", 44))]])  # before choice 1 ran
    assert [e["error"]["code"] for e in events] == ["engine_error", "engine_error"] and aborted == ["r1", "r1"]
