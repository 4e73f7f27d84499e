"""What a quota check takes and gives back, shared by both backends.

Semantics (the in-process backend in Python, the Redis backend in Lua, tested against each other):

- requests and tokens per minute are GCRA (a token bucket of one minute's allowance that refills
  continuously): with limit L, each unit advances the tenant's theoretical arrival time (TAT) by
  T = 60 s / L, and a request of cost c is admitted when max(TAT, now) + c*T - now <= 60 s. No window
  edges, so no double burst at a minute boundary. Refunds move TAT back, never before now.
- concurrent requests: a set of slots, each with a lease that the process running the call renews (so a
  dead process's slots expire, and a renewal never brings back a settled call's). A call
  holds one slot per sequence it runs (n x prompts), named by `slot_ids`, so a fan-out counts as the
  requests it is; a call of more sequences than the limit is refused outright (too large).
- a token budget per calendar period (UTC day, ISO week or month): a counter per period, seeded from
  the database's daily roll-ups when the counter store has none (a restarted Redis forgets nothing).

All checks run before any counter moves: a request refused by one limit costs nothing in the others.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

WINDOW_MS = 60_000.0

# Decision.reason values
CONCURRENCY, REQUESTS, TOKENS, TOO_LARGE, BUDGET, NEED_SEED = (
    "concurrency", "requests", "tokens", "too_large", "budget", "need_seed")


@dataclass(frozen=True)
class Limits:
    """A tenant's quotas; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent_requests: int | None = None
    token_budget: int | None = None
    budget_period: str = "month"


@dataclass
class Decision:
    """Outcome of one admission. reset_*_ms: until the bucket is full again; retry_after_ms: until this
    request would fit (0 when admitted). remaining_*: after this request when admitted."""

    allowed: bool
    reason: str | None = None
    retry_after_ms: float = 0.0
    remaining_requests: int | None = None
    reset_requests_ms: float = 0.0
    remaining_tokens: int | None = None
    reset_tokens_ms: float = 0.0
    budget_used: int | None = None


@dataclass(frozen=True)
class BudgetPeriod:
    id: str  # part of the counter key, e.g. "m2026-11"
    start: dt.date
    end: dt.datetime  # naive UTC, exclusive


def budget_period(period: str, now: dt.datetime) -> BudgetPeriod:
    """The calendar period (naive UTC) that `now` falls in."""
    day = now.date()
    if period == "day":
        start, end = day, day + dt.timedelta(days=1)
    elif period == "week":
        start = day - dt.timedelta(days=day.weekday())
        end = start + dt.timedelta(days=7)
    elif period == "month":
        start = day.replace(day=1)
        end = (start + dt.timedelta(days=32)).replace(day=1)
    else:
        raise ValueError(f"budget_period must be day, week or month, got {period!r}")
    return BudgetPeriod(f"{period[0]}{start.isoformat()}", start, dt.datetime.combine(end, dt.time()))


def keys(tenant_id: int, period: BudgetPeriod) -> list[str]:
    """Counter keys of one tenant: request TAT, token TAT, concurrency set, budget counter, open tickets
    (admitted, not yet settled: a settle gives back only once, so it can be sent again). The hash tag
    `{t<id>}` keeps them in one Redis Cluster slot, as a multi-key script needs."""
    tag = f"lpx:{{t{tenant_id}}}"
    return [f"{tag}:rq", f"{tag}:tk", f"{tag}:cc", f"{tag}:bg:{period.id}", f"{tag}:op"]


# How long an admitted request's ticket stays open for its settle (a settle after it releases the slots
# but gives nothing back): longer than any request runs, so it only bounds what crashed processes leave.
OPEN_TICKET_MS = 86_400_000.0


def slot_ids(request_id: str, num_slots: int) -> list[str]:
    """Members of the concurrency set for a call of `num_slots` sequences: the id, then id#1, id#2..."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, num_slots)]


def gcra_remaining(tat_after: float, now: float, limit: int) -> int:
    """Whole units left in the bucket when it holds until `tat_after`."""
    interval = WINDOW_MS / limit
    return max(0, math.floor((WINDOW_MS - (tat_after - now)) / interval + 1e-9))


def format_duration(ms: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: 20ms, 1.5s, 6m0s."""
    if ms < 1000:
        return f"{max(0, math.ceil(ms))}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest, 3):g}s"
