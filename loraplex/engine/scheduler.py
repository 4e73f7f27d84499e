"""Iteration-level scheduler: which requests run in the next forward pass, and how many tokens each.

There is no prefill or decode mode (vLLM v1): each scheduled request's `num_computed_tokens` catches up
with its `num_tokens`; a decode is the case of one token left, a long prompt gets chunks of whatever
token budget is left. Per step:
1. running requests first, oldest first; if the KV cache cannot hold a request's new tokens, the
   newest running request is preempted (blocks freed, recomputed later) until it can;
2. then waiting requests in arrival order, while sequences, tokens, KV blocks and adapter slots last.
   A request whose adapter cannot get a slot this step, or is still loading from disk, is skipped
   (vLLM's `max_loras` rule) and does not block the requests behind it; one that does not fit in the
   KV cache stops admission;
3. the adapter manager is handed the waiting queue's adapters (`AdapterManager.step`): it prefetches
   them from disk in arrival order, reserves pages for the oldest one that cannot get any (the policy
   that keeps a cold adapter from starving) and names the adapters whose load failed, whose waiting
   requests end here.
After the forward pass, `update_from_output` appends each sampled token, applies the stop rules of
`check_stop` and frees what finished requests hold (vLLM v1's split: the engine only calls the two).
The scheduler sees the adapter manager through four methods only (`can_acquire`, `acquire`, `release`,
`step`), the allocator verbs of the KV block manager plus the per-step hand-over.

A server asks `has_room` before it queues a call: the waiting queue is bounded in requests, in tokens
still to prefill (`EngineConfig.max_num_waiting_*`) and in the estimated wait for a place in the batch
(`max_queue_wait_s`), so overload is refused at once instead of queued for longer than a client waits.
The estimate is an upper bound for requests that may stop early (EOS): the running requests' remaining
max_tokens, in order, times the recent time of a decode step (an exponential average over the steps
that only decode, which the engine feeds; a prefill chunk's step says little about the next decodes).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

STEP_TIME_DECAY = 0.9  # weight of the old value in the step time's exponential average


class AdapterSlots(Protocol):
    """What the scheduler needs of the adapter manager (`loraplex.adapters.AdapterManager`)."""

    def can_acquire(self, name: str) -> bool:
        """Whether a request for adapter `name` can be admitted now (a slot for it is free or evictable)."""

    def acquire(self, name: str) -> int | None:
        """Pin `name` in a slot and return its virtual slot; None if `can_acquire` says no. May raise
        if placing it fails (that request alone ends)."""

    def release(self, name: str) -> None:
        """Unpin one use of `name`."""

    def step(self, waiting: Sequence[str | None], num_examined: int | None) -> dict[str, str]:
        """Once per step, after admission: the adapters of the waiting requests in queue order, of which
        admission looked at the first `num_examined` (None: admission did not run this step). Returns
        the adapters whose load failed, with the reason."""


def check_stop(req: Request, token: int, eos_token_ids: Collection[int], max_model_len: int) -> RequestStatus | None:
    """The finished status `req` takes after appending `token`, or None to go on: a stop token (or EOS
    unless `ignore_eos`) stops; `max_tokens` or the model's context ends it by length. Stop strings need
    the text and are the engine's (its detokenizer), checked after this; vLLM's `check_stop` in the same
    place."""
    params = req.sampling_params
    if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= params.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


@dataclass
class SchedulerOutput:
    """One step's plan: requests in row order and the number of tokens each runs."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)  # e.g. their adapter failed to load

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class StepUpdate:
    """What `update_from_output` did: the requests that got a token, in row order with it, and those whose
    update raised (each to be ended alone with its exception)."""

    new_tokens: list[tuple[Request, int]] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


class Scheduler:
    """Holds the waiting and running queues; the engine calls `schedule`, then `update_from_output`.

    eos_token_ids and max_model_len are the model's, for the stop rules (`check_stop`)."""

    def __init__(self, cfg: EngineConfig, block_manager: BlockManager, adapters: AdapterSlots,
                 eos_token_ids: Collection[int] = (), max_model_len: int | None = None):
        self.cfg = cfg
        self.block_manager = block_manager
        self.adapters = adapters
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len if max_model_len is not None else cfg.max_model_len or 1 << 62
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_time_s = 0.0  # recent seconds per decode-only step (0 until one is timed)
        self.is_kv_limited = False  # the last admission stopped for want of KV blocks

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to prefill (preempted ones included)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    @property
    def num_free_places(self) -> int:
        """Places in the batch the next step can admit into: none while admission waits for KV blocks."""
        return 0 if self.is_kv_limited else max(0, self.cfg.max_num_seqs - len(self.running))

    def has_room(self, num_seqs: int, num_tokens: int | None, num_ahead: int = 0) -> bool:
        """Whether `num_seqs` more requests with `num_tokens` tokens to prefill fit in the waiting queue's
        bounds, behind `num_ahead` requests on their way to it (a server's, between its door and submit).
        The running batch's free places count as room (the next step admits into them), and an empty queue
        takes anything, so a call larger than the bounds still runs when the engine is idle. num_tokens
        None skips the token bound (its scan of the queue), which makes this safe to call from another
        thread, as a hint: the gateway does, to shed before it reads a request."""
        if not self.waiting and not num_ahead:
            return True
        max_wait = self.cfg.max_queue_wait_s
        num_new = num_ahead + num_seqs
        return (len(self.waiting) + num_new <= self.cfg.max_num_waiting_seqs + self.num_free_places
                and (num_tokens is None or self.num_waiting_tokens + num_tokens <= self.cfg.max_num_waiting_tokens)
                and (max_wait is None or self.estimated_wait_s(num_new) <= max_wait))

    def estimated_wait_s(self, num_seqs: int) -> float:
        """Seconds until the last of `num_seqs` new requests, queued behind the waiting ones, gets a place
        in the batch: place k frees when the running request with the k-th fewest tokens left ends
        (after a whole round of the batch, the longest stands in for the requests then running). Safe to
        call from another thread (it reads one snapshot of the running list)."""
        running = list(self.running)
        need = len(self.waiting) + num_seqs - self.num_free_places
        if need <= 0 or not running:
            return 0.0
        left = sorted(r.sampling_params.max_tokens - r.num_output_tokens for r in running)
        rounds, k = divmod(need - 1, len(left))
        return (rounds * left[-1] + left[k]) * self.step_time_s

    def observe_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        """Fold the wall time of step `out` into `step_time_s` if the step only decoded (the engine calls
        it after each step that ran)."""
        if any(n != 1 for n in out.num_scheduled_tokens.values()):
            return
        if self.step_time_s == 0.0:
            self.step_time_s = seconds
        else:
            self.step_time_s = STEP_TIME_DECAY * self.step_time_s + (1 - STEP_TIME_DECAY) * seconds

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            out.requests.append(req)
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
        num_examined = None
        if not (out.preempted or (self.cfg.static_batching and self.running)):
            num_examined = self._admit(out, budget)
        failed = self.adapters.step([r.adapter for r in self.waiting], num_examined)
        if failed:
            for req in [r for r in self.waiting if r.adapter in failed]:
                self._end_for_adapter(req, out, f"could not be loaded: {failed[req.adapter]}")
        return out

    def _end_for_adapter(self, req: Request, out: SchedulerOutput, reason: str) -> None:
        """End `req` because its adapter could not be loaded or placed (nothing of it ran)."""
        req.error = f"adapter {req.adapter!r} {reason}"
        req.adapter_failed = True
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        out.aborted.append(req)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in arrival order into `out`; returns how many requests at the head of
        the queue it looked at and left there (skipped for their adapter, or stopped at for KV blocks)."""
        # Static batching (a benchmark baseline) admits a whole batch at once, even requests whose
        # prefill must wait for a later step's token budget.
        skipped: list[Request] = []
        self.is_kv_limited = False
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            if budget == 0 and not self.cfg.static_batching:
                break
            req = self.waiting[0]
            if req.adapter is not None and not self.adapters.can_acquire(req.adapter):
                skipped.append(self.waiting.popleft())
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.block_manager.allocate(req, num_new):
                self.is_kv_limited = True
                break
            self.waiting.popleft()
            if req.adapter is not None:
                try:
                    req.virtual_slot = self.adapters.acquire(req.adapter)
                except Exception as exc:  # placing this adapter failed: its requests end, the batch goes on
                    logger.exception("adapter %r could not be placed in a slot", req.adapter)
                    self._end_for_adapter(req, out, f"could not be placed in a slot: {exc}")
                    continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if num_new:
                out.requests.append(req)
                out.num_scheduled_tokens[req.request_id] = num_new
                budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return len(skipped) + self.is_kv_limited

    def update_from_output(self, sched: SchedulerOutput, tokens: dict[str, int], errors: dict[str, Exception],
                           before_update: Callable[[Request], None] | None = None) -> StepUpdate:
        """After the forward pass of `sched`: count the computed tokens, append each request's sampled token
        (`tokens` by request id), finish the requests `check_stop` ends (their KV blocks and adapter pin
        are freed now). A request in `errors` (its sampling raised), or whose update raises (including
        `before_update(req)`, a test hook), is returned in `failed` and left for the caller to end."""
        update = StepUpdate()
        now = time.monotonic()
        for req in sched.requests:
            rid = req.request_id
            req.num_computed_tokens += sched.num_scheduled_tokens[rid]
            token = tokens.get(rid)
            if token is None and rid not in errors:
                continue  # a prefill chunk short of the prompt's end
            try:
                if rid in errors:
                    raise errors[rid]
                if before_update is not None:
                    before_update(req)
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = check_stop(req, token, self.eos_token_ids, self.max_model_len)
                if status is not None:
                    self.finish(req, status)
                update.new_tokens.append((req, token))
            except Exception as exc:
                update.failed.append((req, exc))
        return update

    def _preempt(self, req: Request) -> None:
        """Free everything `req` holds; it goes back to the front of the queue and is recomputed."""
        self.running.remove(req)
        self.block_manager.free(req)
        self._release_adapter(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release_adapter(self, req: Request) -> None:
        if req.virtual_slot >= 0:
            self.adapters.release(req.adapter)
            req.virtual_slot = -1

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark `req` finished and free its KV blocks and adapter pin in this same step."""
        req.status = status
        req.finish_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        self._release_adapter(req)
