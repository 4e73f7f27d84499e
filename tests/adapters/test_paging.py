"""Adapter paging between disk, host memory and the paged slot tier (S-LoRA unified paging) on the real
default model: a Zipf workload, many small adapters in few slots, mixed ranks, eviction, unloading."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.adapters.manager import AdapterInUseError
from loraplex.kernels import cpu_ext
from tests.helpers import write_random_adapter

NUM_ADAPTERS = 200
NUM_REQUESTS = 400
MAX_TOKENS = 3
HEAD_WAIT_BOUND = 25  # steps a request may wait once it is the oldest in the queue


@pytest.fixture(scope="module")
def adapter_dirs(model_path, tmp_path_factory):
    from loraplex.engine.loader import load_config
    from loraplex.model_config import ModelConfig

    cfg = ModelConfig.from_hf_config(load_config(model_path))
    root = tmp_path_factory.mktemp("many-adapters")
    dirs = []
    for i in range(NUM_ADAPTERS):
        r = (4, 8, 16)[i % 3]
        write_random_adapter(root / f"a{i}", cfg, r=r, alpha=2 * r, seed=i, b_std=0.2)
        dirs.append(root / f"a{i}")
    return dirs


def watch_pinned_evictions(mgr) -> list[str]:
    """Wrap mgr.pages.evict so every eviction of a pinned adapter is recorded in the returned list."""
    evicted_pinned: list[str] = []
    original_evict = mgr.pages.evict

    def checked_evict(name):
        if mgr.pages.refcount.get(name):
            evicted_pinned.append(name)
        return original_evict(name)

    mgr.pages.evict = checked_evict
    return evicted_pinned


def assert_pages_consistent(mgr) -> None:
    """Resident adapters' runs of pages: inside the capacity, never overlapping, each aligned and inside one
    physical slot, large enough for the rank, matching `owner`; `slot_ranks` holds ranks only at their slots."""
    pages = {}
    for name, v in mgr.pages.slot_of.items():
        rank = mgr.slot_ranks[v]
        n = mgr.pages.pages_for(rank)
        assert 0 < rank <= n * mgr.pages.page and v % n == 0, f"{name}: rank {rank} in {n} pages at {v}"
        assert v // mgr.pages.pages_per_slot == (v + n - 1) // mgr.pages.pages_per_slot, f"{name} crosses a physical slot"
        for p in range(v, v + n):
            assert p not in pages, f"{name} and {pages[p]} share page {p}"
            pages[p] = name
    assert pages == {p: o for p, o in enumerate(mgr.pages.owner) if o is not None}
    resident = set(mgr.pages.slot_of.values())
    assert all(r == 0 for v, r in enumerate(mgr.slot_ranks) if v not in resident)
    slots = mgr.adapter_stats()["tiers"]["slots"]
    assert slots["used"] == len(pages) * mgr.pages.page <= slots["capacity"] == mgr.num_slots * mgr.max_lora_rank
    assert slots["adapters"] == len(mgr.pages.slot_of)


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

    evicted_pinned = watch_pinned_evictions(mgr)

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
        assert_pages_consistent(mgr)
        assert len(mgr.host) + len(mgr.host.loading) <= 16
        assert all(r.virtual_slot == mgr.pages.slot_of[r.adapter] for r in engine.scheduler.running if r.virtual_slot >= 0)
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
    slots, cpu = stats["tiers"]["slots"], stats["tiers"]["cpu"]
    assert slots["evictions"] > 0 and cpu["evictions"] > 0 and cpu["misses"] >= len(set(names)) > 16
    assert slots["hits"] + slots["misses"] == NUM_REQUESTS
    assert cpu["load_s_p50"] is not None and slots["load_s_p99"] >= slots["load_s_p50"]
    assert set(stats["adapters"].values()) <= {"slots", "cpu", "disk"} and not stats["pinned"]
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
    with pytest.raises(AdapterInUseError, match="used by 1 unfinished request"):  # waiting
        llm.unload_adapter("a0")
    while not engine.scheduler.running:
        engine.step()
    with pytest.raises(AdapterInUseError, match="used by 1 unfinished request"):  # running
        llm.unload_adapter("a0")
    while engine.has_unfinished_requests():
        engine.step()
    assert req.is_finished
    llm.unload_adapter("a0")
    assert llm.list_adapters() == [] and llm.adapter_stats()["tiers"]["slots"]["used"] == 0

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
    assert not mgr.registry and not mgr.host and not mgr.host.loading and not mgr.pages.slot_of and not mgr.pages.refcount
    assert not any(mgr.pages.owner) and not any(mgr.slot_ranks)
    assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.0f} MiB over 1,000 load/unload cycles"


def _wait_in_host_memory(mgr, names) -> None:
    """Load `names` into the CPU tier (the scheduler's prefetch, done up front)."""
    for n in names:
        mgr.prefetch(n)
    deadline = time.monotonic() + 120
    while not all(n in mgr.host for n in names):
        assert time.monotonic() < deadline, "adapters did not load"
        time.sleep(0.01)
        mgr.poll()


def test_16_rank_8_adapters_share_2_slots_of_rank_64_in_one_batch(model_path, tmp_path):
    """max_loras=2 of rank 64 is 128 rank rows: 16 rank-8 adapters resident and batched in one step."""
    llm = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=64, kv_cache_memory=64 << 20)
    engine, mgr = llm.engine, llm.engine.adapters
    assert mgr.pages.page == 8 and mgr.pages.num_pages == 16 and len(mgr.slot_ranks) == 16
    names = [f"s{i}" for i in range(16)]
    for i, n in enumerate(names):
        write_random_adapter(tmp_path / n, engine.model_config, r=8, alpha=16, seed=100 + i, b_std=0.2)
        llm.load_adapter(n, tmp_path / n)
    _wait_in_host_memory(mgr, names)

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 9))] for _ in names]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(p, greedy, n) for p, n in zip(prompts, names, strict=True)]
    engine.step()
    assert {r.adapter for r in engine.scheduler.running} == set(names) and not engine.scheduler.waiting
    assert len(mgr.pages.slot_of) == 16 and sorted(mgr.pages.slot_of.values()) == list(range(16))
    assert_pages_consistent(mgr)
    slots = mgr.adapter_stats()["tiers"]["slots"]
    assert (slots["used"], slots["capacity"], slots["adapters"], slots["page_rows"], slots["evictions"]) == (128, 128, 16, 8, 0)
    while engine.has_unfinished_requests():
        engine.step()

    # Each adapter alone, on an engine whose slots are not paged (rank 12 is no multiple of 8: a page is a slot).
    alone = LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=12, kv_cache_memory=16 << 20)
    assert alone.engine.adapters.pages.page == 12
    for i, n in enumerate(names):
        alone.load_adapter(n, tmp_path / n)
        out = alone.generate([prompts[i]], greedy, adapters=n)[0]
        assert reqs[i].output_token_ids == out.token_ids, f"adapter {n}"
    base = alone.generate(prompts, greedy)
    assert sum(r.output_token_ids != b.token_ids for r, b in zip(reqs, base, strict=True)) >= 8


def test_rank_64_adapter_gets_a_whole_slot_while_small_pinned_adapters_keep_running(model_path, tmp_path):
    """Small rank-8 / rank-16 adapters, pinned by a steady stream of requests, fill both slots; a rank-64
    adapter waits: a slot is reserved and drained for it, it runs within a bounded wait, and the small
    adapters of the other slot run on meanwhile."""
    llm = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=64, kv_cache_memory=64 << 20)
    engine, mgr = llm.engine, llm.engine.adapters
    cfg = engine.model_config
    small = {**{f"r8_{i}": 8 for i in range(6)}, **{f"r16_{i}": 16 for i in range(5)}}  # 6 + 5 x 2 = 16 pages
    for i, (n, r) in enumerate({**small, "big": 64}.items()):
        write_random_adapter(tmp_path / n, cfg, r=r, alpha=r, seed=200 + i, b_std=0.2)
        llm.load_adapter(n, tmp_path / n)
    _wait_in_host_memory(mgr, [*small, "big"])
    evicted_pinned = watch_pinned_evictions(mgr)

    rng = random.Random(2)
    names = list(small)
    reqs, big_req, big_admitted_at, small_with_big, admitted_while_waiting = [], None, None, 0, 0
    for step in range(1, 300):
        if step <= 40:  # a steady stream keeps the small adapters pinned
            for _ in range(1 if step > 1 else len(names)):
                n = names[len(reqs) % len(names)]
                p = SamplingParams(max_tokens=rng.randrange(6, 12), temperature=0, ignore_eos=True)
                reqs.append(engine.add_request([rng.randrange(100, 40000) for _ in range(4)], p, n))
        if step == 3:
            assert sum(o is not None for o in mgr.pages.owner) == 16 and all(mgr.pages.refcount.get(n) for n in names)
            big_req = engine.add_request([11, 12, 13, 14], SamplingParams(max_tokens=4, temperature=0,
                                                                           ignore_eos=True), "big")
        before, draining = set(engine.scheduler.running), set(mgr.pages.draining)
        engine.step()
        assert_pages_consistent(mgr)
        admitted = [r for r in engine.scheduler.running if r not in before]
        running = {r.adapter for r in engine.scheduler.running}
        if "big" in running:
            if big_admitted_at is None:
                big_admitted_at = step
                v = mgr.pages.slot_of["big"]
                assert v % mgr.pages.pages_per_slot == 0 and mgr.pages.owner[v:v + mgr.pages.pages_per_slot] == ["big"] * 8
                assert mgr.pages.reserved is None or mgr.pages.reserved[0] != "big"  # maybe already kept for the next one
            small_with_big = max(small_with_big, len(running & set(names)))
        elif big_req is not None and big_admitted_at is None:  # big waits: its slot drains, the other runs
            assert mgr.pages.reserved is not None and mgr.pages.reserved[0] == "big" and mgr.pages.draining
            assert not any(r.adapter in draining for r in admitted), "a draining adapter admitted a request"
            admitted_while_waiting += len(admitted)
        if step > 40 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "the workload does not finish"
    assert not evicted_pinned
    assert big_admitted_at is not None and big_admitted_at - 3 <= 20, f"big waited {big_admitted_at - 3} steps"
    assert admitted_while_waiting > 0 and small_with_big > 0, "small adapters stopped while big waited or ran"
    assert all(r.is_finished and r.num_output_tokens == r.sampling_params.max_tokens for r in [*reqs, big_req])
    alone = llm.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         adapters="big")[0]
    assert big_req.output_token_ids == alone.token_ids


def test_evicted_and_unloaded_adapters_leave_zero_rows(tmp_path):
    """A rank-16 adapter evicted for a rank-8 one: rows 8..15 are zero again and rows 0..7 hold exactly the
    new adapter; unloading that one leaves every buffer all zero."""
    llm = LLM("tiny-llama", load_format="dummy", dtype="float32", max_loras=1, max_lora_rank=16,
              kv_cache_memory=1 << 20)
    cfg, mgr = llm.engine.model_config, llm.engine.adapters
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for n, r in (("wide", 16), ("narrow", 8)):
        write_random_adapter(tmp_path / n, cfg, r=r, alpha=r, targets=targets, seed=r)
        llm.load_adapter(n, tmp_path / n)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    buffers = [w for layer in mgr.buffers for w in layer.values()]
    llm.generate([[1, 2, 3]], params, adapters="wide")
    assert mgr.pages.slot_of == {"wide": 0} and all(w.A[0, 8:16].abs().sum() > 0 for w in buffers)

    llm.generate([[1, 2, 3]], params, adapters="narrow")
    assert dict(mgr.pages.slot_of) == {"narrow": 0} and mgr.slot_stats.evictions == 1
    narrow = mgr.host["narrow"]
    for layer, modules in enumerate(mgr.buffers):
        for module, w in modules.items():
            m = narrow.modules[layer, module]
            assert torch.equal(w.A[0, :8], m.A) and torch.equal(w.B[0, :, :8], m.B)
            assert not w.A[0, 8:].any() and not w.B[0, :, 8:].any()
            assert not w.BT[0, 8:].any()  # page 1
            # the compiled CPU kernel reads A and BT; only the gathers (where it has no vector path for
            # the dtype: bf16/fp16 without AVX-512) read AT
            assert (w.AT is None) == (cpu_ext.get(w.A.dtype) is not None)
            assert w.ranks_list == [8, 0] and w.scales_list[1] == 0.0

    llm.unload_adapter("narrow")
    for w in buffers:
        assert not (w.A.any() or w.B.any() or w.BT.any() or w.ranks.any() or w.scales.any())
    assert not any(mgr.pages.owner) and mgr.adapter_stats()["tiers"]["slots"]["used"] == 0


def test_load_thread_uses_one_torch_thread_and_leaves_the_others_alone():
    """The background loads run single-threaded (an OpenMP team of their own next to the engine's
    oversubscribes the cores); the caller and threads started later keep torch's thread count."""
    before = torch.get_num_threads()
    mgr = LLM("tiny-llama", load_format="dummy", dtype="float32", kv_cache_memory=1 << 20).engine.adapters
    assert mgr.host.run_on_loader(torch.get_num_threads) == 1
    assert torch.get_num_threads() == before
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [before]


def test_reservation_holds_while_the_batch_is_full(model_path, tmp_path):
    """With the batch full (max_num_seqs) most steps, admission does not look at the queue; the run
    reserved for a waiting rank-64 adapter stays reserved and its owners keep draining through those
    steps, instead of taking new requests whenever a sequence finishes, so big gets its slot."""
    llm = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=64, max_num_seqs=6,
              kv_cache_memory=64 << 20)
    engine, mgr = llm.engine, llm.engine.adapters
    cfg = engine.model_config
    small = {f"r16_{i}": 16 for i in range(8)}  # 8 x 2 pages: both slots
    for i, (n, r) in enumerate({**small, "big": 64}.items()):
        write_random_adapter(tmp_path / n, cfg, r=r, alpha=r, seed=300 + i, b_std=0.2)
        llm.load_adapter(n, tmp_path / n)
    _wait_in_host_memory(mgr, [*small, "big"])
    names = list(small)
    for n in names:  # every small adapter resident, so each slot holds some
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, ignore_eos=True), adapters=n)
    assert sum(o is not None for o in mgr.pages.owner) == 16

    rng = random.Random(3)
    reqs, big_req, big_admitted_at = [], None, None
    for step in range(1, 400):
        if step <= 80:  # more small requests than the batch holds: the queue never empties
            for _ in range(2):
                n = names[len(reqs) % len(names)]
                p = SamplingParams(max_tokens=rng.randrange(2, 6), temperature=0, ignore_eos=True)
                reqs.append(engine.add_request([rng.randrange(100, 40000) for _ in range(3)], p, n))
        if step == 5:
            big_req = engine.add_request([11, 12, 13], SamplingParams(max_tokens=3, temperature=0,
                                                                       ignore_eos=True), "big")
        engine.step()
        assert_pages_consistent(mgr)
        if big_admitted_at is None and big_req is not None:
            if big_req in engine.scheduler.running or big_req.is_finished:
                big_admitted_at = step
            elif step > 6:
                assert mgr.pages.reserved is not None and mgr.pages.reserved[0] == "big", f"step {step}: reservation dropped"
        if step > 80 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert big_admitted_at is not None and big_admitted_at - 5 <= 40, f"big waited {big_admitted_at} steps"
    assert all(r.is_finished for r in [*reqs, big_req])
