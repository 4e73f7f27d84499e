"""Structured output: decoding constrained by a JSON Schema, per row of a mixed batch.

Letters: B rows sampled this step, B' of them constrained, V the model's vocabulary, W = ceil(V / 32)
words of a token bitmask.

The grammar library is llguidance (PyPI `llguidance`, vLLM's "guidance" backend); why, measured against
xgrammar on this tokenizer, is in docs/structured-output.md: no dependencies (xgrammar pins torch,
triton, transformers and apache-tvm-ffi), a readable reason for every schema it refuses, the wider
JSON Schema coverage, and mask work bounded per row and step by its parser limits ("fuel", about
15 ms at most); a schema that needs more ends its own request with an error.

The life of a schema, the way vLLM's structured-output manager splits it:
- `StructuredOutputs.compile(schema)` turns it into a grammar, validates it against the tokenizer and
  builds one matcher for it, cached by the schema's canonical hash (sha256 of its sorted, compact JSON).
  It runs off the engine's step loop: the gateway and `AsyncLLM.submit_to` call it in a worker thread
  before the request is queued (llguidance drops the GIL while it builds), so a slow schema delays its
  own request only. A schema it refuses raises ParamError with the library's reason.
- Each request gets its own `GrammarState`, a copy of the cached matcher (1-40 us). Its state is a
  function of the request's output tokens: `sync(tokens)` replays them into a fresh copy whenever the
  two disagree (after preemption and recompute the engine forgets the state and it is rebuilt here).
- Each step, `apply_grammar_masks_` fills one bitmask row per constrained request and sets the logits
  of disallowed tokens to -inf in those rows only, in place; unconstrained rows are not touched.
  After sampling, the scheduler `accept`s the token; a grammar that `is_stopped` (the JSON is closed
  and nothing may follow) ends the request with finish reason "stop". One that is still open at
  max_tokens ends by "length", as OpenAI's API does.

JSON is generated compact (no whitespace between tokens: llguidance's `whitespace_flexible: false`, set
over any `x-guidance` of the schema), so a model cannot spend its max_tokens on blank lines.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from loraplex.engine.sampling_params import ParamError

MAX_CACHED_GRAMMARS = 512  # distinct schemas kept compiled (LRU)
# llguidance's JSON compiler options, applied after a schema's own `x-guidance` (so a client cannot turn
# on flexible whitespace, other separators or `lenient`, which ignores keywords it cannot honour)
_JSON_OVERRIDES = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}


class GrammarError(ValueError):
    """A request's grammar failed while it was generating (the library's parser or lexer limits, a token it
    refused): the schema is beyond what it can follow, and a retry fails the same way."""


def schema_key(schema: dict) -> str:
    """The canonical hash of a JSON Schema: sha256 of its JSON with sorted keys and no whitespace. Raises
    ValueError for NaN or Infinity (not JSON), RecursionError when nested past Python's limit."""
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


class GrammarState:
    """One request's position in its grammar: an llguidance matcher that has consumed exactly the
    request's output tokens so far (`num_consumed` of them)."""

    __slots__ = ("_pristine", "matcher", "num_consumed", "num_rebuilds")

    def __init__(self, pristine):
        self._pristine = pristine
        self.matcher = pristine.deep_copy()
        self.num_consumed = 0
        self.num_rebuilds = 0

    def sync(self, tokens: list[int]) -> None:
        """Bring the matcher to the state after `tokens` (the request's output), replaying them into a
        fresh copy when it has consumed a different number. Raises GrammarError if they break the grammar."""
        if self.num_consumed != len(tokens):
            self.matcher = self._pristine.deep_copy()
            self.num_consumed = 0
            self.num_rebuilds += 1
            if tokens and not self.matcher.consume_tokens(tokens):
                raise GrammarError(f"the output does not follow its grammar: {_reason(self.matcher.get_error())}")
            self.num_consumed = len(tokens)

    def forget(self) -> None:
        """Drop the state (preemption: the request's K/V are recomputed, its matcher rebuilt by `sync`)."""
        self.num_consumed = -1

    def accept(self, token: int) -> None:
        """Advance by one sampled token. Raises GrammarError if the grammar refuses it (a token drawn under
        this state's mask can still exceed the library's limits)."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {_reason(self.matcher.get_error())}")
        self.num_consumed += 1

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows no further token (the JSON value is closed)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()


class StructuredOutputs:
    """Compiles and caches grammars for one engine's tokenizer. Thread-safe: `compile` may run on any
    thread, and a schema compiled concurrently twice is built twice and cached once.

    tokenizer: the model's Hugging Face tokenizer (None: the model has none, and every schema is refused);
    vocab_size: the model's V (logits width, may exceed the tokenizer's); eos_token_ids: the tokens that
    end a request, the ones a complete grammar allows.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_cached: int = MAX_CACHED_GRAMMARS):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.max_cached = max_cached
        self._ll_tokenizer = None
        self._tokenizer_error: str | None = None
        self._limits = None  # llguidance's parser limits, built with the tokenizer
        self._cache: OrderedDict[str, Any] = OrderedDict()  # schema key -> pristine LLMatcher
        self._lock = threading.Lock()
        self.num_compiled = 0  # schemas built (cache misses)
        self.num_cache_hits = 0

    def _tokenizer(self, param: str):
        import llguidance
        import llguidance.hf

        with self._lock:
            if self._ll_tokenizer is None and self._tokenizer_error is None:
                try:
                    if self._hf_tokenizer is None:
                        raise ValueError("this model has no tokenizer")
                    # about 0.3 s for a 49k-token vocabulary, once per engine
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                    # the default fuel: at most about 15 ms of mask work per row and step
                    self._limits = llguidance.LLParserLimits(verbose_errors=False)
                except Exception as exc:  # remembered: every later schema is refused at once, not rebuilt
                    self._tokenizer_error = f"{exc}"
            if self._tokenizer_error is not None:
                raise ParamError(param, f"structured output is not available for this model: "
                                        f"{self._tokenizer_error}")
            return self._ll_tokenizer

    def compile(self, schema: dict, param: str = "json_schema") -> Any:
        """The cached matcher of `schema` (a JSON Schema object), building it on first use: typically
        1-5 ms, more for large schemas. Raises ParamError naming `param` (the gateway's: "response_format")
        with llguidance's reason for a schema it cannot honour: invalid, unsatisfiable, or with
        unimplemented keywords."""
        import llguidance

        if not isinstance(schema, dict):
            raise ParamError(param, f"the JSON schema must be an object, got {type(schema).__name__}")
        try:
            key = schema_key(schema)
        except RecursionError:
            raise ParamError(param, "the JSON schema is nested too deeply") from None
        except ValueError:
            raise ParamError(param, "the JSON schema contains NaN or Infinity, which JSON does not allow") from None
        except TypeError as exc:
            raise ParamError(param, f"the JSON schema cannot be serialized: {exc}") from None
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
        tok = self._tokenizer(param)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OVERRIDES)
        except RecursionError:
            raise ParamError(param, "the JSON schema is nested too deeply") from None
        except ValueError as exc:
            raise ParamError(param, f"invalid JSON schema: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=self._limits)
        if is_error:
            raise ParamError(param, f"invalid JSON schema: {'; '.join(_reason(m) for m in messages)}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ParamError(param, f"invalid JSON schema: {_reason(matcher.get_error())}")
        reason = _probe(matcher, self.vocab_size)
        if reason:
            raise ParamError(param, f"invalid JSON schema: {reason}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, schema: dict) -> GrammarState:
        """A fresh `GrammarState` for one request (ParamError naming "json_schema", as in `compile`)."""
        return GrammarState(self.compile(schema))


def _reason(message: str) -> str:
    """llguidance's error text as one line, without the placeholder its non-verbose mode appends."""
    return " ".join(message.replace("<non-verbose/>", "").split())


def _probe(matcher, vocab_size: int) -> str:
    """Compute `matcher`'s first mask (which builds its lexer here rather than in a step), then, on a
    copy, consume the tokens the grammar forces and compute the next one: the error a grammar that
    validates can still hit there (a $ref that never reaches a value: "NoExtensionBias"; too many
    parser items), or "" when none."""
    words = np.empty(_num_words(vocab_size), dtype=np.int32)
    _fill(matcher, words)
    if matcher.is_error():
        return _reason(matcher.get_error())
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced and probe.consume_tokens(forced):
        _fill(probe, words)
    return _reason(probe.get_error()) if probe.is_error() else ""


def _num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _fill(matcher, words: np.ndarray) -> None:
    """Compute `matcher`'s next-token mask into `words` ([W] int32, bit t % 32 of word t // 32: token t
    allowed)."""
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)


# byte value -> the additive logit bias of its 8 tokens (bit i set: token allowed, +0; clear: -inf): a row's
# [W] bitmask becomes its [V] bias with one index_select, added in place. Fresh [B', V] temporaries cost
# more than the masking itself inside the engine (their pages are faulted in every step): 10 ms per
# 32-row step against 2 ms this way (docs/benchmarks/structured.md).
_BYTE_BIAS = torch.tensor([[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)])


def apply_grammar_masks_(logits: torch.Tensor, requests: list) -> list[int]:
    """logits: [B, V], row i for requests[i]. In place: for each request with a `grammar` (a `GrammarState`,
    brought to its output tokens), the logits of the tokens its grammar disallows become -inf (the others
    gain +0.0); rows without one are not touched. Idempotent. Returns the rows masked. Raises GrammarError
    when a grammar is in an error state (for example, its parser ran out of fuel) or allows no token."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return rows
    vocab = logits.shape[-1]
    words = np.zeros((len(rows), _num_words(vocab)), dtype=np.int32)  # [B', W]
    for j, i in enumerate(rows):
        state = requests[i].grammar
        state.sync(requests[i].output_token_ids)
        _fill(state.matcher, words[j])
        if state.matcher.is_error():
            raise GrammarError(f"the grammar failed: {_reason(state.matcher.get_error())}")
    if not words.any(axis=1).all():
        raise GrammarError("the grammar allows no next token")
    # little-endian words: byte k of a row holds tokens 8k..8k+7, bit i token 8k+i
    codes = torch.from_numpy(words.view(np.uint8)).to(torch.int32)  # [B', 4W]
    bias = torch.empty(codes.shape[1], 8)  # one row's [V] bias (padded to 32W), reused
    with torch.inference_mode():  # the engine's logits are inference tensors
        for j, i in enumerate(rows):
            torch.index_select(_BYTE_BIAS, 0, codes[j], out=bias)
            logits[i].add_(bias.view(-1)[:vocab].to(device=logits.device, dtype=logits.dtype))
    return rows
