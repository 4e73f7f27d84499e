"""Iteration-level scheduler: which requests run in the next forward pass, and how many tokens each.

There is no prefill or decode mode (vLLM v1): each scheduled request's `num_computed_tokens` catches up
with its `num_tokens`; a decode is the case of one token left, a long prompt gets chunks of whatever
token budget is left. Per step:
1. running requests first, oldest first; if the KV cache cannot hold a request's new tokens, the
   newest running request is preempted (blocks freed, recomputed later) until it can;
2. then waiting requests in arrival order, while sequences, tokens, KV blocks and adapter slots last.
   A waiting request takes its cached prefix first (prefix caching, `block_manager`) and is scheduled
   only for the tokens after it.
   A request whose adapter cannot get a slot this step, or is still loading from disk, is skipped
   (vLLM's `max_loras` rule) and does not block the requests behind it; one that does not fit in the
   KV cache stops admission;
3. the adapter manager is handed the waiting queue's adapters (`AdapterManager.step`): it prefetches
   them from disk in arrival order, reserves pages for the oldest one that cannot get any (the policy
   that keeps a cold adapter from starving) and names the adapters whose load failed, whose waiting
   requests end here.
After the forward pass, `update_from_output` registers the blocks the step filled in the prefix cache,
appends each sampled token, applies the stop rules of
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

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.fair_share import FairShare
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


def is_stop_token(req: Request, token: int, eos_token_ids: Collection[int]) -> bool:
    """`token` ends `req` as a stop token (one of its stop_token_ids, or EOS unless `ignore_eos`), so it is
    not part of the text."""
    params = req.sampling_params
    return token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos)


def check_stop(req: Request, token: int, eos_token_ids: Collection[int], max_model_len: int) -> RequestStatus | None:
    """The finished status `req` takes after appending `token`, or None to go on: a stop token (or EOS
    unless `ignore_eos`) stops; `max_tokens` or the model's context ends it by length. Stop strings need
    the text and are the engine's (its detokenizer), checked after this; vLLM's `check_stop` in the same
    place. A request whose grammar is complete stops too (its JSON is closed; only EOS could follow)."""
    if is_stop_token(req, token, eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    params = req.sampling_params
    if req.grammar is not None and req.grammar.is_stopped:
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
                 eos_token_ids: Collection[int] = (), max_model_len: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock  # for priority aging (tests pass their own)
        self.fair = FairShare(cfg.max_num_seqs, cfg.priority_aging_s) if cfg.scheduling_policy == "fair" else None
        self.block_manager = block_manager
        self.adapters = adapters
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len if max_model_len is not None else cfg.max_model_len or 1 << 62
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_time_s = 0.0  # recent seconds per decode-only step (0 until one is timed)
        self.is_kv_limited = False  # the last admission stopped for want of KV blocks
        # per tenant since start: [prompt tokens computed (recompute included), output tokens sampled]
        self.num_tokens_by_tenant: dict[int | None, list[int]] = {}

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        if self.fair is not None:
            self.fair.add(req)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to prefill (preempted ones included)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    @property
    def num_free_places(self) -> int:
        """Places in the batch the next step can admit into: none while admission waits for KV blocks."""
        return 0 if self.is_kv_limited else max(0, self.cfg.max_num_seqs - len(self.running))

    def has_room(self, num_seqs: int, num_tokens: int | None, num_ahead: int = 0, tenant_id: int | None = None,
                 tenant_weight: float = 1.0) -> bool:
        """Whether `num_seqs` more requests of tenant `tenant_id` with `num_tokens` tokens to prefill fit in
        the waiting queue's bounds, behind `num_ahead` requests on their way to it (a server's, between its
        door and submit). The running batch's free places count as room (the next step admits into them),
        and an empty queue takes anything, so a call larger than the bounds still runs when the engine is
        idle. Under the "fair" policy a tenant within its fair share of the bounds (by weight, among the
        tenants with requests) fits even when other tenants have filled them, so one tenant's burst never
        sheds another's calls; the queue then holds at most twice its bounds. num_tokens None skips the token
        bound (its scan of the queue)."""
        if not self.waiting and not num_ahead:
            return True
        cfg, max_wait = self.cfg, self.cfg.max_queue_wait_s
        num_new = num_ahead + num_seqs
        max_seqs = cfg.max_num_waiting_seqs + self.num_free_places
        if (len(self.waiting) + num_new <= max_seqs
                and (num_tokens is None or self.num_waiting_tokens + num_tokens <= cfg.max_num_waiting_tokens)
                and (max_wait is None or self.estimated_wait_s(num_new) <= max_wait)):
            return True
        if self.fair is None:
            return False
        mine = [r for r in self.waiting if r.tenant_id == tenant_id]
        if len(mine) == len(self.waiting):  # the bounds were filled by this tenant alone
            return False
        share = self.fair.waiting_share
        return (len(mine) + num_seqs <= share(tenant_id, tenant_weight, max_seqs)
                and (num_tokens is None or sum(r.num_tokens - r.num_computed_tokens for r in mine) + num_tokens
                     <= share(tenant_id, tenant_weight, cfg.max_num_waiting_tokens)))

    def may_have_room(self, num_ahead: int = 0) -> bool:
        """A hint that is safe to call from another thread (the gateway's door, before it knows the
        caller): False only when no tenant's next request could fit (`has_room`): the queue's bounds
        are full under "fcfs", twice full under "fair"."""
        if self.fair is None:
            return self.has_room(1, None, num_ahead)
        return len(self.waiting) + num_ahead + 1 <= 2 * (self.cfg.max_num_waiting_seqs + self.num_free_places)

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
        priority = None
        if self.fair is not None:  # the token budget goes first to the most urgent, least served tenants
            fair = self.fair
            priority = fair.priorities(itertools.chain(self.running, self.waiting), self.clock())
            self.running.sort(key=lambda r: (priority(r), fair.counter(r.tenant_id), r.admission_seq))
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate(req, num_new):
                victim = self.running[-1] if priority is None else self._kv_victim(priority)
                budget += self._preempt_in_step(out, victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            self._schedule(out, req, num_new)
            budget -= num_new
        num_examined, order = None, self.waiting
        if self.cfg.static_batching and self.running:
            if priority is not None:
                order = list(self.fair.order(self.waiting, priority))
        elif priority is not None:
            # after preempting for KV room only a starved tenant's request is admitted (by preempting in turn)
            num_examined, order = self._admit_fair(out, budget, priority, starved_only=bool(out.preempted))
        elif not out.preempted:
            num_examined = self._admit(out, budget)
        failed = self.adapters.step([r.adapter for r in order], num_examined)
        if failed:
            for req in [r for r in self.waiting if r.adapter in failed]:
                self._end_for_adapter(req, out, f"could not be loaded: {failed[req.adapter]}")
        return out

    def _kv_victim(self, priority: Callable[[Request], int]) -> Request:
        """Under "fair", the running request that gives up its KV blocks: the least urgent, then the newest
        (vLLM's priority policy), whatever its tenant. It loses the least work; taking from the most-served
        tenant instead made two tenants whose requests do not fit together take turns preempting each other
        (test_fair_share.py). Fair share preempts at admission (`_admit_fair`)."""
        return max(self.running, key=lambda r: (priority(r), r.admission_seq))

    def _schedule(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        """Run `num_new` tokens of `req` in this step (charged to its tenant under fair share)."""
        if num_new:
            out.requests.append(req)
            out.num_scheduled_tokens[req.request_id] = num_new
            if self.fair is not None:
                self.fair.charge_prompt(req, num_new)

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
            num_new = self._allocate_waiting(req, budget)
            if num_new is None:
                self.is_kv_limited = True
                break
            if not self._acquire_adapter(req, out):
                continue
            self.waiting.popleft()
            self._start(req)
            self._schedule(out, req, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return len(skipped) + self.is_kv_limited

    def _allocate_waiting(self, req: Request, budget: int) -> int | None:
        """Blocks for waiting `req` (nothing computed): its cached prefix first (prefix caching), then up to
        `budget` tokens after it. Returns the tokens to schedule now, or None (nothing taken) when the KV
        cache is short. A hit counts as computed: it is neither prefilled nor charged to the tenant's
        fair-share counter (served, not computed), while quotas still count the whole prompt (gateway).
        A request that still needs prompt log-probabilities takes no hit: it computes every position
        (vLLM skips the prefix cache for such requests too)."""
        bm = self.block_manager
        looks_up = not req.needs_prompt_logprobs
        hit = bm.computed_blocks(req) if looks_up else []
        num_cached = len(hit) * bm.block_size
        num_new = min(req.num_tokens - num_cached, budget)
        if not bm.allocate(req, num_new, hit):
            return None
        req.num_computed_tokens = num_cached
        req.num_charged_prompt_tokens = max(req.num_charged_prompt_tokens, min(num_cached, req.num_prompt_tokens))
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        if looks_up:  # a request that may not take a hit is not a miss of the cache's
            bm.record_query(req.num_tokens, num_cached)
        return num_new

    def _start(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if self.fair is not None:
            self.fair.admitted(req)

    def _acquire_adapter(self, req: Request, out: SchedulerOutput) -> bool:
        """Pin the adapter of `req` (False: placing it failed, and `req` ended alone)."""
        if req.adapter is not None:
            try:
                req.virtual_slot = self.adapters.acquire(req.adapter)
            except Exception as exc:  # placing this adapter failed: its requests end, the batch goes on
                logger.exception("adapter %r could not be placed in a slot", req.adapter)
                self._end_for_adapter(req, out, f"could not be placed in a slot: {exc}")
                return False
        return True

    def _admit_fair(self, out: SchedulerOutput, budget: int, priority: Callable[[Request], int],
                    starved_only: bool = False) -> tuple[int, list[Request]]:
        """Admit waiting requests in fair-share order (`FairShare.order`), preempting for them where the
        policy allows (`FairShare.victim`); starved_only: only those of tenants with no running request.
        With the step's token budget spent, a starved tenant's request is still admitted (with no tokens
        this step; the next step's running loop serves it before the tenants with larger counters).
        Returns how many it looked at and left in the queue, and the waiting requests in the order the
        adapter manager should see them (those first)."""
        static = self.cfg.static_batching
        self.is_kv_limited = False
        left: list[Request] = []  # looked at and left: no slot for the adapter, or no KV room
        rest: list[Request] = []
        admitted: set[Request] = set()
        just_preempted = set(out.preempted)  # for KV room in this step: not taken back in the same step
        order = (r for r in self.fair.order(self.waiting, priority) if r not in just_preempted)
        for req in order:
            starved = not self.fair.tenants[req.tenant_id].num_running
            if budget == 0 and not static and not starved:
                rest.append(req)
                break
            if starved_only and not starved:
                rest.append(req)
                continue
            if req.adapter is not None and not self.adapters.can_acquire(req.adapter):
                left.append(req)
                continue
            if len(self.running) >= self.cfg.max_num_seqs:
                freed = None if static else self._preempt_for(req, out, admitted, priority)
                if freed is None:
                    rest.append(req)
                    break
                budget += freed
            num_new = self._allocate_waiting(req, budget)
            while num_new is None:
                freed = None if static else self._preempt_for(req, out, admitted, priority)
                if freed is None:
                    self.is_kv_limited = True
                    break
                budget += freed
                num_new = self._allocate_waiting(req, budget)
            if self.is_kv_limited:
                left.append(req)
                break
            if not self._acquire_adapter(req, out):
                continue
            self.waiting.remove(req)
            self._start(req)
            admitted.add(req)
            self._schedule(out, req, num_new)
            budget -= num_new
        preempted = [r for r in out.preempted if r.status == RequestStatus.PREEMPTED]
        return len(left), left + rest + list(order) + preempted

    def _preempt_for(self, req: Request, out: SchedulerOutput, protected: set[Request],
                     priority: Callable[[Request], int]) -> int | None:
        """Preempt the running request that waiting `req` may take the place of (`FairShare.victim`);
        returns the tokens of this step's budget that gives back, or None when there is no such request."""
        victim = self.fair.victim(req, self.running, protected, priority)
        return None if victim is None else self._preempt_in_step(out, victim)

    def _preempt_in_step(self, out: SchedulerOutput, victim: Request) -> int:
        """Preempt running `victim` while step `out` is being planned: it leaves the plan if it was in it,
        and the tokens it had there (returned) go back to the step's budget."""
        freed = out.num_scheduled_tokens.pop(victim.request_id, 0)
        if freed:
            out.requests.remove(victim)
        self._preempt(victim)
        out.preempted.append(victim)
        return freed

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
            served = self.num_tokens_by_tenant.setdefault(req.tenant_id, [0, 0])
            before = req.num_computed_tokens
            req.num_computed_tokens += sched.num_scheduled_tokens[rid]
            served[0] += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - before)
            self.block_manager.cache_full_blocks(req)
            token = tokens.get(rid)
            if token is None and rid not in errors:
                continue  # a prefill chunk short of the prompt's end
            try:
                if rid in errors:
                    raise errors[rid]
                if before_update is not None:
                    before_update(req)
                if req.grammar is not None:
                    req.grammar.accept(token)
                req.output_token_ids.append(token)
                served[1] += 1
                if self.fair is not None:
                    self.fair.charge_output(req)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = check_stop(req, token, self.eos_token_ids, self.max_model_len)
                if status is not None:
                    self.finish(req, status)
                update.new_tokens.append((req, token))
            except Exception as exc:
                update.failed.append((req, exc))
        return update

    def tenant_stats(self) -> dict[int | None, dict]:
        """Per tenant seen: waiting and running requests now, prompt and output tokens computed since start,
        and under "fair" its fair-share counter and weight (`FairShare.tenant_stats`)."""
        stats: dict[int | None, dict] = {}

        def of(key):
            return stats.setdefault(key, {"num_waiting": 0, "num_running": 0, "num_prompt_tokens": 0,
                                          "num_output_tokens": 0, "counter": None, "weight": None})

        for r in self.waiting:
            of(r.tenant_id)["num_waiting"] += 1
        for r in self.running:
            of(r.tenant_id)["num_running"] += 1
        for key, (num_prompt, num_output) in list(self.num_tokens_by_tenant.items()):
            of(key).update(num_prompt_tokens=num_prompt, num_output_tokens=num_output)
        for key, t in (self.fair.tenant_stats() if self.fair is not None else {}).items():
            of(key).update(counter=t["counter"], weight=t["weight"])
        return stats

    def _preempt(self, req: Request) -> None:
        """Free everything `req` holds; it goes back to the front of the queue and is recomputed."""
        self.running.remove(req)
        self.block_manager.free(req)
        self._release_adapter(req)
        if self.fair is not None:
            self.fair.preempted(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if req.grammar is not None:
            req.grammar.forget()  # rebuilt from its output tokens when it next samples
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release_adapter(self, req: Request) -> None:
        if req.virtual_slot >= 0:
            self.adapters.release(req.adapter)
            req.virtual_slot = -1

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark `req` finished and free its KV blocks and adapter pin in this same step."""
        if self.fair is not None and not req.is_finished:
            self.fair.finished(req, was_running=req.status == RequestStatus.RUNNING)
        req.status = status
        req.finish_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        self._release_adapter(req)
