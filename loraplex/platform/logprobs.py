"""Output tokens' log-probabilities (`engine.sampler.TokenLogprobs`) in OpenAI's two response shapes.

Chat (`logprobs: true`, `top_logprobs` 0..20): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}`. Completions (`logprobs` 0..5): `{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`. A token's text is what the
tokenizer decodes for it alone (a token that is part of a multi-byte character decodes to U+FFFD, as in
vLLM); `bytes` are that text's UTF-8. Every sampled token is listed, the stop token (EOS) included, as
vLLM does: the list follows `token_ids`, not the text cut at a stop string. A streamed chunk carries the
entries of the tokens that arrived since the last chunk of its choice.
"""

from __future__ import annotations

from loraplex.engine.sampler import TokenLogprobs


def _text(tokenizer, token_id: int, cache: dict[int, str]) -> str:
    if token_id not in cache:
        cache[token_id] = tokenizer.decode([token_id])
    return cache[token_id]


def chat_content(tokenizer, lps: list[TokenLogprobs]) -> list[dict]:
    """The `content` list of a chat choice's `logprobs` for tokens `lps`."""
    cache: dict[int, str] = {}

    def entry(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id, cache)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def completion_logprobs(tokenizer, lps: list[TokenLogprobs], text_offset: int = 0) -> dict:
    """A completion choice's `logprobs` for tokens `lps` whose text starts at `text_offset` characters."""
    cache: dict[int, str] = {}
    tokens = [_text(tokenizer, lp.token_id, cache) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_text(tokenizer, t, cache): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets}
