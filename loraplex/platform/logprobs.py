"""Output tokens' log-probabilities (`engine.sampler.TokenLogprobs`) in OpenAI's two response shapes.

Chat (`logprobs: true`, `top_logprobs` 0..20): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}`. Completions (`logprobs` 0..5): `{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, where each `top_logprobs` entry
also holds the sampled token, so it has up to `logprobs` + 1 keys (OpenAI's reference; vLLM does the same).
A token's text is what the tokenizer decodes for it alone, and `bytes` its UTF-8. A token that is only
part of a character (an emoji or a CJK character split over byte-level BPE tokens) has no text of its
own: it is written as its bytes in `\\xNN` escapes (ASCII as itself), with the prefix `bytes:` on
completions (the forms of OpenAI's chat and legacy completions), and `bytes` are its real bytes, so a
client joins the `bytes` of consecutive tokens back into the character; alternatives that are different
partial tokens stay apart (vLLM writes each as U+FFFD with the bytes of U+FFFD, so their top-logprob keys
collide). `text_offset` counts the characters of the text before each token: a character split over
tokens counts once its last byte has come, bytes that never complete one as the U+FFFD the text shows.
Every sampled token is listed, the stop token (EOS) included, as vLLM does: the list follows
`token_ids`, not the text cut at a stop string. A streamed chunk carries the entries of the tokens that
arrived since the last chunk of its choice, with the offsets the unstreamed answer gives them (counted
over the tokens, `TextOffsets`, not over the text sent so far, which lags while the detokenizer holds
back what may start a stop string). With `echo`, a completion's entries start with its prompt's
tokens, the first of which has no log-probability (null, and null top alternatives), as in OpenAI's
legacy API and vLLM.
"""

from __future__ import annotations

import codecs

from loraplex.engine.sampler import TokenLogprobs


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: each of the 256 bytes is one printable character in a
    token's piece (printable Latin-1 bytes stand for themselves, the others for U+0100 onwards in byte
    order). Llama 3, Qwen and SmolLM vocabularies use it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_decoder()


def _raw_bytes(tokenizer, token_id: int) -> bytes | None:
    """A token's bytes from its vocabulary piece: byte-level BPE, or SentencePiece's `<0xNN>` byte
    fallback; None for a piece in neither form."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    return None


def _token(tokenizer, token_id: int, cache: dict[int, tuple[str, bytes, bool]]) -> tuple[str, bytes, bool]:
    """(text, bytes, is part of a character) of one token as chat shows it (the module's docstring)."""
    if token_id not in cache:
        text = tokenizer.decode([token_id])
        raw = _raw_bytes(tokenizer, token_id) if "\ufffd" in text else None
        if raw is not None and not _is_utf8(raw):  # part of a character: its bytes, escaped
            cache[token_id] = ("".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02x}" for b in raw), raw, True)
        else:
            cache[token_id] = (text, text.encode("utf-8"), False)
    return cache[token_id]


def _legacy(token: tuple[str, bytes, bool]) -> str:
    """A token's text as legacy completions show it: a part of a character gets the `bytes:` prefix."""
    return "bytes:" + token[0] if token[2] else token[0]


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def chat_content(tokenizer, lps: list[TokenLogprobs]) -> list[dict]:
    """The `content` list of a chat choice's `logprobs` for tokens `lps`."""
    cache: dict[int, tuple[str, bytes, bool]] = {}

    def entry(token_id: int, logprob: float) -> dict:
        text, raw, _ = _token(tokenizer, token_id, cache)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


class TextOffsets:
    """Counts the characters of a choice's text before each of its tokens (`text_offset`) across calls of
    `completion_logprobs`: a stream keeps one per choice, so its chunks' offsets are the unstreamed
    answer's, whatever text the detokenizer holds back meanwhile (a possible stop string)."""

    def __init__(self):
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # holds a split character's first bytes

    def before(self, raw: bytes) -> int:
        """The offset of the token whose bytes are `raw`; counts them."""
        if raw and not 0x80 <= raw[0] < 0xC0:  # not a continuation: held bytes never completed (one U+FFFD)
            self.flush()
        at = self.offset
        self.offset += len(self._decoder.decode(raw))
        return at

    def flush(self) -> None:
        """End a text decoded on its own (an echoed prompt): bytes it left incomplete count as the one
        U+FFFD its decoding shows, and the next token starts a new text."""
        self.offset += len(self._decoder.decode(b"", final=True))
        self._decoder.reset()


def completion_logprobs(tokenizer, lps: list[TokenLogprobs | int], offsets: TextOffsets | None = None) -> dict:
    """A completion choice's `logprobs` for tokens `lps`, whose text starts where its `offsets` stand (which
    this advances; None: at 0); an int in `lps` is a token with no log-probability (an echoed prompt's
    first token)."""
    cache: dict[int, tuple[str, bytes, bool]] = {}
    counter = TextOffsets() if offsets is None else offsets
    tokens, offsets, values, top = [], [], [], []
    for lp in lps:
        token = _token(tokenizer, lp if isinstance(lp, int) else lp.token_id, cache)
        text = _legacy(token)
        tokens.append(text)
        offsets.append(counter.before(token[1]))
        if isinstance(lp, int):
            values.append(None)
            top.append(None)
            continue
        entries = {_legacy(_token(tokenizer, t, cache)): v for t, v in lp.top}
        entries.setdefault(text, lp.logprob)
        values.append(lp.logprob)
        top.append(entries)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}
