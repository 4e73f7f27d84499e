"""`SamplingParams` and the one set of range checks behind it.

The OpenAI schemas of the gateway call the same `check_*` functions on the request's fields (so an
API user and a Python user are refused by the same rule with the same message), and `SamplingParams`
calls them again in `__post_init__`. Checks that need the model (top_k and stop token ids against the
vocabulary) are `SamplingParams.check_vocab`, which `LLMEngine.add_request` calls.

Ranges follow vLLM's `SamplingParams` and OpenAI's API where they agree: temperature in [0, 2] (OpenAI's
range), top_p in (0, 1], top_k -1 or 0 (off, as vLLM) or 1..vocab (a larger k is refused, not clamped: it
is a client's mistake worth telling), seed a signed 64-bit integer (vLLM's bound).
Every refusal is a `ParamError`: a ValueError that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TEMPERATURE = 2.0
MAX_NUM_STOP = 16  # stop strings per request
MAX_STOP_LENGTH = 256  # characters per stop string (the detokenizer holds back len - 1 of them)
MAX_NUM_STOP_TOKEN_IDS = 64
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # vLLM takes any int; a 32-bit range is plenty
MAX_LOGPROBS = 20  # top log-probabilities per output token (OpenAI's top_logprobs bound)


class ParamError(ValueError):
    """A sampling or request field out of range; `param` is its name (OpenAI's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_max_tokens(v, name: str = "max_tokens") -> int:
    if not _is_int(v) or v < 1:
        raise ParamError(name, f"{name} must be an integer >= 1, got {v!r}")
    return v


def check_temperature(v) -> float:
    if not _is_number(v) or not math.isfinite(v) or not 0 <= v <= MAX_TEMPERATURE:
        raise ParamError("temperature", f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {v!r}")
    return float(v)


def check_top_p(v) -> float:
    if not _is_number(v) or not math.isfinite(v) or not 0 < v <= 1:
        raise ParamError("top_p", f"top_p must be a number in (0, 1], got {v!r}")
    return float(v)


def check_top_k(v, vocab_size: int | None = None) -> int:
    """-1 or 0 keep every token (returned as -1); otherwise 1..vocab_size (any k >= 1 while the vocabulary
    is unknown)."""
    upper = "vocab_size" if vocab_size is None else str(vocab_size)
    if not _is_int(v) or not (v in (-1, 0) or 1 <= v <= (vocab_size or v)):
        raise ParamError("top_k", f"top_k must be -1 or 0 (off) or an integer in [1, {upper}], got {v!r}")
    return -1 if v == 0 else v


def check_seed(v) -> int | None:
    if v is not None and (not _is_int(v) or not SEED_MIN <= v <= SEED_MAX):
        raise ParamError("seed", f"seed must be an integer in [-2**63, 2**63 - 1], got {v!r}")
    return v


def check_priority(v) -> int:
    if not _is_int(v) or not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise ParamError("priority", f"priority must be an integer in [-2**31, 2**31 - 1], got {v!r}")
    return v


def check_logprobs(v, name: str = "logprobs", upper: int = MAX_LOGPROBS) -> int | None:
    """None (no log-probabilities) or the number of most likely tokens to report with each output (or
    prompt) token's, 0..upper."""
    if v is not None and (not _is_int(v) or not 0 <= v <= upper):
        raise ParamError(name, f"{name} must be an integer in [0, {upper}], got {v!r}")
    return v


def check_text(text: str, param: str) -> str:
    """`text` if it is valid Unicode; a lone UTF-16 surrogate (JSON's "\\ud800", which Python's JSON parser
    reads) cannot be encoded or tokenized: ParamError naming `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(param, f"{param} contains a lone UTF-16 surrogate ({text[exc.start]!r} at index "
                                f"{exc.start}), which is not valid Unicode") from None
    return text


def check_stop(v) -> list[str]:
    """None, one string or a list of strings -> the non-empty stop strings."""
    stops = [v] if isinstance(v, str) else v
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", f"stop must be a string or a list of strings, got {type(v).__name__}")
    if len(stops) > MAX_NUM_STOP:
        raise ParamError("stop", f"stop takes at most {MAX_NUM_STOP} strings, got {len(stops)}")
    for s in stops:
        check_text(s, "stop")
        if len(s) > MAX_STOP_LENGTH:
            raise ParamError("stop", f"each stop string has at most {MAX_STOP_LENGTH} characters, got one of "
                                     f"{len(s)}")
    return [s for s in stops if s]


def check_stop_token_ids(v, vocab_size: int | None = None) -> list[int]:
    ids = list(v or [])
    if len(ids) > MAX_NUM_STOP_TOKEN_IDS:
        raise ParamError("stop_token_ids", f"stop_token_ids takes at most {MAX_NUM_STOP_TOKEN_IDS} ids, "
                                           f"got {len(ids)}")
    upper = vocab_size if vocab_size is not None else SEED_MAX
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < upper), None)
    if bad is not None:
        bound = "vocab_size" if vocab_size is None else str(vocab_size)
        raise ParamError("stop_token_ids", f"stop_token_ids must be token ids in [0, {bound}), got {bad!r}")
    return ids


@dataclass
class SamplingParams:
    """How to pick each output token (the vLLM / OpenAI knobs).

    temperature 0 is greedy; top_k -1 (or 0) keeps every token; seed makes sampling reproducible in any batch
    (the noise of output token n depends only on seed and n). stop strings end the text and are not
    included; stop_token_ids end generation like EOS (the token is not in the text); ignore_eos keeps
    generating to max_tokens (benchmarks). priority: lower runs first (vLLM's extension, default 0), under
    the scheduler's "fair" policy (`loraplex.engine.fair_share`); "fcfs" ignores it. logprobs: None, or
    report each output token's log-probability with the `logprobs` most likely tokens' (0..20; vLLM's
    field, its default "raw_logprobs": the model's logits before temperature, top-k and top-p;
    `RequestOutput.logprobs`). prompt_logprobs: None, or report the log-probability of every prompt token
    after the first (given the tokens before it) with the `prompt_logprobs` most likely tokens' (0..20;
    vLLM's field; `RequestOutput.prompt_logprobs`). Such a request computes its whole prompt: its logits
    need every position's hidden state, so it takes nothing from the prefix cache until they are all
    computed. json_schema: None, or a JSON Schema object the output must follow
    (constrained decoding, `loraplex.engine.structured_output`; `{"type": "object"}` is OpenAI's
    json_object mode); the output ends with "stop" when the JSON value closes, with "length" if it is
    still open at max_tokens. Raises ParamError (a ValueError) for out-of-range values; a schema the
    grammar library refuses raises it when the request is added.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | None = None

    def __post_init__(self) -> None:
        check_max_tokens(self.max_tokens)
        self.temperature = check_temperature(self.temperature)
        self.top_p = check_top_p(self.top_p)
        self.top_k = check_top_k(self.top_k)
        check_seed(self.seed)
        self.stop = check_stop(self.stop)
        self.stop_token_ids = check_stop_token_ids(self.stop_token_ids)
        check_priority(self.priority)
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ParamError("json_schema", f"json_schema must be a JSON Schema object (a dict) or None, got "
                                            f"{type(self.json_schema).__name__}")

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: top_k and stop token ids against the vocabulary."""
        check_top_k(self.top_k, vocab_size)
        check_stop_token_ids(self.stop_token_ids, vocab_size)

    @property
    def is_greedy(self) -> bool:
        # Below 1e-5, logits / temperature overflows; vLLM treats such temperatures as greedy too.
        return self.temperature < 1e-5
