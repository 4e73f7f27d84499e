"""Prefix caching in the block manager and the scheduler, with a fake model runner (fast, no model).
Parity of tokens with caching on and off on the real model is in test_parity.py."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import Request, RequestStatus, SamplingParams
from loraplex.engine.scheduler import Scheduler
from tests.engine.test_scheduler import FakeAdapters

BS = 4


def req(tokens, max_tokens=4, adapter=None, identity=None, tenant_id=None):
    return Request(list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                   adapter=adapter, kv_identity=identity, tenant_id=tenant_id)


def admit(bm: BlockManager, r: Request) -> int:
    """What the scheduler does for a waiting request: take its cached prefix and blocks for the rest;
    returns the cached tokens."""
    hit = bm.computed_blocks(r)
    assert bm.allocate(r, r.num_tokens - len(hit) * BS, hit)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return len(hit) * BS


def test_a_second_request_takes_the_first_ones_full_blocks():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a, b = req(range(10)), req(list(range(10)) + [99, 98])
    assert admit(bm, a) == 0
    assert a.block_table == [0, 1, 2] and bm.num_cached_blocks == 2  # the partial third block is not
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert bm.ref_counts[0] == bm.ref_counts[1] == 2
    bm.check([a.block_table, b.block_table])
    bm.free(a)
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3  # b's block 2 (8..11) is full: registered


def test_a_prompt_cached_whole_recomputes_its_last_block():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = req(range(12))
    admit(bm, a)
    bm.free(a)
    again = req(range(12))
    assert len(bm.computed_blocks(again)) == 2  # 3 full blocks cached, the last one computed again
    assert admit(bm, again) == 8
    assert bm.num_cached_blocks == 3  # the recomputed copy of block 2 is not registered twice
    bm.free(again)
    bm.check()
    assert len(bm.free_block_ids) == 13  # ... and goes back to the free pool, not the LRU


def test_blocks_are_keyed_by_the_weights_and_every_token_before_them():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    admit(bm, req(range(9), adapter="x", identity="digest-1"))
    assert bm.computed_blocks(req(range(9), adapter="x", identity="digest-1")) != []
    assert bm.computed_blocks(req(range(9), adapter="x", identity="digest-2")) == []  # same name, new weights
    assert bm.computed_blocks(req(range(9))) == []  # the base model
    assert bm.computed_blocks(req(range(9), adapter="y", identity="digest-1")) != []  # same weights, any name
    # the second block's tokens alone do not hit: its key chains over the first block
    shifted = req([50, 51, 52, 53] + list(range(4, 9)), adapter="x", identity="digest-1")
    assert bm.computed_blocks(shifted) == []


def test_blocks_are_shared_within_one_tenant_unless_the_scope_is_global():
    for scope, shared in (("tenant", False), ("global", True)):
        bm = BlockManager(16, BS, enable_prefix_caching=True, scope=scope)
        admit(bm, req(range(9), tenant_id=1))
        assert bm.computed_blocks(req(range(9), tenant_id=1)) != []
        assert (bm.computed_blocks(req(range(9), tenant_id=2)) != []) is shared
        assert (bm.computed_blocks(req(range(9))) != []) is shared  # no tenant (the LLM API) is one more


def test_cached_blocks_are_evicted_only_when_the_free_pool_is_empty_tail_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = req(range(12))
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 3 and len(bm.free_block_ids) == 3
    b = req(range(100, 112))  # takes the 3 free blocks; a's prefix stays whole
    admit(bm, b)
    assert len(bm.computed_blocks(req(range(13)))) == 3
    bm.free(b)
    c = req(range(200, 203))  # one block: from the LRU's oldest end, which is a's last block
    admit(bm, c)
    assert len(bm.computed_blocks(req(range(13)))) == 2  # a's first two blocks still hit
    bm.free(c)
    bm.check()


def test_taking_a_cached_prefix_is_all_or_nothing():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = req(range(8))
    admit(bm, a)
    bm.free(a)  # 2 blocks in the LRU, 2 free
    big = req(list(range(8)) + list(range(100, 110)))  # 8 cached + 10 new tokens: 2 + 3 blocks > 4
    hit = bm.computed_blocks(big)
    assert len(hit) == 2
    assert not bm.allocate(big, 10, hit)
    assert big.block_table == [] and bm.ref_counts == [0, 0, 0, 0] and len(bm.evictable) == 2
    bm.check()
    assert bm.allocate(big, 8, hit)  # 2 cached + 2 new: fits, and the cached ones are not counted twice
    bm.check([big.block_table])


def test_caching_off_never_registers_or_hits():
    bm = BlockManager(8, BS)
    a = req(range(12))
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.computed_blocks(req(range(12))) == []
    assert bm.num_cached_query_tokens == 0
    bm.check()


# the scheduler ---------------------------------------------------------------------------------------
def make(num_blocks=64, caching=True, scope="tenant", **cfg):
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 64)
    config = EngineConfig(block_size=BS, max_loras=4, enable_prefix_caching=caching, prefix_cache_scope=scope, **cfg)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching, scope=scope)
    return Scheduler(config, bm, FakeAdapters(4)), bm


def step(sched: Scheduler, bm: BlockManager, token=lambda r: 7):
    """One step with a fake forward pass, through `update_from_output`; checks the invariant after it, and
    that every slot the step writes is in a block of its own request alone that no key names yet."""
    out = sched.schedule()
    for r in out.requests:
        start = r.num_computed_tokens
        for p in range(start, start + out.num_scheduled_tokens[r.request_id]):
            block = r.block_table[p // BS]
            assert bm.ref_counts[block] == 1 and bm.block_keys[block] is None, f"{r.request_id} writes block {block}"
    tokens = {r.request_id: token(r) for r in out.requests
              if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    sched.update_from_output(out, tokens, {})
    bm.check([r.block_table for r in sched.running])
    return out


def test_the_scheduler_prefills_only_what_is_not_cached():
    sched, bm = make()
    system = list(range(1, 41))  # 40 tokens: 10 blocks
    first = req(system + [100, 101, 102], max_tokens=3)
    sched.add_request(first)
    out = step(sched, bm)
    assert out.num_scheduled_tokens[first.request_id] == 43 and first.num_cached_tokens == 0
    second = req(system + [200, 201], max_tokens=2)
    sched.add_request(second)
    out = step(sched, bm)
    assert out.num_scheduled_tokens[second.request_id] == 2 and second.num_cached_tokens == 40
    assert second.block_table[:10] == first.block_table[:10]  # shared while both run
    while sched.has_unfinished():
        step(sched, bm)
    bm.check()
    assert (bm.num_cached_query_tokens, bm.num_cached_hit_tokens) == (43 + 42, 40)


def test_a_preempted_request_gets_its_own_blocks_back():
    sched, bm = make(num_blocks=64, scheduling_policy="fcfs")
    r = req(range(1, 30), max_tokens=10)
    sched.add_request(r)
    for _ in range(4):
        step(sched, bm)
    assert r.num_computed_tokens == r.num_tokens - 1 == 32  # the last sampled token is not computed yet
    sched._preempt(r)
    out = step(sched, bm)
    # every full block of prompt and output came back: 8 blocks, 32 tokens; the 33rd is computed again
    assert out.num_scheduled_tokens[r.request_id] == 1
    assert r.num_cached_tokens == 0  # what the user is told: the first admission's


def test_cached_tokens_are_not_charged_to_the_tenants_fair_share_counter():
    sched, bm = make(scope="global")
    system = list(range(1, 41))
    a = req(system + [1], max_tokens=1, tenant_id=1)
    sched.add_request(a)
    while sched.has_unfinished():
        step(sched, bm)
    b = req(system + [2], max_tokens=1, tenant_id=2)
    sched.add_request(b)
    step(sched, bm)
    assert sched.fair.counter(2) == pytest.approx(1 + 2)  # 1 prompt token computed, 1 output token (x2)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_every_block_comes_back_under_churn_with_evictions(policy):
    # shared prefixes under several identities, a KV cache that forces preemptions and evictions, aborts
    rng = random.Random(5)
    sched, bm = make(num_blocks=16, scheduling_policy=policy, scope="global", max_num_seqs=4, max_num_batched_tokens=16)
    prefixes = [list(range(1, 1 + 4 * k)) for k in (2, 3, 5)]
    identities = ["base", "d1", "d2"]
    reqs = []
    for i in range(60):
        if rng.random() < 0.6:
            r = req(rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 7))],
                    max_tokens=rng.randrange(1, 24), identity=rng.choice(identities), tenant_id=i % 3)
            sched.add_request(r)
            reqs.append(r)
        if rng.random() < 0.05 and sched.running:
            sched.finish(rng.choice(sched.running), RequestStatus.FINISHED_ABORTED)
        step(sched, bm, token=lambda r: rng.randrange(1000))
    while sched.has_unfinished():
        step(sched, bm, token=lambda r: rng.randrange(1000))
    bm.check()
    assert all(c == 0 for c in bm.ref_counts)
    assert len(bm.free_block_ids) + len(bm.evictable) == bm.num_blocks
    assert sched.num_preemptions > 0 and bm.num_cached_hit_tokens > 0 and bm.num_evicted_blocks > 0
    assert any(r.num_cached_tokens > 0 for r in reqs)
