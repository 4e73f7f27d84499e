"""`AdapterAffinityRouter`'s rule on fake replicas (no cluster): affinity within the slack, spill past it,
cold adapters to the least loaded and emptiest replica, the same one from every router."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the router is Ray Serve's API: pip install -e '.[test,ray]'")

from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402

from loraplex.platform.scaleout.router import AdapterAffinityRouter  # noqa: E402


class Cache:
    def __init__(self, lens: dict):
        self.lens = lens

    def get(self, replica_id):
        return self.lens.get(replica_id.unique_id)


def make_router(queue: dict[str, int], slack: int = 2, capacity: int = 64) -> AdapterAffinityRouter:
    router = object.__new__(AdapterAffinityRouter)  # the router's state only: no Serve controller here
    router._replica_queue_len_cache = Cache(queue)
    router.initialize_state(slack=slack, capacity=capacity)
    return router


def routed(router, r, adapter: str) -> None:
    router.on_request_routed(SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id=adapter)),
                             r.replica_id, None)


def replica(name: str, *adapters: str):
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DeploymentID("E", "app")),
                           multiplexed_model_ids=set(adapters))


def order(router, replicas, adapter: str = "") -> list[str]:
    request = SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id=adapter))
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_resident_replica_wins_until_its_queue_is_slack_longer():
    replicas = [replica("r1", "a"), replica("r2")]
    assert order(make_router({"r1": 2, "r2": 0}), replicas, "a") == ["r1", "r2"]  # 2 <= 0 + 2
    assert order(make_router({"r1": 3, "r2": 0}), replicas, "a") == ["r2", "r1"]  # 3 > 0 + 2: spill


def test_a_cold_adapter_goes_to_the_least_loaded_then_the_emptiest_replica():
    replicas = [replica("r1", "a", "b"), replica("r2", "c")]
    assert order(make_router({"r1": 1, "r2": 4}), replicas, "new") == ["r1", "r2"]  # 4 > 1 + 2: by queue
    assert order(make_router({"r1": 0, "r2": 0}), replicas, "new") == ["r2", "r1"]
    # within the slack, the fewer adapters count before the shorter queue (a stale cache's one call)
    assert order(make_router({"r1": 0, "r2": 1}), replicas, "new") == ["r2", "r1"]
    assert order(make_router({"r1": 0, "r2": 2}), replicas, "new") == ["r2", "r1"]
    three = [replica("r1", "a"), replica("r2"), replica("r3")]
    assert order(make_router({"r1": 0, "r2": 2, "r3": 5}), three, "new") == ["r2", "r1", "r3"]
    # equal in load and adapters: every router picks the same replica (rendezvous hash, not chance)
    even = [replica("r1"), replica("r2")]
    picks = {order(make_router({}), even, f"cold-{i}")[0] for i in range(40)}
    assert picks == {"r1", "r2"}
    assert all(order(make_router({}), even, "cold-7") == order(make_router({}), even[::-1], "cold-7")
               for _ in range(5))


def test_a_placement_is_remembered_before_the_replica_reports_it():
    router = make_router({})
    replicas = [replica("r1"), replica("r2")]
    first = order(router, replicas, "a")[0]
    router.on_request_routed(SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id="a")),
                             replicas[0 if first == "r1" else 1].replica_id, None)
    router._replica_queue_len_cache.lens[first] = 1  # that call is now ongoing there
    assert all(order(router, replicas, "a")[0] == first for _ in range(10))
    other = order(router, replicas, "b")[0]
    assert other != first  # the next cold adapter goes to the other replica


def test_base_model_calls_go_to_the_least_loaded():
    replicas = [replica("r1", "a"), replica("r2")]
    assert order(make_router({"r1": 5, "r2": 1}), replicas) == ["r2", "r1"]


def test_the_placement_memory_forgets_as_the_replicas_cache_would():
    """With capacity 2, a replica sent a, b, a, c is taken to hold a and c (b was least recent), so b is
    cold again: it goes by load, not to r1."""
    router = make_router({"r1": 1, "r2": 0}, capacity=2)
    replicas = [replica("r1"), replica("r2")]
    for adapter in "abac":
        routed(router, replicas[0], adapter)
    assert order(router, replicas, "a")[0] == "r1" and order(router, replicas, "c")[0] == "r1"
    assert order(router, replicas, "b")[0] == "r2"
