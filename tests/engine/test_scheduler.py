"""Scheduler and block manager with a fake model runner: fast, no model."""

from __future__ import annotations

import pytest

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import Request, RequestStatus, SamplingParams
from loraplex.engine.scheduler import Scheduler


class FakeAdapters:
    """Slot accounting only: `num_slots` slots, LRU of unpinned residents (as AdapterManager); the four
    methods the scheduler calls (`AdapterSlots`). `failed` is what `step` reports."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.resident: list[str] = []
        self.refcount: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.steps: list[tuple[list, int | None]] = []

    def step(self, waiting, num_examined):
        self.steps.append((list(waiting), num_examined))
        return self.failed

    def can_acquire(self, name):
        return name in self.resident or len(self.resident) < self.num_slots or any(
            not self.refcount.get(n) for n in self.resident)

    def acquire(self, name):
        if not self.can_acquire(name):
            return None
        if name not in self.resident:
            if len(self.resident) == self.num_slots:
                self.resident.remove(next(n for n in self.resident if not self.refcount.get(n)))
            self.resident.append(name)
        self.refcount[name] = self.refcount.get(name, 0) + 1
        return self.resident.index(name)

    def release(self, name):
        self.refcount[name] -= 1


def make(num_blocks=64, block_size=4, slots=4, **cfg):
    cfg.setdefault("max_num_seqs", 8)
    cfg = EngineConfig(block_size=block_size, max_loras=slots, **cfg)
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(cfg, bm, FakeAdapters(slots)), bm


def req(n_prompt, max_tokens=8, adapter=None):
    return Request(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0), adapter=adapter)


def run_step(sched: Scheduler):
    """What the engine does after the model ran: count computed tokens, append a token, finish."""
    out = sched.schedule()
    for r in out.requests:
        r.num_computed_tokens += out.num_scheduled_tokens[r.request_id]
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


def test_block_manager_slots_and_free():
    bm = BlockManager(num_blocks=3, block_size=4)
    r = req(5)
    assert bm.num_blocks_needed(r, 5) == 2
    assert bm.allocate(r, 5)
    assert r.block_table == [0, 1]
    assert [bm.slot(r, p) for p in range(5)] == [0, 1, 2, 3, 4]
    r.num_computed_tokens = 5
    assert bm.num_blocks_needed(r, 3) == 0  # positions 5..7 fit in block 1
    assert not bm.allocate(r, 8)  # needs 2 more blocks, 1 free: refused, nothing taken
    assert bm.num_free_blocks == 1 and r.block_table == [0, 1]
    bm.free(r)
    assert bm.num_free_blocks == 3 and r.block_table == []


def test_long_prompt_is_prefilled_in_chunks_then_decodes():
    sched, _ = make(max_num_batched_tokens=32)
    r = req(100, max_tokens=3)
    sched.add_request(r)
    chunks = [run_step(sched).num_scheduled_tokens[r.request_id] for _ in range(6)]
    assert chunks == [32, 32, 32, 4, 1, 1]
    assert r.is_finished and r.num_output_tokens == 3


def test_prefill_chunks_and_decodes_share_a_step():
    sched, _ = make(max_num_batched_tokens=16)
    a = req(4, max_tokens=10)
    sched.add_request(a)
    run_step(sched)  # a prefilled, decoding from now on
    b = req(40)
    sched.add_request(b)
    out = run_step(sched)
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 15}


def test_requests_join_and_leave_at_any_step():
    sched, bm = make(max_num_batched_tokens=64)
    a, b = req(4, max_tokens=2), req(4, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    run_step(sched)
    assert a.is_finished and not b.is_finished
    assert a.block_table == []  # freed the step it finished
    c = req(4, max_tokens=2)
    sched.add_request(c)
    out = run_step(sched)
    assert set(out.num_scheduled_tokens) == {b.request_id, c.request_id}


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = make(max_num_seqs=2)
    rs = [req(4) for _ in range(3)]
    for r in rs:
        sched.add_request(r)
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == [rs[0].request_id, rs[1].request_id]
    assert list(sched.waiting) == [rs[2]]


def test_kv_pressure_preempts_the_newest_and_recomputes_it():
    sched, bm = make(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old, new = req(8, max_tokens=12), req(8, max_tokens=12)
    sched.add_request(old)
    sched.add_request(new)
    run_step(sched)  # 2 blocks each, 2 free
    preempted = []
    for _ in range(40):
        out = run_step(sched)
        preempted += out.preempted
        assert bm.num_free_blocks + sum(len(r.block_table) for r in sched.running) == 6
        if not sched.has_unfinished():
            break
    assert preempted and preempted[0] is new
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.is_finished and new.is_finished
    assert new.num_output_tokens == 12 and old.num_output_tokens == 12
    assert bm.num_free_blocks == 6


def test_request_with_unavailable_adapter_is_skipped_not_blocking():
    sched, _ = make(slots=1)
    a = req(4, max_tokens=5, adapter="a")
    sched.add_request(a)
    run_step(sched)  # "a" pinned in the only slot
    b, base = req(4, adapter="b"), req(4)
    sched.add_request(b)
    sched.add_request(base)
    out = run_step(sched)
    assert base.request_id in out.num_scheduled_tokens
    assert b.request_id not in out.num_scheduled_tokens
    assert list(sched.waiting) == [b]  # keeps its place at the head
    while not a.is_finished:
        run_step(sched)
    out = run_step(sched)
    assert b.request_id in out.num_scheduled_tokens  # slot freed: b gets it


def test_static_batching_admits_only_when_the_batch_is_done():
    sched, _ = make(static_batching=True, max_num_batched_tokens=8)
    a, b = req(4, max_tokens=3), req(12, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    first = run_step(sched)
    assert set(first.num_scheduled_tokens) == {a.request_id, b.request_id}
    assert len(sched.running) == 2
    c = req(4)
    sched.add_request(c)
    while a in sched.running or b in sched.running:
        assert c.request_id not in run_step(sched).num_scheduled_tokens
    assert c.request_id in run_step(sched).num_scheduled_tokens


def test_engine_config_checks_itself():
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=-1)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_num_seqs \(32\)"):
        EngineConfig(max_num_batched_tokens=16, max_num_seqs=32)


def test_waiting_queue_room_counts_free_places_and_tokens():
    sched, _ = make(max_num_seqs=2, max_num_waiting_seqs=2, max_num_waiting_tokens=30)
    assert sched.cfg.max_num_waiting_seqs == 2
    assert sched.has_room(50, 10_000)  # an empty queue takes any call
    for _ in range(3):
        sched.add_request(req(4))
    # 3 waiting, 0 running: 2 free places + 2 waiting places = 4
    assert sched.has_room(1, 4) and not sched.has_room(2, 4)
    assert sched.num_waiting_tokens == 12
    assert sched.has_room(1, 18) and not sched.has_room(1, 19)  # 12 + 18 <= 30 < 12 + 19
    run_step(sched)  # 2 admitted and running, 1 waiting: no free place left
    assert len(sched.running) == 2 and sched.num_waiting_tokens == 4
    assert sched.has_room(1, 4) and not sched.has_room(2, 4)


def test_waiting_bounds_default_from_the_batch():
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256)
    assert (cfg.max_num_waiting_seqs, cfg.max_num_waiting_tokens) == (16, 32 * 256)
    with pytest.raises(ValueError, match="max_num_waiting_seqs must be >= 1, got 0"):
        EngineConfig(max_num_waiting_seqs=0)


def test_estimated_wait_is_the_running_requests_tokens_left_times_the_step_time():
    sched, _ = make(max_num_seqs=2, max_num_batched_tokens=64, max_num_waiting_seqs=10, max_queue_wait_s=2.0)
    a, b = req(4, max_tokens=10), req(4, max_tokens=30)
    sched.add_request(a)
    sched.add_request(b)
    prefill = run_step(sched)  # both running, one token each: 9 and 29 left
    assert sched.estimated_wait_s(1) == 0.0  # no step timed yet
    sched.observe_step_time(prefill, 5.0)  # a step that prefills does not count
    assert sched.step_time_s == 0.0
    decode = sched.schedule()
    for r in decode.requests:  # run_step's update, without its new token: 9 and 29 left still
        r.num_computed_tokens += 1
    sched.observe_step_time(decode, 0.1)
    sched.observe_step_time(decode, 0.2)
    assert sched.step_time_s == pytest.approx(0.11)  # 0.9 * 0.1 + 0.1 * 0.2
    assert sched.estimated_wait_s(1) == pytest.approx(9 * 0.11)  # a's place
    assert sched.estimated_wait_s(2) == pytest.approx(29 * 0.11)  # then b's
    assert sched.estimated_wait_s(3) == pytest.approx((29 + 9) * 0.11)  # a round later
    sched.add_request(req(4))  # 1 waiting: the queue is not empty, so the wait counts
    assert sched.has_room(0, 0)  # 9 x 0.11 s <= 2 s
    assert not sched.has_room(1, 4)  # the new one waits for b's place: 29 x 0.11 > 2 s


def test_an_adapter_that_cannot_be_placed_ends_its_request_alone():
    sched, bm = make(slots=2)
    broken = req(4, adapter="broken")
    ok, base = req(4, adapter="ok"), req(4)

    def acquire(name, real=sched.adapters.acquire):
        if name == "broken":
            raise RuntimeError("no free or evictable pages")
        return real(name)

    sched.adapters.acquire = acquire
    for r in (broken, ok, base):
        sched.add_request(r)
    out = run_step(sched)
    assert out.aborted == [broken] and broken.finish_reason == "abort"
    assert broken.error == "adapter 'broken' could not be placed in a slot: no free or evictable pages"
    assert broken.block_table == []
    assert set(out.num_scheduled_tokens) == {ok.request_id, base.request_id}
    assert bm.num_free_blocks + sum(len(r.block_table) for r in sched.running) == bm.num_blocks


def test_places_blocked_by_the_kv_cache_are_not_room():
    sched, _ = make(num_blocks=2, block_size=4, max_num_seqs=4, max_num_waiting_seqs=1, max_num_batched_tokens=64)
    for _ in range(3):
        sched.add_request(req(4))
    run_step(sched)  # two take the two blocks; the third waits for KV, not for a place
    assert len(sched.running) == 2 and len(sched.waiting) == 1 and sched.is_kv_limited
    assert sched.num_free_places == 0
    assert not sched.has_room(1, 4)  # 2 waiting > 1 + 0 free places (2 would be free by count)


def test_requests_on_their_way_count_as_waiting():
    sched, _ = make(max_num_seqs=2, max_num_waiting_seqs=2)
    assert sched.has_room(1, None, num_ahead=3)  # 2 free places + 2 waiting places hold 3 + 1
    assert not sched.has_room(1, None, num_ahead=4)  # an idle engine sheds a burst beyond them
