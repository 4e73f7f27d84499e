"""Admission: one atomic check of every per-tenant limit, turned into OpenAI's 429s and headers.

`admit` reserves prompt tokens + max_tokens; `settle` gives back what the request did not use and frees
its concurrency slots. A slot has a lease (`lease_s`, 60 s by default) that the process running the call
renews every third of it (a heartbeat lease, as Redis's distributed-lock pattern extends its locks): a
process that dies (killed, out of memory, a Ray ingress lost) frees its calls' slots within one lease,
and a call may run for as long as it likes. The trade: a process cut off from Redis for longer than the
lease has its calls' slots expire there, so other processes may admit up to the limit meanwhile; the
slots come back when it reaches Redis again, and the tenant runs over its limit until those calls end.

With Redis unreachable, `fail_mode` "open" falls back to this process's own counters (a local limit) and
"closed" refuses with 503; a tenant with a token budget is refused either way (budgets fail closed: a
local counter cannot know what other processes spent). A settle that cannot reach Redis, or that a
failing-over Redis turns away (READONLY, TRYAGAIN, CLUSTERDOWN, MASTERDOWN, LOADING), is sent again until
it lands (from `RESETTLE_S` apart, at most `MAX_UNSETTLED` held; `close` tries them once more and logs
what it drops): otherwise the tenant's unused tokens would stay charged and its slots held for a lease.
Sending it twice is safe: the backends give back only once per admitted request (its open ticket).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.platform.errors import APIError, insufficient_quota, unavailable
from loraplex.platform.models import utcnow
from loraplex.platform.quotas.limits import (
    BUDGET,
    CONCURRENCY,
    NEED_SEED,
    REQUESTS,
    TOO_LARGE,
    Decision,
    Limits,
    budget_period,
    format_duration,
    gcra_remaining,
    keys,
)
from loraplex.platform.quotas.memory import MemoryBackend

logger = logging.getLogger(__name__)

RESETTLE_S = 0.5  # first wait before a settle that could not reach Redis is sent again; doubles up to 8 s
RENEW_RETRY_MAX_S = 2.0  # longest wait between renewals while they fail (a failed try costs little)
MAX_UNSETTLED = 100_000  # settles held for Redis to come back (past it the oldest are dropped: their leases expire)


@dataclass
class Ticket:
    """An admitted request's reservation; hand it back to `settle` exactly once."""

    tenant_id: int
    limits: Limits
    request_id: str
    cost: int
    keys: list[str]
    backend: object
    headers: dict[str, str] = field(default_factory=dict)
    num_slots: int = 1  # concurrency slots held: the call's sequences


@dataclass(frozen=True)
class CurrentUse:
    """A tenant's use of its limits right now: requests and tokens held in its one-minute buckets (they
    refill continuously), and requests in flight. None where no limit is set (nothing is counted then)."""

    num_requests: int | None
    num_tokens: int | None
    num_concurrent: int | None


def rate_limit_headers(limits: Limits, d: Decision) -> dict[str, str]:
    headers = {}
    for what, limit in (("requests", limits.rpm), ("tokens", limits.tpm)):
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{what}"] = str(limit)
        headers[f"x-ratelimit-remaining-{what}"] = str(getattr(d, f"remaining_{what}"))
        headers[f"x-ratelimit-reset-{what}"] = format_duration(getattr(d, f"reset_{what}_ms"))
    return headers


class QuotaService:
    def __init__(self, backend, *, fail_mode: str = "open", lease_s: float = 60.0,
                 budget_seed: Callable[[int, object], int] | None = None):
        """backend: a RedisBackend or MemoryBackend. lease_s: how long a concurrency slot outlives the last
        renewal by its process (renewed every lease_s / 3). budget_seed(tenant_id, period_start_date) ->
        tokens used so far in the period according to the database (blocking; run in a thread)."""
        self.backend = backend
        self.local = backend if isinstance(backend, MemoryBackend) else MemoryBackend()
        self.fail_mode = fail_mode
        self.lease_ms = lease_s * 1000.0
        self.budget_seed = budget_seed or (lambda tenant_id, start: 0)
        self.degraded = False  # True while Redis is unreachable
        self._unsettled: collections.deque[tuple[Ticket, int, bool]] = collections.deque(maxlen=MAX_UNSETTLED)
        self._resettler: asyncio.Task | None = None
        self._running: dict[str, Ticket] = {}  # admitted, not yet settled, holding concurrency slots
        self._renewer: asyncio.Task | None = None
        self._lost: set[str] = set()  # running calls the store had no ticket for (warned once each)

    async def admit(self, tenant_id: int, limits: Limits, cost: int, request_id: str,
                    num_sequences: int = 1, sequences_param: str = "n") -> Ticket:
        """Reserve `cost` tokens and `num_sequences` concurrency slots for `request_id`, or raise the
        APIError to send (`sequences_param`: the field a call of too many sequences is blamed on)."""
        cc_limit = limits.max_concurrent_requests
        if cc_limit is not None and num_sequences > cc_limit:
            raise APIError(429, f"Request too large for concurrent requests: Limit {cc_limit}, Requested "
                           f"{num_sequences} sequences (n x prompts). Reduce n or the prompt list.",
                           type="requests", code="rate_limit_exceeded", param=sequences_param)
        now = utcnow()
        period = budget_period(limits.budget_period, now)
        ks = keys(tenant_id, period)
        ttl_ms = ((period.end - now).total_seconds() + 86400) * 1000.0
        backend = self.backend
        try:
            d = await backend.admit(ks, limits, cost, request_id, lease_ms=self.lease_ms, budget_ttl_ms=ttl_ms,
                                    num_slots=num_sequences)
            if d.reason == NEED_SEED:
                seed = await asyncio.to_thread(self.budget_seed, tenant_id, period.start)
                d = await backend.admit(ks, limits, cost, request_id, lease_ms=self.lease_ms,
                                        budget_ttl_ms=ttl_ms, budget_seed=seed, num_slots=num_sequences)
            self._set_degraded(False)
        except Exception as exc:
            if backend is self.local or not _unreachable(exc):
                raise
            self._set_degraded(True, exc)
            if self.fail_mode == "closed":
                raise unavailable("The quota store is unreachable; try again shortly.",
                                  code="quota_store_unavailable") from None
            if limits.token_budget is not None:
                raise unavailable("The quota store is unreachable and this tenant has a token budget, "
                                  "which cannot be checked locally; try again shortly.",
                                  code="quota_store_unavailable") from None
            backend = self.local
            d = await backend.admit(ks, limits, cost, request_id, lease_ms=self.lease_ms, budget_ttl_ms=ttl_ms,
                                    num_slots=num_sequences)
        if not d.allowed:
            raise self._refusal(limits, cost, d, period)
        ticket = Ticket(tenant_id, limits, request_id, cost, ks, backend, rate_limit_headers(limits, d),
                        num_sequences)
        if cc_limit is not None:
            self._running[request_id] = ticket
            if self._renewer is None or self._renewer.done():
                self._renewer = asyncio.get_running_loop().create_task(self._renew())
        return ticket

    async def settle(self, ticket: Ticket, num_tokens_used: int, *, ran: bool = True) -> None:
        """Free the concurrency slots and refund the unused reservation; ran=False (the engine shed the call
        or refused it before anything ran) also gives back its unit of the RPM bucket. Never raises."""
        refund = max(0, ticket.cost - num_tokens_used)
        self._running.pop(ticket.request_id, None)  # renewed no more: held settles' slots expire in one lease
        self._lost.discard(ticket.request_id)
        try:
            await _send(ticket, refund, ran)
        except Exception as exc:
            if ticket.backend is self.local or not _retryable(exc):  # lost: the lease and buckets catch up
                logger.warning("could not settle quota of request %s: %s", ticket.request_id, exc)
                return
            logger.warning("could not settle quota of request %s (%r); sending it again once Redis answers",
                           ticket.request_id, exc)
            if len(self._unsettled) == self._unsettled.maxlen:
                dropped = self._unsettled.popleft()[0]
                logger.error("too many quota settles held (%d): dropped request %s's (tenant %d; its slots "
                             "free at their lease's end)", len(self._unsettled) + 1, dropped.request_id,
                             dropped.tenant_id)
            self._unsettled.append((ticket, refund, ran))
            if self._resettler is None or self._resettler.done():
                self._resettler = asyncio.get_running_loop().create_task(self._resettle())

    async def _renew(self) -> None:
        """While calls run, extend their slots' leases every lease / 3, each backend's tenants in a few
        pipelined round trips. After a failed pass (the store unreachable, or turning writes away while it
        fails over) it tries again every RESETTLE_S to RENEW_RETRY_MAX_S, so the slots are back within about
        2 s of the store answering; the Redis calls and the local fallback's (admitted while Redis was
        down) are renewed apart, so one never holds up the other."""
        beat_s = self.lease_ms / 3000.0
        wait, unreachable = beat_s, False
        while self._running:
            await asyncio.sleep(wait)
            by_backend: dict[int, tuple[object, dict[str, list[Ticket]]]] = {}
            for t in list(self._running.values()):
                by_backend.setdefault(id(t.backend), (t.backend, {}))[1].setdefault(t.keys[2], []).append(t)
            failed = False
            for backend, groups in by_backend.values():
                tenants = list(groups.values())
                try:
                    results = await backend.renew([(g[0].keys, [(t.request_id, t.num_slots) for t in g])
                                                   for g in tenants], self.lease_ms)
                except Exception as exc:
                    if not unreachable:
                        logger.warning("could not renew the concurrency leases of %d running call(s): %r; trying "
                                       "again", sum(map(len, tenants)), exc)
                    failed = True
                    continue
                self._report(tenants, results)
            if unreachable and not failed:
                logger.info("concurrency leases renewed again")
            wait = min(2 * wait if unreachable else RESETTLE_S, RENEW_RETRY_MAX_S, beat_s) if failed else beat_s
            unreachable = failed

    def _report(self, tenants: list[list[Ticket]], results: list) -> None:
        """One line per pass for the tenants whose renewal failed; one per call that has no open ticket
        (the store lost its data), the first time only."""
        errors = [(g[0].tenant_id, r) for g, r in zip(tenants, results, strict=True) if isinstance(r, Exception)]
        if errors:
            logger.error("could not renew the concurrency leases of %d tenant(s), e.g. tenant %d: %r", len(errors),
                         *errors[0])
        for group, result in zip(tenants, results, strict=True):
            if isinstance(result, Exception):
                continue
            lost = [rid for rid in result if rid in self._running and rid not in self._lost]
            if lost:
                self._lost.update(lost)
                logger.warning("tenant %d: %d running call(s) have no open ticket in the quota store (did it "
                               "lose its data?); their slots are not counted: %s", group[0].tenant_id, len(lost),
                               lost[:5])

    @property
    def num_running(self) -> int:
        """Calls admitted with a concurrency limit and not yet settled: this process renews their leases."""
        return len(self._running)

    @property
    def num_unsettled(self) -> int:
        """Settles waiting for Redis to answer again."""
        return len(self._unsettled)

    async def _resettle(self, once: bool = False) -> None:
        """Send the held settles again, oldest first, until none is left (once: one pass, no wait); waits
        RESETTLE_S after a failure, doubling up to 8 s while Redis stays unreachable, RESETTLE_S again
        after a pass that got through."""
        wait = 0.0 if once else RESETTLE_S
        while self._unsettled:
            await asyncio.sleep(wait)
            wait = RESETTLE_S
            while self._unsettled:
                item = self._unsettled.popleft()  # taken before the await: settle() may drop the oldest
                try:
                    await _send(*item)
                except asyncio.CancelledError:  # close(), or its flush's deadline: the settle stays held
                    self._unsettled.appendleft(item)
                    raise
                except Exception as exc:
                    if _retryable(exc):
                        self._unsettled.appendleft(item)
                        wait = min(2 * wait, 8.0)
                        break
                    logger.warning("could not settle quota of request %s: %s", item[0].request_id, exc)
            else:
                logger.info("held quota settles sent")
            if once:
                return

    async def current_use(self, tenant_id: int, limits: Limits) -> CurrentUse:
        """Read-only (the admin dashboard); raises if the store is unreachable."""
        ks = keys(tenant_id, budget_period(limits.budget_period, utcnow()))
        backend = self.local if self.degraded else self.backend
        now, rq_tat, tk_tat, num_concurrent = await backend.peek(ks)

        def used(tat: float | None, limit: int | None) -> int | None:
            if limit is None:
                return None
            return 0 if tat is None or not limit else limit - gcra_remaining(max(tat, now), now, limit)

        return CurrentUse(used(rq_tat, limits.rpm), used(tk_tat, limits.tpm),
                          None if limits.max_concurrent_requests is None else num_concurrent)

    def _refusal(self, limits: Limits, cost: int, d: Decision, period) -> APIError:
        headers = rate_limit_headers(limits, d)
        if d.reason == BUDGET:
            return insufficient_quota(
                f"You exceeded your token budget: {d.budget_used} of {limits.token_budget} tokens used this "
                f"{limits.budget_period} (resets {period.end.isoformat()}Z); this request reserves up to {cost} "
                "tokens (prompt + max_tokens).")
        if d.reason == TOO_LARGE:
            return APIError(429, f"Request too large for tokens per min (TPM): Limit {limits.tpm}, Requested "
                            f"{cost} (prompt + max_tokens). Reduce the prompt or max_tokens.",
                            type="tokens", code="rate_limit_exceeded", headers=headers)
        retry_ms = max(1, math.ceil(d.retry_after_ms))
        headers["retry-after"] = str(max(1, math.ceil(retry_ms / 1000)))
        headers["retry-after-ms"] = str(retry_ms)
        wait = format_duration(retry_ms)
        if d.reason == CONCURRENCY:
            message = (f"Too many concurrent requests: Limit {limits.max_concurrent_requests}. "
                       f"Please try again in {wait}.")
            return APIError(429, message, type="requests", code="rate_limit_exceeded", headers=headers)
        if d.reason == REQUESTS:
            message = (f"Rate limit reached on requests per min (RPM): Limit {limits.rpm}, Requested 1. "
                       f"Please try again in {wait}.")
            return APIError(429, message, type="requests", code="rate_limit_exceeded", headers=headers)
        message = (f"Rate limit reached on tokens per min (TPM): Limit {limits.tpm}, Remaining "
                   f"{d.remaining_tokens}, Requested {cost}. Please try again in {wait}.")
        return APIError(429, message, type="tokens", code="rate_limit_exceeded", headers=headers)

    def _set_degraded(self, degraded: bool, exc: Exception | None = None) -> None:
        if degraded and not self.degraded:
            logger.error("quota store unreachable (%s); failing %s", exc, self.fail_mode)
        elif not degraded and self.degraded:
            logger.warning("quota store reachable again")
        self.degraded = degraded

    async def close(self, flush_s: float = 2.0) -> None:
        """Send the held settles once more (within flush_s), log those still held, close the backend."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self._resettler is not None:
            self._resettler.cancel()
            await asyncio.gather(self._resettler, return_exceptions=True)
        if self._unsettled:
            try:
                await asyncio.wait_for(self._resettle(once=True), flush_s)
            except asyncio.TimeoutError:
                pass
        if self._unsettled:
            tenants = sorted({t.tenant_id for t, _, _ in self._unsettled})
            logger.error("shutting down with %d quota settle(s) Redis never took (tenants %s): their slots free "
                         "at their lease's end", len(self._unsettled), tenants)
        await self.backend.close()


async def _send(ticket: Ticket, refund: int, ran: bool) -> None:
    """One settle of `ticket` on its backend: its slots, `refund` tokens, and its RPM unit unless it ran."""
    await ticket.backend.settle(ticket.keys, ticket.limits, ticket.request_id, refund, ticket.num_slots,
                                refund_request=not ran)


def _unreachable(exc: Exception) -> bool:
    from loraplex.platform.quotas.redis_backend import UNREACHABLE

    return isinstance(exc, UNREACHABLE)


def _retryable(exc: Exception) -> bool:
    """Redis unreachable, or turning writes away while it fails over (a settle is safe to send again)."""
    from loraplex.platform.quotas.redis_backend import FAILING_OVER

    return _unreachable(exc) or isinstance(exc, FAILING_OVER)
