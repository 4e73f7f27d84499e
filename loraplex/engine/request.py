"""One request's state and what the user gets back; its `SamplingParams` are in `sampling_params.py`."""

from __future__ import annotations

import enum
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loraplex.engine.sampler import TokenLogprobs
    from loraplex.engine.structured_output import GrammarState

__all__ = ["FINISH_REASONS", "Request", "RequestOutput", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

_ids = itertools.count()


@dataclass(eq=False)  # identity: queues remove and find requests by object, not by field values
class Request:
    """A prompt, its generated tokens and the engine's bookkeeping.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the scheduler brings it up to
    `num_tokens` (prompt + output), which covers chunked prefill and recompute after preemption alike.
    Times are `time.monotonic()` seconds.
    """

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    adapter: str | None = None
    tenant_id: int | None = None  # the gateway's tenant (None: no tenant, as through the LLM API)
    tenant_weight: float = 1.0  # its tenant's fair-share weight (quota field `weight`) when it was queued
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)  # one per output token if asked
    # if `SamplingParams.prompt_logprobs` asks: prompt token i's entry at index i (None for token 0), as far
    # as computed; complete before the first output token is sampled, and never recomputed after preemption
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list, repr=False)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    virtual_slot: int = -1  # its adapter's virtual slot (first page in the slot tier) while pinned, else -1
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    seed: int = 0
    error: str | None = None  # why the engine ended it early (status FINISHED_ABORTED), for the caller
    adapter_failed: bool = False  # that reason is its adapter's load or placement (nothing ran)
    num_charged_prompt_tokens: int = 0  # prompt positions charged to its tenant's fair-share counter
    admission_seq: int = -1  # when it last entered the batch, in admission order (fair share's "newest")
    # prefix caching (`block_manager`): the weights its K/V depend on ("base" or its adapter's content
    # digest; None: keyed by the adapter's name), its blocks' keys as far as computed, how many blocks of
    # its table were offered to the cache, and the tokens found cached at its first admission (-1: not yet)
    kv_identity: str | None = None
    block_keys: list[bytes] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1
    grammar: GrammarState | None = field(default=None, repr=False)  # its json_schema's matcher state, if any

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first prompt token has no context to be scored on
        if self.sampling_params.seed is None:
            self.seed = random.getrandbits(63)
        else:
            self.seed = self.sampling_params.seed

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt log-probabilities and some are not computed yet: it may not take its prompt's
        K/V from the prefix cache (their positions' hidden states are needed)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_logprob_rows(self, start: int, end: int) -> range:
        """Of positions start..end-1 about to be computed, those whose hidden state scores a prompt token
        not scored yet (position p scores token p + 1): empty unless prompt log-probabilities are asked."""
        if self.sampling_params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, self.num_prompt_tokens - 1))

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


class RequestOutput:
    """What `LLM.generate` returns per prompt, and each streamed delta of `AsyncLLM.generate`.

    token_ids/text: everything generated so far; delta_token_ids/delta_text: what this output adds.
    ttft_s: seconds from arrival to the first output token; latency_s: arrival to finish.
    error: set when the engine ended the request because of a fault of its own (finish_reason "abort"):
    a failed adapter load, an exception in this request's sampling, stop check or detokenization, or a
    failed forward pass. None for a request aborted by its caller. adapter_failed: the error is its
    adapter's load or placement, so nothing of it ran. num_cached_tokens: prompt tokens whose K/V came
    from the prefix cache at its first admission (0: none, or caching off; OpenAI's
    `usage.prompt_tokens_details.cached_tokens`). logprobs: None unless `SamplingParams.logprobs` asked,
    else one `sampler.TokenLogprobs` per token of `token_ids` (delta_logprobs: those of delta_token_ids).
    prompt_logprobs: None unless `SamplingParams.prompt_logprobs` asked, else one entry per prompt token,
    None for the first (vLLM's shape), each a `TokenLogprobs` whose `top` holds the most likely tokens at
    that position; complete in every output that has a token or finished normally, shorter only in the
    last output of a request aborted during its prefill. Every output of a request shares the one list.

    The engine builds one output per request per step, so `token_ids` and `text` may be given as
    functions (an unfinished request's prefix of its output list, its detokenizer's `snapshot`) and are
    built on first read: a step costs O(1) per request, not a copy of the whole output (vLLM's
    streaming outputs carry only deltas for the same reason).
    """

    __slots__ = ("request_id", "prompt_token_ids", "_token_ids", "_text", "finish_reason", "adapter", "ttft_s",
                 "latency_s", "delta_text", "delta_token_ids", "error", "adapter_failed", "num_cached_tokens",
                 "_logprobs", "delta_logprobs", "prompt_logprobs")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 token_ids: list[int] | Callable[[], list[int]], text: str | Callable[[], str],
                 finish_reason: str | None, adapter: str | None, ttft_s: float | None = None,
                 latency_s: float | None = None, delta_text: str = "", delta_token_ids: list[int] | None = None,
                 error: str | None = None, adapter_failed: bool = False, num_cached_tokens: int = 0,
                 logprobs: list | Callable[[], list] | None = None, delta_logprobs: list | None = None,
                 prompt_logprobs: list | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = token_ids
        self._text = text
        self.finish_reason = finish_reason
        self.adapter = adapter
        self.ttft_s = ttft_s
        self.latency_s = latency_s
        self.delta_text = delta_text
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self.error = error
        self.adapter_failed = adapter_failed
        self.num_cached_tokens = num_cached_tokens
        self._logprobs = logprobs
        self.delta_logprobs = delta_logprobs
        self.prompt_logprobs = prompt_logprobs

    @property
    def token_ids(self) -> list[int]:
        if callable(self._token_ids):
            self._token_ids = self._token_ids()
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        if callable(self._logprobs):
            self._logprobs = self._logprobs()
        return self._logprobs

    @property
    def text(self) -> str:
        if callable(self._text):
            self._text = self._text()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.text, self.finish_reason, self.adapter,
                self.ttft_s, self.latency_s, self.delta_text, self.delta_token_ids, self.error, self.adapter_failed,
                self.num_cached_tokens, self.logprobs, self.delta_logprobs, self.prompt_logprobs)

    def __reduce__(self):  # pickled with its lists built (the functions of an unfinished one do not pickle)
        return RequestOutput, self._fields()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and self._fields() == other._fields()

    __hash__ = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, text={self.text!r}, "
                f"finish_reason={self.finish_reason!r}, adapter={self.adapter!r}, error={self.error!r})")


def output_prefix(tokens: list[int]) -> Callable[[], list[int]]:
    """A function giving the first len(tokens) items of the append-only `tokens` as they are now."""
    n = len(tokens)
    return lambda: tokens[:n]
