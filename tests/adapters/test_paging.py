"""Adapter paging between disk, host memory and slots under a Zipf workload on the real default model."""

from __future__ import annotations

import gc
import random

import pytest

from loraplex import LLM, SamplingParams
from loraplex.adapters.manager import AdapterInUseError
from tests.helpers import write_random_adapter

NUM_ADAPTERS = 200
NUM_REQUESTS = 400
MAX_TOKENS = 3
HEAD_WAIT_BOUND = 25  # steps a request may wait once it is the oldest in the queue


@pytest.fixture(scope="module")
def adapter_dirs(model_path, tmp_path_factory):
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.loader import load_config

    cfg = ModelConfig.from_hf_config(load_config(model_path))
    root = tmp_path_factory.mktemp("many-adapters")
    dirs = []
    for i in range(NUM_ADAPTERS):
        r = (4, 8, 16)[i % 3]
        write_random_adapter(root / f"a{i}", cfg, r=r, alpha=2 * r, seed=i, b_std=0.2)
        dirs.append(root / f"a{i}")
    return dirs


def zipf_workload(seed: int = 0):
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(NUM_ADAPTERS)]
    names = rng.choices([f"a{i}" for i in range(NUM_ADAPTERS)], weights=weights, k=NUM_REQUESTS)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 9))] for _ in range(NUM_REQUESTS)]
    return prompts, names


def test_zipf_over_200_adapters_with_4_slots(model_path, adapter_dirs):
    llm = LLM(str(model_path), dtype="float32", max_loras=4, max_cpu_loras=16, max_lora_rank=16,
              max_num_seqs=32, kv_cache_memory=64 << 20)
    for i, d in enumerate(adapter_dirs):
        llm.load_adapter(f"a{i}", d)
    engine, mgr = llm.engine, llm.engine.adapters
    assert mgr.adapter_stats()["tiers"]["cpu"]["used"] == 0  # registering loads nothing

    evicted_pinned = []
    original_evict = mgr._evict_slot

    def checked_evict(name):
        if mgr.refcount.get(name):
            evicted_pinned.append(name)
        original_evict(name)

    mgr._evict_slot = checked_evict

    prompts, names = zipf_workload()
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    reqs, became_head, admitted = [], {}, {}
    step = 0
    while len(reqs) < NUM_REQUESTS or engine.has_unfinished_requests():
        for _ in range(25 if len(reqs) < NUM_REQUESTS else 0):  # requests keep arriving, 25 a step
            i = len(reqs)
            reqs.append(engine.add_request(prompts[i], greedy, names[i]))
        engine.step()
        step += 1
        assert len(mgr.slot_of) <= 4 and len(mgr.cpu) + len(mgr.loading) <= 16
        assert all(r.lora_slot == mgr.slot_of[r.adapter] for r in engine.scheduler.running if r.lora_slot >= 0)
        if engine.scheduler.waiting:
            became_head.setdefault(engine.scheduler.waiting[0].request_id, step)
        for r in engine.scheduler.running:
            admitted.setdefault(r.request_id, step)
        assert step < 5000, "the workload does not finish"
    assert not evicted_pinned
    assert all(r.is_finished and r.num_output_tokens == MAX_TOKENS for r in reqs)
    waits = [admitted.get(rid, step) - s for rid, s in became_head.items()]
    assert max(waits) <= HEAD_WAIT_BOUND, f"a request waited {max(waits)} steps at the head of the queue"

    stats = llm.adapter_stats()
    gpu, cpu = stats["tiers"]["gpu"], stats["tiers"]["cpu"]
    assert gpu["evictions"] > 0 and cpu["evictions"] > 0 and cpu["misses"] >= len(set(names)) > 16
    assert gpu["hits"] + gpu["misses"] == NUM_REQUESTS
    assert cpu["load_s_p50"] is not None and gpu["load_s_p99"] >= gpu["load_s_p50"]
    assert set(stats["adapters"].values()) <= {"gpu", "cpu", "disk"} and not stats["pinned"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    # The same requests with each adapter fully resident: groups of at most 4 adapters at a time.
    reference = LLM(str(model_path), dtype="float32", max_loras=4, max_lora_rank=16, kv_cache_memory=64 << 20)
    used = sorted(set(names), key=lambda n: int(n[1:]))
    for n in used:
        reference.load_adapter(n, adapter_dirs[int(n[1:])])
    for g in range(0, len(used), 4):
        group = set(used[g:g + 4])
        idx = [i for i, n in enumerate(names) if n in group]
        outs = reference.generate([prompts[i] for i in idx], greedy, adapters=[names[i] for i in idx])
        for i, out in zip(idx, outs, strict=True):
            assert reqs[i].output_token_ids == out.token_ids, f"request {i} on {names[i]}"


def test_unload_in_use_is_refused_and_failed_loads_abort(model_path, adapter_dirs, tmp_path):
    import shutil

    llm = LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=16, kv_cache_memory=16 << 20)
    llm.load_adapter("a0", adapter_dirs[0])
    engine = llm.engine
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "a0")
    with pytest.raises(AdapterInUseError, match="waiting request"):
        llm.unload_adapter("a0")
    while not engine.scheduler.running:
        engine.step()
    with pytest.raises(AdapterInUseError, match="running request"):
        llm.unload_adapter("a0")
    while engine.has_unfinished_requests():
        engine.step()
    assert req.is_finished
    llm.unload_adapter("a0")
    assert llm.list_adapters() == [] and llm.adapter_stats()["tiers"]["gpu"]["used"] == 0

    # Files that vanish after registration: the request ends with "abort", the engine keeps going.
    shutil.copytree(adapter_dirs[1], tmp_path / "gone")
    llm.load_adapter("gone", tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2, ignore_eos=True), adapters=["gone", None])
    assert outs[0].finish_reason == "abort" and outs[1].finish_reason == "length"
    assert llm.adapter_stats()["adapters"]["gone"] == "failed"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_repeated_load_and_unload_of_1000_adapters_does_not_leak(tmp_path):
    """~1 MB adapters on the tiny dummy model: a leak of the 1,000 would show as ~1 GB of RSS."""
    llm = LLM("tiny-llama", load_format="dummy", dtype="float32", max_loras=2, max_cpu_loras=4,
              max_lora_rank=64, kv_cache_memory=1 << 20)
    cfg = llm.engine.model_config
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dirs = []
    for i in range(4):
        write_random_adapter(tmp_path / f"t{i}", cfg, r=64, alpha=64, targets=targets, seed=i)
        dirs.append(tmp_path / f"t{i}")
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def cycle(i):
        llm.load_adapter(f"x{i}", dirs[i % 4])
        llm.generate([[1, 2, 3]], params, adapters=f"x{i}")
        llm.unload_adapter(f"x{i}")

    for i in range(100):
        cycle(i)
    gc.collect()
    before = _rss_bytes()
    for i in range(100, 1100):
        cycle(i)
    gc.collect()
    grown = _rss_bytes() - before
    mgr = llm.engine.adapters
    assert not mgr.registry and not mgr.cpu and not mgr.loading and not mgr.slot_of and not mgr.refcount
    assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.0f} MiB over 1,000 load/unload cycles"
