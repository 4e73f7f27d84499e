"""In-process quota counters: the semantics of `limits.py` for one gateway process.

Also the fail-open fallback of the Redis backend. `admit` and `settle` never await, so on one event
loop each runs whole; the lock covers callers on other threads.
"""

from __future__ import annotations

import threading
import time

from loraplex.platform.quotas.limits import (
    BUDGET,
    CONCURRENCY,
    NEED_SEED,
    OPEN_TICKET_MS,
    REQUESTS,
    TOKENS,
    TOO_LARGE,
    WINDOW_MS,
    Decision,
    Limits,
    gcra_remaining,
    slot_ids,
)


class MemoryBackend:
    def __init__(self, clock=time.time):
        self._clock = clock  # seconds
        self._lock = threading.Lock()
        self._tat: dict[str, float] = {}
        self._leases: dict[str, dict[str, float]] = {}
        self._budget: dict[str, tuple[int, float]] = {}  # key -> (used, expires_at_ms)
        self._open: dict[str, dict[str, float]] = {}  # open tickets: key -> request id -> admitted at (ms)

    def now_ms(self) -> float:
        return self._clock() * 1000.0

    async def admit(self, keys: list[str], limits: Limits, cost: int, request_id: str, *, lease_ms: float,
                    budget_ttl_ms: float, budget_seed: int | None = None, num_slots: int = 1) -> Decision:
        rq, tk, cc, bg, op = keys
        with self._lock:
            now = self.now_ms()
            d = Decision(allowed=True)
            used = None
            if limits.token_budget is not None:
                entry = self._budget.get(bg)
                if entry is not None and entry[1] <= now:
                    entry = None
                if entry is None and budget_seed is None:
                    return Decision(False, NEED_SEED)
                used = d.budget_used = entry[0] if entry is not None else budget_seed
            leases = self._leases.setdefault(cc, {})
            for rid in [r for r, exp in leases.items() if exp <= now]:
                del leases[rid]
            rq_fits, new_rq, rq_retry = self._gcra(d, rq, limits.rpm, 1, now, "requests")
            tk_fits, new_tk, tk_retry = self._gcra(d, tk, limits.tpm, cost, now, "tokens")
            refusals = [
                (used is not None and used + cost > limits.token_budget, BUDGET, 0.0),
                (limits.tpm is not None and cost > limits.tpm, TOO_LARGE, 0.0),
                (limits.max_concurrent_requests is not None
                 and len(leases) + num_slots > limits.max_concurrent_requests, CONCURRENCY, 1000.0),
                (not rq_fits, REQUESTS, rq_retry),
                (not tk_fits, TOKENS, tk_retry),
            ]
            for refused, reason, retry_ms in refusals:
                if refused:
                    d.allowed, d.reason, d.retry_after_ms = False, reason, retry_ms
                    return d
            tickets = self._open.setdefault(op, {})
            while tickets:  # in admission order: the expired ones are first
                oldest = next(iter(tickets))
                if tickets[oldest] > now - OPEN_TICKET_MS:
                    break
                del tickets[oldest]
            tickets[request_id] = now
            if limits.max_concurrent_requests is not None:
                for slot in slot_ids(request_id, num_slots):
                    leases[slot] = now + lease_ms
            if new_rq is not None:
                self._tat[rq] = new_rq
            if new_tk is not None:
                self._tat[tk] = new_tk
            if used is not None:
                self._budget[bg] = (used + cost, now + budget_ttl_ms)
                d.budget_used = used + cost
            return d

    def _gcra(self, d: Decision, key: str, limit: int | None, cost: int, now: float,
              what: str) -> tuple[bool, float | None, float]:
        """(fits, TAT to store if admitted, ms until it would fit); fills d's remaining_/reset_ `what`."""
        if limit is None:
            return True, None, 0.0
        interval = WINDOW_MS / max(limit, 1)
        tat = max(self._tat.get(key, now), now)
        new_tat = tat + cost * interval
        fits = limit > 0 and new_tat - now <= WINDOW_MS + 1e-6
        after = new_tat if fits else tat
        setattr(d, f"remaining_{what}", gcra_remaining(after, now, limit) if limit else 0)
        setattr(d, f"reset_{what}_ms", after - now)
        return fits, new_tat, new_tat - WINDOW_MS - now

    async def settle(self, keys: list[str], limits: Limits, request_id: str, refund: int,
                     num_slots: int = 1, refund_request: bool = False) -> bool:
        """Release the request's concurrency slots and give back `refund` unused tokens, and with
        refund_request its unit of the requests-per-minute bucket (a request that never ran). Gives back
        only while the request's ticket is open, which the first settle closes: True if this one gave
        back, False for a settle sent again (its slots are released all the same)."""
        rq, tk, cc, bg, op = keys
        with self._lock:
            now = self.now_ms()
            for slot in slot_ids(request_id, num_slots):
                self._leases.get(cc, {}).pop(slot, None)
            if self._open.get(op, {}).pop(request_id, None) is None:
                return False
            if refund_request and limits.rpm and rq in self._tat:
                self._tat[rq] = max(self._tat[rq] - WINDOW_MS / limits.rpm, now)
            if refund <= 0:
                return True
            if limits.tpm and tk in self._tat:
                self._tat[tk] = max(self._tat[tk] - refund * WINDOW_MS / limits.tpm, now)
            if bg in self._budget:
                used, expires = self._budget[bg]
                self._budget[bg] = (max(0, used - refund), expires)
            return True

    async def renew(self, batches: list[tuple[list[str], list[tuple[str, int]]]],
                    lease_ms: float) -> list[list[str] | Exception]:
        """For each tenant's (keys, calls), where calls are the (request id, slots) a live process still runs:
        extend each call's slots to now + lease_ms and its open ticket by `OPEN_TICKET_MS`, only while the
        ticket is open: a settle is never undone, and slots that expired while the process could not renew
        come back. Returns, per tenant, the request ids not renewed (no open ticket)."""
        results: list = []
        with self._lock:
            now = self.now_ms()
            for keys, calls in batches:
                rq, tk, cc, bg, op = keys
                tickets, leases = self._open.get(op, {}), self._leases.setdefault(cc, {})
                missing = []
                for request_id, num_slots in calls:
                    if tickets.pop(request_id, None) is None:
                        missing.append(request_id)
                        continue
                    tickets[request_id] = now  # last in admission order again: trimmed 24 h from now
                    for slot in slot_ids(request_id, num_slots):
                        leases[slot] = now + lease_ms
                results.append(missing)
        return results

    async def peek(self, keys: list[str]) -> tuple[float, float | None, float | None, int]:
        """(now ms, request TAT, token TAT, requests in flight), changing nothing."""
        rq, tk, cc = keys[:3]
        with self._lock:
            now = self.now_ms()
            num_concurrent = sum(exp > now for exp in self._leases.get(cc, {}).values())
            return now, self._tat.get(rq), self._tat.get(tk), num_concurrent

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        pass
