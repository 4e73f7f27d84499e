"""`AdapterAffinityRouter`: Ray Serve request router that sends a LoRA call to a replica already holding
its adapter, unless that replica's queue is much longer than the shortest.

The rule, for a call whose multiplexed model id (its engine adapter name) is `a`, with `q(r)` the number
of requests this router knows to be ongoing on replica `r` (Serve's queue-length cache: probed, plus the
calls this router sent and has not seen finish) and `q_min` the shortest over live replicas:

- resident replicas of `a`: those whose reported multiplexed ids (`serve.multiplexed` in the replica)
  contain `a`, and those this router itself sent `a` to among the last `capacity` distinct adapters it
  sent there (known at once, before the replica's report; `capacity` is what a replica holds, so this
  memory forgets an adapter about when the replica's LRU host cache does);
- go to the resident replica with the shortest queue if `q(r) <= q_min + slack`
  (`LORAPLEX_AFFINITY_SLACK`, 8 calls by default: about one engine step's worth of new decodes on the
  small settings; spilling earlier costs a cold load, later costs queueing);
- otherwise (no resident replica, or all of them that much busier) a replica with `q(r) <= q_min +
  slack` too, the one with the fewest resident adapters first (cold adapters spread over the replicas:
  a queue one call longer, which a stale queue-length cache can show, does not outweigh that), then
  the shorter queue, then rendezvous hashing of (adapter, replica) (Thaler and Ravishankar, 1998), so
  that ingresses with the same view send a cold adapter to the same replica; past those, the replicas
  by queue;
- a base-model call (no id): the shortest queue, ties at random.

Each rank returned holds one replica, so Serve's own selection (skip full replicas, probe unknown queue
lengths, back off when all are full) tries them in this order. Ray Serve's default
(`PowerOfTwoChoicesRequestRouter`) prefers replicas reporting the id too, but picks two at random and
only learns a new placement from the replicas' reports, so a burst for a cold adapter spreads over
replicas and loads it on each; llm-d's inference scheduler scores endpoints by adapter residency and
queue depth in the same spirit.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections import OrderedDict, defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

DEFAULT_SLACK = 8
DEFAULT_CAPACITY = 64  # adapters a replica holds, when the deployment does not say


class AdapterAffinityRouter(RequestRouter):
    """Adapter-affinity routing over Ray Serve's router API (the rule is the module's).

    Router kwargs (`RequestRouterConfig.request_router_kwargs`): `slack` (calls; default
    $LORAPLEX_AFFINITY_SLACK, else 8) and `capacity` (adapters one replica holds; default 64)."""

    def initialize_state(self, **kwargs) -> None:
        self.slack = int(kwargs.get("slack", os.environ.get("LORAPLEX_AFFINITY_SLACK", DEFAULT_SLACK)))
        self.capacity = max(1, int(kwargs.get("capacity", DEFAULT_CAPACITY)))
        # replica -> the adapters this router sent it, least recently sent first, at most `capacity`
        self.placed: defaultdict[ReplicaID, OrderedDict[str, None]] = defaultdict(OrderedDict)

    def _queue_len(self, r: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(r.replica_id) or 0

    def _num_resident(self, r: RunningReplica) -> int:
        return max(len(r.multiplexed_model_ids), len(self.placed.get(r.replica_id, ())))

    def _holds(self, r: RunningReplica, adapter: str) -> bool:
        return adapter in r.multiplexed_model_ids or adapter in self.placed.get(r.replica_id, ())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        queue = {r.replica_id: self._queue_len(r) for r in candidate_replicas}
        shortest = min(queue.values())
        ranked: list[RunningReplica] = []
        if adapter:
            near = [r for r in candidate_replicas
                    if self._holds(r, adapter) and queue[r.replica_id] <= shortest + self.slack]
            ranked = sorted(near, key=lambda r: (queue[r.replica_id], random.random()))
        rest = [r for r in candidate_replicas if r not in ranked]
        if adapter:
            def cold_key(r: RunningReplica) -> tuple:
                return self._num_resident(r), queue[r.replica_id], _rendezvous(adapter, r.replica_id.unique_id)

            within = [r for r in rest if queue[r.replica_id] <= shortest + self.slack]
            ranked += sorted(within, key=cold_key)
            ranked += sorted((r for r in rest if r not in within), key=lambda r: (queue[r.replica_id], *cold_key(r)))
        else:
            ranked += sorted(rest, key=lambda r: (queue[r.replica_id], random.random()))
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        adapter = pending_request.metadata.multiplexed_model_id
        if not adapter:
            return
        sent = self.placed[replica_id]
        sent[adapter] = None
        sent.move_to_end(adapter)
        if len(sent) > self.capacity:
            sent.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.placed.pop(replica_id, None)


def _rendezvous(adapter: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{adapter}\0{replica}".encode(), digest_size=8).digest()
