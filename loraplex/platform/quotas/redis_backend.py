"""Quota counters in Redis, shared exactly by every gateway process: the semantics of `limits.py`,
run atomically by Lua scripts on Redis's own clock (TIME), so process clocks never matter.

Numbers cross the Lua boundary as strings: Redis truncates Lua numbers to integers.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    ReadOnlyError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from loraplex.platform.quotas.limits import OPEN_TICKET_MS, Decision, Limits

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# Redis answering, but not taking writes while it fails over or loads (Sentinel, Cluster, a replica promoted)
FAILING_OVER = (ReadOnlyError, TryAgainError, ClusterDownError, MasterDownError, BusyLoadingError)

# The concurrency set expires with its latest lease, never earlier: processes may run different leases
# (a rolling upgrade, a setting per process). PEXPIREAT on Redis's clock, which scores the leases.
EXPIRE_AT_LAST_LEASE = """
local function expire_at_last_lease(cc)
  local last = redis.call('ZRANGE', cc, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIREAT', cc, math.ceil(tonumber(last[2])) + 1) end
end
"""

# KEYS: rq tk cc bg op. ARGV: rpm tpm max_cc budget (-1: unlimited) cost request_id lease_ms budget_ttl_ms seed (-1: none)
# num_slots (members request_id, request_id#1, ... as limits.slot_ids)
ADMIT_LUA = EXPIRE_AT_LAST_LEASE + """
local rq, tk, cc, bg, op = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local rpm, tpm, max_cc, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, rid, lease_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local budget_ttl_ms, seed, num_slots = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local open_ms = tonumber(ARGV[11])
local WINDOW = 60000.0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local used = -1
if budget >= 0 then
  local v = redis.call('GET', bg)
  if v then used = tonumber(v) elseif seed >= 0 then used = seed
  else return {'0', 'need_seed', '0', '-1', '0', '-1', '0', '-1'} end
end
redis.call('ZREMRANGEBYSCORE', cc, '-inf', now)
local num_cc = redis.call('ZCARD', cc)

-- fits, TAT to store, ms until it fits, remaining, ms until full
local function gcra(key, limit, c)
  if limit < 0 then return true, nil, 0, -1, 0 end
  local interval = WINDOW / math.max(limit, 1)
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + c * interval
  local fits = limit > 0 and (new_tat - now) <= WINDOW + 1e-6
  local after = tat
  if fits then after = new_tat end
  local remaining = 0
  if limit > 0 then remaining = math.max(0, math.floor((WINDOW - (after - now)) / interval + 1e-9)) end
  return fits, new_tat, new_tat - WINDOW - now, remaining, after - now
end
local rq_fits, new_rq, rq_retry, rq_rem, rq_reset = gcra(rq, rpm, 1)
local tk_fits, new_tk, tk_retry, tk_rem, tk_reset = gcra(tk, tpm, cost)

local reason, retry = '', 0
if used >= 0 and used + cost > budget then reason = 'budget'
elseif tpm >= 0 and cost > tpm then reason = 'too_large'
elseif max_cc >= 0 and num_cc + num_slots > max_cc then reason, retry = 'concurrency', 1000
elseif not rq_fits then reason, retry = 'requests', rq_retry
elseif not tk_fits then reason, retry = 'tokens', tk_retry end
if reason == '' then
  redis.call('ZREMRANGEBYSCORE', op, '-inf', now - open_ms)
  redis.call('ZADD', op, now, rid)
  redis.call('PEXPIRE', op, math.ceil(open_ms))
  if max_cc >= 0 then
    redis.call('ZADD', cc, now + lease_ms, rid)
    for i = 1, num_slots - 1 do redis.call('ZADD', cc, now + lease_ms, rid .. '#' .. i) end
    expire_at_last_lease(cc)
  end
  if rpm >= 0 then redis.call('SET', rq, string.format('%.3f', new_rq), 'PX', math.ceil(new_rq - now) + 1) end
  if tpm >= 0 then redis.call('SET', tk, string.format('%.3f', new_tk), 'PX', math.ceil(new_tk - now) + 1) end
  if used >= 0 then
    used = used + cost
    redis.call('SET', bg, string.format('%d', used), 'PX', math.ceil(budget_ttl_ms))
  end
end
local allowed = '0'
if reason == '' then allowed = '1' end
return {allowed, reason, tostring(retry), tostring(rq_rem), tostring(rq_reset), tostring(tk_rem),
        tostring(tk_reset), string.format('%d', used)}
"""

# KEYS: rq tk cc bg op. ARGV: rpm tpm (-1: unlimited) request_id refund num_slots refund_request (0/1). Gives
# back only while the request's ticket is open (returns 1), so a settle sent twice gives back once (0).
SETTLE_LUA = """
local rq, tk, cc, bg, op = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local rpm, tpm, rid, refund = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local num_slots, refund_request = tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('ZREM', cc, rid)
for i = 1, num_slots - 1 do redis.call('ZREM', cc, rid .. '#' .. i) end
if redis.call('ZREM', op, rid) == 0 then return 0 end
local function give_back(key, units, limit)
  local v = redis.call('GET', key)
  if v then
    local tat = math.max(tonumber(v) - units * 60000.0 / limit, now)
    local ttl = math.ceil(tat - now)
    if ttl > 0 then redis.call('SET', key, string.format('%.3f', tat), 'PX', ttl) else redis.call('DEL', key) end
  end
end
if refund_request > 0 and rpm > 0 then give_back(rq, 1, rpm) end
if refund <= 0 then return 1 end
if tpm > 0 then give_back(tk, refund, tpm) end
local u = redis.call('GET', bg)
if u then redis.call('SET', bg, string.format('%d', math.max(0, tonumber(u) - refund)), 'KEEPTTL') end
return 1
"""

# KEYS: cc op. ARGV: lease_ms open_ms, then request_id num_slots per call this process still runs. Extends
# their slots' leases to now + lease_ms and their open tickets by open_ms, only while a call's ticket is
# open: a settle that got in first is not undone, and slots that expired while Redis was unreachable come
# back. Returns the request ids it did not renew (no open ticket).
RENEW_LUA = EXPIRE_AT_LAST_LEASE + """
local cc, op = KEYS[1], KEYS[2]
local lease_ms, open_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local missing = {}
for i = 3, #ARGV, 2 do
  local rid, num_slots = ARGV[i], tonumber(ARGV[i + 1])
  if redis.call('ZSCORE', op, rid) then
    redis.call('ZADD', op, now, rid)
    redis.call('ZADD', cc, now + lease_ms, rid)
    for j = 1, num_slots - 1 do redis.call('ZADD', cc, now + lease_ms, rid .. '#' .. j) end
  else
    missing[#missing + 1] = rid
  end
end
if #missing * 2 < #ARGV - 2 then
  expire_at_last_lease(cc)
  redis.call('PEXPIRE', op, math.ceil(open_ms))
end
return missing
"""

# KEYS: rq tk cc. Read-only: now, request TAT, token TAT ('' when unset), requests in flight
PEEK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
return {string.format('%.3f', now), redis.call('GET', KEYS[1]) or '', redis.call('GET', KEYS[2]) or '',
        tostring(redis.call('ZCOUNT', KEYS[3], '(' .. string.format('%.3f', now), '+inf'))}
"""


RENEW_SCRIPT_CALLS = 1000  # calls one renewal script takes
RENEW_PIPELINE_CALLS = 10_000  # calls renewed per pipeline (one round trip)


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


class RedisBackend:
    def __init__(self, url: str, timeout_s: float = 0.5):
        self.client = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                     retry=Retry(NoBackoff(), 1), decode_responses=True)
        self._admit = self.client.register_script(ADMIT_LUA)
        self._settle = self.client.register_script(SETTLE_LUA)
        self._peek = self.client.register_script(PEEK_LUA)
        self._renew = self.client.register_script(RENEW_LUA)

    async def admit(self, keys: list[str], limits: Limits, cost: int, request_id: str, *, lease_ms: float,
                    budget_ttl_ms: float, budget_seed: int | None = None, num_slots: int = 1) -> Decision:
        args = [_arg(limits.rpm), _arg(limits.tpm), _arg(limits.max_concurrent_requests),
                _arg(limits.token_budget), cost, request_id, lease_ms, budget_ttl_ms, _arg(budget_seed), num_slots,
                OPEN_TICKET_MS]
        allowed, reason, retry, rq_rem, rq_reset, tk_rem, tk_reset, used = await self._admit(keys=keys, args=args)
        return Decision(
            allowed=allowed == "1", reason=reason or None, retry_after_ms=float(retry),
            remaining_requests=None if limits.rpm is None else int(rq_rem), reset_requests_ms=float(rq_reset),
            remaining_tokens=None if limits.tpm is None else int(tk_rem), reset_tokens_ms=float(tk_reset),
            budget_used=None if limits.token_budget is None else int(used),
        )

    async def settle(self, keys: list[str], limits: Limits, request_id: str, refund: int,
                     num_slots: int = 1, refund_request: bool = False) -> bool:
        """`MemoryBackend.settle`, atomically in Redis."""
        return bool(int(await self._settle(keys=keys, args=[_arg(limits.rpm), _arg(limits.tpm), request_id,
                                                            max(0, refund), num_slots, int(refund_request)])))

    async def renew(self, batches: list[tuple[list[str], list[tuple[str, int]]]],
                    lease_ms: float) -> list[list[str] | Exception]:
        """`MemoryBackend.renew`, atomically per script: a tenant's calls in scripts of at most
        `RENEW_SCRIPT_CALLS`, the scripts in pipelines of at most `RENEW_PIPELINE_CALLS` calls (a few
        round trips per pass however many tenants, none long enough to time out). Raises if Redis is
        unreachable or turns a script away while failing over (or lost the script mid-pass): the caller
        tries the whole pass again soon."""
        scripts = [(i, calls[j:j + RENEW_SCRIPT_CALLS]) for i, (keys, calls) in enumerate(batches)
                   for j in range(0, max(len(calls), 1), RENEW_SCRIPT_CALLS)]
        results: list = [[] for _ in batches]
        retry: Exception | None = None
        start = 0
        while start < len(scripts):
            end, num_calls = start, 0
            while end < len(scripts) and (end == start or num_calls + len(scripts[end][1]) <= RENEW_PIPELINE_CALLS):
                num_calls += len(scripts[end][1])
                end += 1
            async with self.client.pipeline(transaction=False) as pipe:
                for i, calls in scripts[start:end]:
                    keys = batches[i][0]
                    args: list = [lease_ms, OPEN_TICKET_MS]
                    for request_id, num_slots in calls:
                        args += [request_id, num_slots]
                    await self._renew(keys=[keys[2], keys[4]], args=args, client=pipe)
                replies = await pipe.execute(raise_on_error=False)
            for (i, _), reply in zip(scripts[start:end], replies, strict=True):
                if isinstance(reply, UNREACHABLE):
                    raise reply
                if isinstance(reply, (*FAILING_OVER, NoScriptError)):
                    retry = reply
                elif isinstance(reply, Exception):
                    results[i] = reply
                elif isinstance(results[i], list):
                    results[i] += reply
            start = end
        if retry is not None:
            raise retry
        return results

    async def peek(self, keys: list[str]) -> tuple[float, float | None, float | None, int]:
        """(now ms, request TAT, token TAT, requests in flight) on Redis's clock, changing nothing."""
        now, rq, tk, num_concurrent = await self._peek(keys=keys[:3])
        return float(now), float(rq) if rq else None, float(tk) if tk else None, int(num_concurrent)

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    async def close(self) -> None:
        await self.client.aclose()
