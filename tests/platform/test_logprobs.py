"""`logprobs` through the API with the official `openai` client: chat (`logprobs`, `top_logprobs`) and
completions (`logprobs`), streamed and not, against transformers' log_softmax on the same tokens (the
session's engine runs fp32)."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture
def client(server, make_tenant):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=make_tenant().key, max_retries=0)


def greedy_reference(plain_hf_model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `prompt` and the log_softmax [n, V] each was picked from."""
    with torch.no_grad():
        out = plain_hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)


def test_chat_logprobs_are_transformers_log_softmax_and_the_greedy_token_is_the_argmax(client, plain_hf_model, tokenizer):
    r = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    tokens, ref = greedy_reference(plain_hf_model, prompt, 6)
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content == tokenizer.decode(tokens)
    for i, (e, token) in enumerate(zip(content, tokens, strict=True)):
        assert e.token == tokenizer.decode([token]) and e.bytes == list(e.token.encode())
        assert e.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        top = ref[i].topk(3)
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert e.top_logprobs[0].logprob == e.logprob  # greedy: the sampled token is the most likely

    stream = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]

    plain = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(client):
    kw = dict(model=BASE_MODEL, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)
        assert logprob <= 0
    chunks = list(client.completions.create(**kw, stream=True))
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    """OpenAI's reference: up to logprobs + 1 entries, the sampled token always among them (vLLM too), also
    when sampling picked a token outside the top k, and with logprobs 0."""
    for k in (0, 1):
        r = client.completions.create(model=BASE_MODEL, prompt="The capital of France is", max_tokens=8,
                                      temperature=2.0, seed=3, logprobs=k, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == logprob and len(top) <= k + 1
        if k == 0:
            assert [len(top) for top in lp.top_logprobs] == [1] * 8


def test_tokens_that_are_part_of_a_character_keep_their_bytes(tokenizer):
    """SmolLM2's byte-level BPE splits an emoji and CJK characters over tokens that are not text alone: each
    is written as its escaped bytes (`bytes:`-prefixed on completions) with its real bytes (joined, they give
    the text back), alternatives that are different partial tokens keep different keys, and text offsets
    point into the text, also past bytes that never complete a character."""
    from loraplex.engine.sampler import TokenLogprobs
    from loraplex.platform.logprobs import chat_content, completion_logprobs

    text = "Emoji: \U0001F600 \u65e5\u672c\u8a9e ok"
    ids = tokenizer.encode(text)
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert len(partial) >= 4  # the emoji's and two CJK characters' pieces
    lps = [TokenLogprobs(t, -1.0, tuple((p, -2.0 - n) for n, p in enumerate(partial))) for t in ids]
    content = chat_content(tokenizer, lps)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == text
    emoji = next(e for e in content if e["token"].startswith(" \\x"))
    assert emoji["token"] == " \\xf0\\x9f\\x98" and emoji["bytes"] == [32, 0xF0, 0x9F, 0x98]
    assert len({e["token"] for e in content[0]["top_logprobs"]}) == len(partial)
    legacy = completion_logprobs(tokenizer, lps)
    assert all(len(top) == len(partial) + 1 for top in legacy["top_logprobs"][:3])  # + the sampled, whole token
    for token, offset in zip(legacy["tokens"], legacy["text_offset"], strict=True):
        assert token.startswith("bytes:") or text[offset:].startswith(token)
    assert legacy["text_offset"][-1] == text.index(" ok")
    assert "bytes: \\xf0\\x9f\\x98" in legacy["tokens"]

    cut = [*tokenizer.encode("Hi"), tokenizer.encode(" \U0001F600")[0], *tokenizer.encode(" abc x")]  # 3 of 4 bytes
    shown = tokenizer.decode(cut)
    assert shown == "Hi \ufffd abc x"
    legacy = completion_logprobs(tokenizer, [TokenLogprobs(t, -1.0) for t in cut])
    assert legacy["text_offset"] == [0, 2, 4, 8]
    for token, offset in zip(legacy["tokens"], legacy["text_offset"], strict=True):
        assert token.startswith("bytes:") or shown[offset:].startswith(token)
