"""Fair share across tenants and priority: the order of admission and the choice of victims under
`EngineConfig.scheduling_policy = "fair"` (the scheduler's other policy, "fcfs", is arrival order).

**Virtual Token Counter** (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
Each tenant t has a counter c_t of the service it received, in weighted tokens over its weight w_t
(the tenant's quota field `weight`, default 1):

    c_t += (PROMPT_TOKEN_WEIGHT * prompt tokens scheduled + OUTPUT_TOKEN_WEIGHT * output tokens) / w_t

Prompt tokens are charged when a chunk is scheduled (so one step's admissions see each other), at most
once per position: the recompute of a preempted request is the scheduler's choice and is not charged
again. Output tokens are charged when sampled. The weights 1 and 2 are the paper's.
- Admission takes the next request of the tenant with the smallest counter (ties: fewer running
  requests per unit of weight, then queue order). Requests without a tenant (the `LLM` API) are one
  tenant.
- **Lift rule**: a tenant that comes back with no request in the engine is lifted to the smallest
  counter among the tenants that have some (c_t = max(c_t, min)), so time spent idle earns no credit;
  when no tenant has a request, every counter starts again from 0.
- The paper's bound: while two tenants are both backlogged, their counters differ by at most
  2 * max(PROMPT_TOKEN_WEIGHT * the longest prompt, OUTPUT_TOKEN_WEIGHT * max_num_seqs) (its Theorem;
  here per unit of weight, and prompts count in chunks of at most max_num_batched_tokens).

**Priority** (vLLM's `priority`: lower runs first, default 0) orders before fair share: admission takes
the most urgent effective priority first and applies fair share among the tenants at that priority;
within one tenant, priority first, then queue order. **Aging** bounds starvation: a request's effective
priority is its priority minus one per `priority_aging_s` seconds since it arrived, but never more urgent
than the most urgent priority among unfinished requests. So a request of priority p waits at most
(p - q) * priority_aging_s before it is level with the most urgent work q, and from then on it is served
by fair share among the requests of level q (first within its own tenant, being the oldest).

**Preemption** (recompute; vLLM's priority policy preempts the lowest priority first). When a waiting
request (the head of the order above) finds no free place in the batch or no room in the KV cache, it
may preempt a running request that was not admitted in this step:
- one of a less urgent effective priority, the least urgent first, then the newest; or else
- at the same effective priority, for a tenant that has **no running request** (it is starved), the
  newest request of the tenant with the largest counter among those whose counter is at least the
  candidate's and that hold at least share + 1 rows, share_t = max_num_seqs * w_t / (sum of the weights
  of the tenants with requests). The rule that keeps this from thrashing: only a tenant with no row
  preempts for fair share, and the victim's tenant keeps at least its share, so at least one row: it
  cannot preempt back, and the candidate's tenant, now holding a row, cannot preempt again until its
  requests have all left the batch. Every other balancing is VTC's own, as rows free up.
A quiet tenant's request is thus admitted in the next step even when another tenant's long requests
fill the batch (also when the running requests' prefill chunks take the whole token budget: it then
joins the batch with no tokens and is served first in the next step).
When a running request needs KV blocks that are not there, the scheduler preempts the least urgent,
newest running request (vLLM's priority policy), whatever its tenant: that loses the least work, and
taking from the most-served tenant instead made two tenants whose requests do not fit together take
turns preempting each other (5 preemptions against fcfs's 3 in `test_fair_share.py`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from loraplex.engine.request import Request

PROMPT_TOKEN_WEIGHT = 1.0  # service per prompt token (VTC's w_p)
OUTPUT_TOKEN_WEIGHT = 2.0  # service per output token (VTC's w_q): a decode costs more than a prefill token


@dataclass
class TenantShare:
    """One tenant's counter and what it holds: unfinished requests (waiting or running) and running ones."""

    counter: float = 0.0
    weight: float = 1.0
    num_requests: int = 0
    num_running: int = 0


class FairShare:
    """The tenants' counters and the policy's decisions; the scheduler tells it what happens to requests
    (`add`, `admitted`, `preempted`, `finished`, `charge_*`) and asks it for an order and a victim.

    aging_s: `EngineConfig.priority_aging_s` (None: no aging). max_num_seqs: the batch's rows, shared out."""

    def __init__(self, max_num_seqs: int, aging_s: float | None):
        self.max_num_seqs = max_num_seqs
        self.aging_s = aging_s
        self.tenants: dict[int | None, TenantShare] = {}
        self._admissions = itertools.count()  # admission order, for "newest"

    # what happens to requests -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """`req` joins the waiting queue: its tenant's weight is the request's, and a returning tenant is
        lifted (the lift rule)."""
        t = self.tenants.get(req.tenant_id)
        if t is None or not t.num_requests:
            active = [s.counter for s in self.tenants.values() if s.num_requests]
            if not active:
                self.tenants.clear()  # nobody has a request: everyone starts again from 0
                t = None
            if t is None:
                t = self.tenants[req.tenant_id] = TenantShare()
            if active:
                t.counter = max(t.counter, min(active))
        t.weight = req.tenant_weight
        t.num_requests += 1

    def admitted(self, req: Request) -> None:
        self.tenants[req.tenant_id].num_running += 1
        req.admission_seq = next(self._admissions)

    def preempted(self, req: Request) -> None:
        self.tenants[req.tenant_id].num_running -= 1

    def finished(self, req: Request, was_running: bool) -> None:
        """`req` left the engine (from the waiting queue or the batch)."""
        t = self.tenants[req.tenant_id]
        t.num_requests -= 1
        t.num_running -= was_running
        if not t.num_requests and len(self.tenants) > 64:
            self._prune()

    def _prune(self) -> None:
        """Forget idle tenants whose counter is at most the smallest active one: the lift rule would
        give them that counter back anyway."""
        active = [s.counter for s in self.tenants.values() if s.num_requests]
        floor = min(active) if active else float("inf")
        for key in [k for k, s in self.tenants.items() if not s.num_requests and s.counter <= floor]:
            del self.tenants[key]

    def charge_prompt(self, req: Request, num_new: int) -> None:
        """`num_new` tokens of `req` from `num_computed_tokens` on were scheduled: charge the prompt
        positions among them that were never charged."""
        end = min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
        if end > req.num_charged_prompt_tokens:
            t = self.tenants[req.tenant_id]
            t.counter += PROMPT_TOKEN_WEIGHT * (end - req.num_charged_prompt_tokens) / t.weight
            req.num_charged_prompt_tokens = end

    def charge_output(self, req: Request) -> None:
        t = self.tenants[req.tenant_id]
        t.counter += OUTPUT_TOKEN_WEIGHT / t.weight

    def counter(self, tenant_id: int | None) -> float:
        t = self.tenants.get(tenant_id)
        return 0.0 if t is None else t.counter

    # priority -----------------------------------------------------------------------------------
    def priorities(self, requests: Iterable[Request], now: float) -> Callable[[Request], int]:
        """The effective priority of each request among `requests` (all unfinished ones), at time `now`."""
        reqs = list(requests)
        if not reqs:
            return lambda r: r.priority
        top = min(r.priority for r in reqs)
        if self.aging_s is None or all(r.priority == top for r in reqs):
            return lambda r: r.priority
        aging_s = self.aging_s
        return lambda r: max(top, r.priority - int(max(0.0, now - r.arrival_time) / aging_s))

    # decisions ----------------------------------------------------------------------------------
    def order(self, waiting: Sequence[Request], priority: Callable[[Request], int]) -> Iterator[Request]:
        """The waiting requests in admission order, best first. A generator: each tenant's key is read
        again after the caller handled the request it yielded, so a request admitted (and charged) in
        between moves its tenant back in the order."""
        groups: dict[int | None, list[Request]] = {}
        for r in waiting:
            groups.setdefault(r.tenant_id, []).append(r)
        for reqs in groups.values():
            reqs.sort(key=priority)  # stable: queue order within a priority
        heap = [(*self._tenant_key(key, reqs[0], priority), i, key) for i, (key, reqs) in enumerate(groups.items())]
        heapq.heapify(heap)
        pos = dict.fromkeys(groups, 0)
        while heap:
            *_, i, key = heapq.heappop(heap)
            reqs = groups[key]
            yield reqs[pos[key]]
            pos[key] += 1
            if pos[key] < len(reqs):
                heapq.heappush(heap, (*self._tenant_key(key, reqs[pos[key]], priority), i, key))

    def _tenant_key(self, key: int | None, head: Request, priority: Callable[[Request], int]) -> tuple:
        t = self.tenants[key]
        return priority(head), t.counter, t.num_running / t.weight

    def victim(self, cand: Request, running: Sequence[Request], protected: set[Request],
               priority: Callable[[Request], int]) -> Request | None:
        """The running request that `cand` may preempt (module docstring), or None. `protected`: requests
        admitted in this step, never victims."""
        p = priority(cand)
        less_urgent = [r for r in running if priority(r) > p and r not in protected]
        if less_urgent:
            return max(less_urgent, key=lambda r: (priority(r), r.admission_seq))
        mine = self.tenants[cand.tenant_id]
        if mine.num_running:
            return None
        shares = self._row_shares()
        best = None
        for r in running:
            t = self.tenants[r.tenant_id]
            if (r.tenant_id == cand.tenant_id or r in protected or priority(r) != p or t.counter < mine.counter
                    or t.num_running < shares[r.tenant_id] + 1):
                continue
            if best is None or (t.counter, r.admission_seq) > (self.tenants[best.tenant_id].counter,
                                                                best.admission_seq):
                best = r
        return best

    def _active_weights(self) -> dict[int | None, float]:
        """The weight of each tenant with requests."""
        return {k: t.weight for k, t in self.tenants.items() if t.num_requests}

    def _row_shares(self) -> dict[int | None, float]:
        active = self._active_weights()
        total = sum(active.values())
        return {k: self.max_num_seqs * w / total for k, w in active.items()}

    def waiting_share(self, tenant_id: int | None, weight: float, bound: int) -> float:
        """Tenant `tenant_id`'s share of a waiting-queue bound (`Scheduler.has_room`), counting it among
        the tenants with requests."""
        active = self._active_weights()
        active[tenant_id] = weight
        return bound * weight / sum(active.values())

    def tenant_stats(self) -> dict[int | None, dict]:
        """Per tenant: counter (weighted tokens over weight), weight, unfinished and running requests."""
        return {k: {"counter": t.counter, "weight": t.weight, "num_requests": t.num_requests,
                    "num_running": t.num_running} for k, t in self.tenants.items()}
