"""The slot tier's page allocator alone (no tensors): buddy runs, LRU eviction, pins, the anti-starvation
reservation; and the reservation rules of `AdapterManager.step` on a tiny model. Fast."""

from __future__ import annotations

import time

import pytest
import torch

from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.slot_pages import SlotPages
from loraplex.adapters.synthetic import write_random_adapter
from loraplex.adapters.tensor_reads import read_planned


def pages(num_slots=2, max_rank=64, page=8) -> SlotPages:
    return SlotPages(num_slots, max_rank, page)


def test_a_run_is_a_power_of_two_of_pages_inside_one_slot():
    p = pages()
    assert [p.pages_for(r) for r in (1, 4, 8, 9, 16, 24, 32, 48, 64)] == [1, 1, 1, 2, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="must divide"):
        SlotPages(1, 12, 8)


def test_buddy_best_fit_keeps_large_blocks_whole():
    p = pages()
    assert p.take("a", 8) == (0, [])
    assert p.take("b", 16) == (2, [])  # next to a, in slot 0's smallest free block, not slot 1
    assert p.take("c", 64) == (8, [])  # slot 1 stayed whole for a full-rank adapter
    assert p.take("d", 8) == (1, [])
    assert p.owner == ["a", "d", "b", "b", None, None, None, None] + ["c"] * 8
    assert p.slot_ranks[:9] == [8, 8, 16, 0, 0, 0, 0, 0, 64] and p.num_used_pages == 12


def test_eviction_takes_the_least_recently_used_unpinned_run_and_never_a_pinned_one():
    p = pages()
    p.take("a", 64)
    p.take("b", 64)
    p.pin("a")
    p.unpin("a")  # a is the most recently used now
    assert p.take("c", 64) == (8, [("b", 8)])
    p.pin("a")
    p.pin("c")
    assert p.find_run("d", 8) is None
    with pytest.raises(RuntimeError, match="no free or evictable pages for adapter 'd'"):
        p.take("d", 8)
    p.unpin("c")
    assert p.take("d", 8) == (8, [("c", 8)])  # c's 8 pages freed; d takes the first one
    assert "c" not in p and p.owner[8:] == ["d"] + [None] * 7


def test_a_reservation_drains_the_oldest_run_for_a_waiting_large_adapter():
    p = pages()
    for i in range(16):  # every page pinned by a rank-8 adapter; slot 0's owners are the older ones
        p.take(f"s{i}", 8)
        p.pin(f"s{i}")
    p.make_room_for("big", 64)
    assert p.reserved == ("big", 0, 8) and p.draining == {f"s{i}" for i in range(8)}
    for i in range(8, 16):  # slot 1 frees: another adapter may take it, the reserved slot stays kept
        p.unpin(f"s{i}")
    assert p.find_run("x", 8) == 8 and p.find_run("big", 64) == 8  # big may take whatever frees first
    for i in range(8):
        p.unpin(f"s{i}")
    assert p.find_run("x", 64) == 8  # never slot 0: kept for big
    slot, evicted = p.take("big", 64)  # the drained run goes first among evictable ones
    assert slot == 0 and p.reserved is None and p.draining == set()
    assert evicted == [(f"s{i}", i) for i in range(8)]


def test_a_reservation_moves_to_the_next_oldest_adapter_and_ends_when_nobody_waits():
    p = pages(num_slots=2)
    p.take("a", 64)
    p.take("b", 64)
    p.pin("a")
    p.pin("b")
    p.make_room_for("big", 64)
    assert p.reserved == ("big", 0, 8) and p.draining == {"a"}
    p.make_room_for("big", 64)  # the same adapter still waits: kept as is
    assert p.reserved == ("big", 0, 8)
    p.make_room_for("other", None)  # the oldest waiting adapter is another one, not in host memory yet
    assert p.reserved is None and p.draining == set()
    p.make_room_for("other", 64)
    assert p.reserved == ("other", 0, 8)
    p.make_room_for(None, None)
    assert p.reserved is None and p.draining == set()
    p.unpin("b")
    p.make_room_for("big", 64)  # b's run is evictable: no reservation needed
    assert p.reserved is None


@pytest.fixture
def manager(tmp_path, model_config):
    """An AdapterManager of one rank-16 slot on the tiny model, with adapters a, b (rank 8) and big (16),
    all in host memory."""
    mgr = AdapterManager(model_config, max_lora_rank=16, max_loras=1, max_cpu_loras=None, dtype=torch.float32,
                         device="cpu")
    for name, r in (("a", 8), ("b", 8), ("big", 16)):
        write_random_adapter(tmp_path / name, model_config, r=r, alpha=r, seed=r)
        mgr.register(name, tmp_path / name)
        mgr.prefetch(name)
    deadline = time.monotonic() + 30
    while len(mgr.host) < 3:
        assert time.monotonic() < deadline
        mgr.wait_for_loads(0.1)
        mgr.poll()
    yield mgr
    mgr.close()


def test_step_reserves_for_the_oldest_examined_adapter_and_keeps_it_while_admission_stops_early(manager):
    mgr = manager
    assert mgr.acquire("a") == 0 and mgr.acquire("b") == 1  # both pinned, the slot full
    assert not mgr.can_acquire("big")
    assert mgr.step(["big", "a"], num_examined=1) == {}
    assert mgr.pages.reserved == ("big", 0, 2) and mgr.pages.draining == {"a", "b"}
    assert not mgr.can_acquire("a")  # draining: no new requests for a
    mgr.step(["a", "big"], num_examined=0)  # admission stopped (full batch) before big: kept
    assert mgr.pages.reserved == ("big", 0, 2)
    mgr.step(["big"], num_examined=None)  # admission did not run: stands
    assert mgr.pages.reserved == ("big", 0, 2)
    mgr.release("a")
    mgr.release("b")
    assert mgr.acquire("big") == 0 and mgr.pages.reserved is None
    mgr.release("big")
    mgr.step([], num_examined=0)
    assert mgr.pages.reserved is None and mgr.pages.draining == set()


def test_step_reports_failed_loads_and_a_new_request_retries(manager, tmp_path, model_config):
    mgr = manager
    write_random_adapter(tmp_path / "gone", model_config, r=8, alpha=8)
    mgr.register("gone", tmp_path / "gone")
    (tmp_path / "gone" / "adapter_model.safetensors").unlink()
    mgr.step(["gone"], num_examined=1)  # starts the load
    mgr.wait_for_loads(10)
    mgr.poll()  # as the engine does before each schedule
    failed = mgr.step(["gone"], num_examined=1)
    assert list(failed) == ["gone"] and "adapter_model.safetensors" in failed["gone"]
    assert mgr.adapter_stats()["adapters"]["gone"] == "failed"
    mgr.forget_failure("gone")
    assert mgr.step(["gone"], num_examined=1) == {} and "gone" in mgr.host.loading


def test_a_validated_adapter_is_checked_once_on_the_load_thread_then_read_by_plan(manager, tmp_path, model_config):
    """The gateway registers store files validated at upload: registering reads nothing; the first load
    runs every check and records the read plan that later loads use; a file damaged since is refused
    there, reported by `step`, never raised on the engine thread."""
    mgr = manager
    write_random_adapter(tmp_path / "stored", model_config, r=8, alpha=8, seed=7)
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    mgr.register("stored", tmp_path / "stored", validated=True)
    mgr.register("damaged", tmp_path / "damaged", validated=True)  # no read here, so no error either
    assert mgr.registry["stored"].read_plan is None
    failed = {}
    deadline = time.monotonic() + 30
    while "stored" not in mgr.host or "damaged" not in failed:
        assert time.monotonic() < deadline
        mgr.poll()  # as the engine does before each schedule
        failed = mgr.step(["stored", "damaged"], num_examined=0)
        mgr.wait_for_loads(0.1)
    assert mgr.registry["stored"].read_plan is not None
    assert "r" in failed["damaged"]
    reread = read_planned(mgr.registry["stored"].read_plan, "stored", torch.float32)  # None: the plan is stale
    assert reread is not None and all(torch.equal(reread.stacked[m].A, mgr.host["stored"].stacked[m].A) for m in reread.stacked)


def test_an_adapter_whose_load_lands_is_admitted_in_the_next_step():
    """The engine takes in finished loads before it schedules: a request for a cold adapter runs in the
    step right after its load lands (two steps from idle), not a step later."""
    import tempfile

    from loraplex import LLM, SamplingParams

    llm = LLM("tiny-llama", load_format="dummy", dtype="float32", max_loras=1, max_lora_rank=8,
              kv_cache_memory=1 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_adapter(f"{tmp}/cold", llm.engine.model_config, r=8, alpha=8)
        llm.load_adapter("cold", f"{tmp}/cold")
        engine = llm.engine
        req = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "cold")
        engine.step()  # skipped (not in host memory); the load starts after admission, the step waits for it
        engine.adapters.wait_for_loads(30)
        assert all(f.done() for f, _ in engine.adapters.host.loading.values())  # landed, not yet taken in
        engine.step()
        assert req in engine.scheduler.running and req.num_output_tokens == 1


def test_a_failed_adapter_is_never_acquired_until_a_new_request_retries_it(manager):
    mgr = manager
    mgr.host.failed["a"] = "RuntimeError: no free or evictable pages"
    assert not mgr.can_acquire("a") and mgr.can_acquire("b")
    mgr.forget_failure("a")
    assert mgr.can_acquire("a")
