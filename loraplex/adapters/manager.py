"""Adapter paging between three tiers: disk, host memory (CPU) and the engine's adapter slots.

Letters: S adapter slots (`max_loras`), R max rank (`max_lora_rank`), L layers, P pages per slot,
V = S x P pages (virtual slots).

- disk: every registered adapter (validated at registration, tensors dropped; a read plan is kept so
  later loads of the unchanged files skip parsing, `read_planned`);
- CPU: an LRU cache of loaded adapters, at most `max_cpu_loras` (pinned host memory on CUDA);
- slots: the per-layer buffers the LoRA op reads (`LoRAWeights`, A [S, R, H_in], B [S, H_out, R]),
  each projection's layers stacked in one `LoRAStack` so an adapter is copied in with a few copies per
  projection; on the CPU path these are the "GPU" tier.

The slot tier is paged by rank (S-LoRA's unified paging, arXiv:2311.03285): its S x R rank rows are
cut into pages of `page` rows (`LORA_PAGE_ROWS`, or R when that does not divide R). An adapter of
rank r takes a run of ceil(r / page) pages rounded up to a power of two, aligned to its length inside
one physical slot (a buddy allocator's blocks: any run can be freed by evicting the adapters inside it
or the one around it, so fragmentation stays bounded); its first page is its virtual slot, the id the
kernels take. S slots of max rank 64 hold 8 S rank-8 adapters at once, not S. A free run is taken
first (buddy best fit), else one whose owners are all unpinned, least recently used first; evicted
adapters' rows are zeroed (or, at the new adapter's own virtual slot, overwritten and zeroed past its
rank), so rows no adapter owns stay zero.

Disk -> CPU loads run on a background thread; the scheduler never waits for one (`can_acquire` says
no and starts the load, S-LoRA / vLLM style). CPU -> slot copies are a plain copy on CPU and run on a
side CUDA stream on GPU. A request pins its adapter (reference count) from admission to finish or
preemption; pinned adapters are never evicted from any tier.

No starvation (after LoRAX's adapter exchange): when the oldest waiting request's adapter cannot get
pages because every run it could take holds a pinned adapter, the run whose owners got their pages
earliest is reserved for it: no other adapter takes pages there, and its owners are put to *draining*:
they admit no new requests, and once their running requests finish the run goes to the waiting adapter.
Same verbs as the KV block manager, saying no with None / False: `can_acquire`, `acquire`, `release`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import torch

from loraplex.adapters.peft import AdapterError, LoRAAdapter, ReadPlan, load_peft_adapter, read_planned
from loraplex.engine.config import LORA_FUSED_GROUPS, LORA_PAGE_ROWS, EngineConfig, ModelConfig
from loraplex.kernels import LoRAStack, LoRAWeights

logger = logging.getLogger(__name__)

PREFETCH_LOOKAHEAD = 32  # waiting requests whose adapters are prefetched


class AdapterInUseError(RuntimeError):
    """An adapter that running or waiting requests use cannot be unloaded."""


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _one_torch_thread() -> None:
    """Initializer of the load thread: its torch ops run on one core.

    The loads' stacking and checks are large enough for torch to split them over every core, and an
    OpenMP team in this thread next to the engine's oversubscribes the CPU: on the 2-core paging
    benchmark that cost the whole run a quarter of its throughput (0.76 -> 0.53 of base-only).
    `torch.set_num_threads` sets the calling thread's count but also the default that threads take on
    their first torch op; the constructing thread puts that default back at once (`AdapterManager`).
    """
    torch.get_num_threads()  # this thread's first torch call: it takes the default now, not later
    torch.set_num_threads(1)


class AdapterManager:
    """Registered adapters and their residency in the CPU cache and the slot tier's V pages.

    `slot_of[name]` is a resident adapter's virtual slot, `slot_ranks` (length V) the rank at each
    virtual slot (0 elsewhere), `owner` (length V) the adapter holding each page.
    """

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: torch.dtype,
                 device: torch.device | str):
        self.model_cfg = model_cfg
        self.max_lora_rank = engine_cfg.max_lora_rank
        self.num_slots = engine_cfg.max_loras
        self.page = LORA_PAGE_ROWS if self.max_lora_rank % LORA_PAGE_ROWS == 0 else self.max_lora_rank
        self.pages_per_slot = self.max_lora_rank // self.page  # P
        self.num_pages = self.num_slots * self.pages_per_slot  # V, also the number of virtual slots
        self.max_cpu_loras = engine_cfg.max_cpu_loras
        self.dtype = dtype
        self.device = torch.device(device)
        # stacks[module]: every layer's slot buffers of a targetable projection in one allocation;
        # buffers[layer][module]: layer `layer`'s views of them, what the model's LoRA ops read.
        self.stacks: dict[str, LoRAStack] = {}
        for group in LORA_FUSED_GROUPS:
            h_in = model_cfg.lora_module_shape(group[0])[0]
            outs = [model_cfg.lora_module_shape(m)[1] for m in group]
            self.stacks.update(zip(group, LoRAStack.empty_group(model_cfg.num_hidden_layers, self.num_slots,
                                                                self.max_lora_rank, h_in, outs, dtype, device,
                                                                page=self.page), strict=True))
        self.buffers: list[dict[str, LoRAWeights]] = [
            {m: stack.layers[layer] for m, stack in self.stacks.items()}
            for layer in range(model_cfg.num_hidden_layers)
        ]
        self.registry: dict[str, Path] = {}  # disk tier
        self.plans: dict[str, ReadPlan | None] = {}  # how to read each registered adapter without parsing
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.loading: dict[str, tuple[Future, int]] = {}  # disk -> CPU in flight, with registration epoch
        self.failed: dict[str, str] = {}  # adapters whose load failed, with the reason
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # virtual slot (first page); LRU first
        self.slot_since: dict[str, int] = {}  # when each resident adapter got its pages (tick)
        self.owner: list[str | None] = [None] * self.num_pages  # adapter holding each page
        self.slot_ranks = [0] * self.num_pages  # rank of the adapter at each virtual slot (runner, kernels)
        self.refcount: dict[str, int] = {}
        self.draining: set[str] = set()  # owners of the reserved run
        self.reserved: tuple[str, int, int] | None = None  # (waiting adapter, first page, end page)
        self._run_cache: dict[tuple[int, bool], int | None] = {}  # _find_run's answers until state changes
        self._epoch: dict[str, int] = {}
        self._epochs = itertools.count()
        self._ticks = itertools.count()
        default_threads = torch.get_num_threads()  # this thread's count (set before the loader starts)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-adapter-load",
                                          initializer=_one_torch_thread)
        self._loader.submit(int).result()  # start it now ...
        torch.set_num_threads(default_threads)  # ... and restore the default for threads started later
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stats = {tier: {"hits": 0, "misses": 0, "evictions": 0, "load_s": deque(maxlen=1024)}
                      for tier in ("gpu", "cpu")}

    # registry (disk tier) -------------------------------------------------------------------------
    def register(self, name: str, path: str | Path) -> None:
        """Validate a PEFT adapter directory and register it under `name`; its tensors load on first use.

        Raises AdapterError (bad adapter, nothing registered) or ValueError if `name` is taken.
        """
        if name in self.registry:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first")
        adapter = load_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank)  # every check
        self.registry[name] = Path(path)
        self.plans[name] = adapter.plan  # its tensors are dropped; loads read the file again by this plan
        self._epoch[name] = next(self._epochs)
        self.failed.pop(name, None)

    def unregister(self, name: str) -> None:
        """Forget `name` in every tier. KeyError if unknown, AdapterInUseError while pinned."""
        if name not in self.registry:
            raise KeyError(f"adapter {name!r} is not loaded")
        if self.refcount.get(name, 0):
            raise AdapterInUseError(f"adapter {name!r} is used by {self.refcount[name]} running request(s)")
        if name in self.slot_of:
            with self._on_copy_stream():
                self._evict(name)
        if self.reserved is not None and self.reserved[0] == name:
            self._reserve(None)  # nobody waits for the run any more: its owners stop draining
        self.cpu.pop(name, None)
        future = self.loading.pop(name, None)
        if future is not None:
            future[0].cancel()
        del self.registry[name], self._epoch[name], self.plans[name]
        self.failed.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self.registry

    # the scheduler's per-step hand-over ------------------------------------------------------------------
    def step(self, waiting: Sequence[str | None], num_examined: int | None) -> dict[str, str]:
        """Once per scheduler step, after admission (`Scheduler.schedule`): take in finished disk loads,
        keep, move or end the reservation, prefetch, and return the adapters whose load failed.

        waiting: the adapters of the waiting requests in queue order; admission looked at the first
        `num_examined` and left them there (None: admission did not run, the reservation stands). The
        oldest of those that cannot get pages and is not draining (`blocked`) is the one `make_room_for`
        reserves for; when admission stopped (full batch, no token budget, no KV blocks) before it reached
        the adapter the run is reserved for, the reservation stays, or its owners would take new requests at
        the next free place and the drain would start over (starving a large adapter).
        """
        self.poll()
        if num_examined is not None:
            head = waiting[:num_examined]
            blocked = next((a for a in head if a is not None and a not in self.failed and a not in self.draining
                            and not self.can_acquire(a)), None)
            reserved = self.reserved
            if blocked is None and reserved is not None and reserved[0] not in head and reserved[0] in waiting:
                blocked = reserved[0]
            self.make_room_for(blocked)
        wanted: set[str] = set()
        for name in itertools.islice(waiting, PREFETCH_LOOKAHEAD):
            if name is not None and name not in wanted:
                self.prefetch(name, keep=wanted)
                wanted.add(name)
        return self.failed

    def forget_failure(self, name: str) -> None:
        """Let the next prefetch of `name` try its load again."""
        self.failed.pop(name, None)

    def wait_for_loads(self, timeout: float) -> None:
        """Sleep until a disk load in flight ends, at most `timeout` seconds; at once if none is."""
        if self.loading:
            wait([f for f, _ in self.loading.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    # disk -> CPU ------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Move finished background loads into the CPU tier (engine thread, start of each step)."""
        for name, (future, epoch) in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[name]
            if self._epoch.get(name) != epoch or future.cancelled():
                continue  # unregistered (and maybe registered again) while loading
            try:
                adapter, seconds = future.result()
            except Exception as exc:  # files changed or vanished since registration
                logger.error("loading adapter %r failed: %s", name, exc)
                self.failed[name] = str(exc)
                if self.reserved is not None and self.reserved[0] == name:
                    self._reserve(None)
                continue
            self.stats["cpu"]["load_s"].append(seconds)
            self.cpu[name] = adapter

    def prefetch(self, name: str, keep: set[str] = frozenset()) -> bool:
        """Start loading `name` from disk if it is not in host memory; True once it is there.

        Makes room by evicting the least recently used CPU entry that no request pins and that is
        not in `keep` (adapters that earlier waiting requests want); if none, does nothing.
        """
        if name in self.cpu:
            return True
        if name in self.loading or name in self.failed:
            return False
        if self.max_cpu_loras is not None and len(self.cpu) + len(self.loading) >= self.max_cpu_loras:
            victim = next((n for n in self.cpu if not self.refcount.get(n) and n not in keep), None)
            if victim is None:
                return False
            del self.cpu[victim]
            self.stats["cpu"]["evictions"] += 1
        self.stats["cpu"]["misses"] += 1
        self.loading[name] = (self._loader.submit(self._read, name, self.registry[name], self.plans[name]),
                              self._epoch[name])
        return False

    def _read(self, name: str, path: Path, plan: ReadPlan | None = None) -> tuple[LoRAAdapter, float]:
        """Load `name` from disk (on the load thread): by its read plan while the file is the one
        registered, else through every check again. Returns (adapter, seconds)."""
        start = time.perf_counter()
        adapter = None if plan is None else read_planned(plan, name, self.dtype)
        if adapter is None:
            adapter = load_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank, name=name,
                                        dtype=self.dtype)
        if self.device.type == "cuda":
            for m in adapter.stacked.values():  # (adapter.modules keep views of the unpinned copies)
                m.A, m.B = m.A.pin_memory(), m.B.pin_memory()
        return adapter, time.perf_counter() - start

    # slots: pages of rank rows ----------------------------------------------------------------------
    def _pages_for(self, rank: int) -> int:
        """Pages of the run an adapter of `rank` takes: ceil(rank / page) rounded up to a power of two,
        at most a physical slot's P pages."""
        n = max(1, -(-rank // self.page))
        return min(1 << (n - 1).bit_length(), self.pages_per_slot)

    def _runs(self, n: int) -> list[int]:
        """First pages of every run of `n` pages: aligned to n inside each physical slot."""
        p = self.pages_per_slot
        return [s + k for s in range(0, self.num_pages, p) for k in range(0, p - n + 1, n)]

    def _owners(self, start: int, n: int) -> list[str]:
        """Adapters owning pages start .. start + n - 1, each once, in page order."""
        return [o for o in dict.fromkeys(self.owner[start:start + n]) if o is not None]

    def _find_run(self, name: str) -> int | None:
        """First page of the run `name` (in host memory) would take now, or None if there is none.

        A free run first, the one whose largest free aligned block around it is smallest (a buddy
        allocator's best fit, which keeps large blocks whole for large ranks); otherwise a run whose
        owners are all unpinned, to evict: draining owners first, then the run whose most recently used
        owner is least recent, then the fewest owners. Pages reserved for another adapter are never taken.
        """
        n = self._pages_for(self.cpu[name].rank)
        holder = self.reserved is not None and self.reserved[0] == name
        if (n, holder) not in self._run_cache:
            self._run_cache[n, holder] = self._choose_run(n, holder)
        return self._run_cache[n, holder]

    def _choose_run(self, n: int, holder: bool) -> int | None:
        kept = set() if holder or self.reserved is None else set(range(*self.reserved[1:]))
        usable = [s for s in self._runs(n) if kept.isdisjoint(range(s, s + n))]
        free = [s for s in usable if not self._owners(s, n)]
        if free:
            return min(free, key=lambda s: (self._free_block(s, n, kept), s))
        lru = {a: i for i, a in enumerate(self.slot_of)}
        candidates = []
        for s in usable:
            owners = self._owners(s, n)
            if not any(self.refcount.get(o) for o in owners):
                recent = max(lru[o] for o in owners)
                candidates.append((not self.draining.issuperset(owners), recent, len(owners), s))
        return min(candidates)[-1] if candidates else None

    def _free_block(self, start: int, n: int, kept: set[int]) -> int:
        """Pages of the largest free aligned block (n, 2n, 4n, ... pages) inside one physical slot that
        holds the free run start .. start + n - 1."""
        base, p = start - start % self.pages_per_slot, self.pages_per_slot
        while 2 * n <= p:
            block = base + (start - base) // (2 * n) * (2 * n)
            pages = range(block, block + 2 * n)
            if pages.stop > base + p or self._owners(block, 2 * n) or not kept.isdisjoint(pages):
                break
            n *= 2
        return n

    def _reserve(self, name: str | None = None, start: int = 0, n: int = 0) -> None:
        """Keep pages start .. start + n - 1 for `name` and drain their owners; no arguments: end it."""
        self.reserved = None if name is None else (name, start, start + n)
        self.draining = set(self._owners(start, n))
        self._run_cache.clear()

    def can_acquire(self, name: str) -> bool:
        """True if a request for `name` can be admitted now; otherwise starts what makes it possible.

        Resident and not draining: yes. In host memory with a free or evictable run of pages (see
        `_find_run`): yes. Not in host memory: no, the request is skipped for this step (the scheduler's
        `prefetch` pass loads it).
        """
        if name in self.slot_of:
            return name not in self.draining
        if name not in self.cpu:
            return False  # the scheduler's prefetch pass loads it, oldest waiting request first
        return self._find_run(name) is not None

    def make_room_for(self, name: str | None) -> None:
        """`name` is the adapter of the oldest request that waits for pages (None: no such request).

        If pinned adapters hold pages of every run `name` could take, reserve for it the run whose owners
        got their pages earliest (`slot_since`) and drain those owners; the reservation moves when another
        adapter becomes the oldest waiting one and ends when `name` acquires or nobody waits. Nothing is
        drained while `name` is still on its way into host memory.
        """
        if name is None or (self.reserved is not None and self.reserved[0] != name):
            self._reserve(None)
        if name is None or self.reserved is not None or name in self.slot_of or name not in self.cpu:
            return
        if self._find_run(name) is not None:
            return
        n = self._pages_for(self.cpu[name].rank)

        def age(s: int):
            owners = self._owners(s, n)
            return max((self.slot_since[o] for o in owners), default=-1), len(owners), s

        self._reserve(name, min(self._runs(n), key=age), n)

    def acquire(self, name: str) -> int | None:
        """Pin `name` and return its virtual slot, copying it in from host memory if needed; None if it
        cannot be admitted now (see `can_acquire`)."""
        if name in self.slot_of:
            if name in self.draining:
                return None
            self.stats["gpu"]["hits"] += 1
            self.slot_of.move_to_end(name)
        else:
            if not self.can_acquire(name):
                return None
            self.stats["gpu"]["misses"] += 1
            self.stats["cpu"]["hits"] += 1
            self.cpu.move_to_end(name)
            try:
                self._place(name)
            except Exception as exc:  # the scheduler ends this request; the other requests for it end too
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                raise
            if self.reserved is not None and self.reserved[0] == name:
                self._reserve(None)
        self.refcount[name] = self.refcount.get(name, 0) + 1
        self._run_cache.clear()
        return self.slot_of[name]

    def release(self, name: str) -> None:
        """Unpin one use of `name`; it stays resident until evicted."""
        self.refcount[name] -= 1
        if not self.refcount[name]:
            del self.refcount[name]
            self._run_cache.clear()

    def _place(self, name: str) -> int:
        """Give `name` (in host memory, not resident) the run `_find_run` picks, evicting the run's
        owners, and copy it in; returns its virtual slot.

        Raises RuntimeError when no run is free or evictable, KeyError when `name` is not in host memory.
        """
        start = self._find_run(name)
        if start is None:
            raise RuntimeError(f"no free or evictable pages for adapter {name!r}")
        with self._on_copy_stream():
            for owner in self._owners(start, self._pages_for(self.cpu[name].rank)):
                # the owner at `start` is overwritten by the copy, which zeroes what it leaves of its rows
                self._evict(owner, zero=self.slot_of[owner] != start)
            self._copy_in(name, start)
        return start

    @contextmanager
    def _on_copy_stream(self):
        """Slot writes inside run on the side copy stream on CUDA, after the work queued so far on the
        current stream and before the work queued there next."""
        if self._copy_stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(main)
        try:
            with torch.cuda.stream(self._copy_stream):
                yield
        finally:
            main.wait_stream(self._copy_stream)

    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write `adapter` at virtual slot `slot` of every layer's buffers (None: zero its rows); a few
        copies per projection, all layers at once (`LoRAStack.set_slot`)."""
        for module, stack in self.stacks.items():
            m = None if adapter is None else adapter.stacked.get(module)
            if m is None:
                stack.set_slot(slot, None, None)
            else:
                stack.set_slot(slot, m.A, m.B, m.ranks, m.scalings)

    def _copy_in(self, name: str, slot: int) -> None:
        start = time.perf_counter()
        adapter = self.cpu[name]
        try:
            self._write(slot, adapter)
        except Exception:
            self._write(slot, None)
            raise
        n = self._pages_for(adapter.rank)
        self.owner[slot:slot + n] = [name] * n
        self.slot_of[name] = slot
        self.slot_since[name] = next(self._ticks)
        self.slot_ranks[slot] = adapter.rank
        self._run_cache.clear()
        self.stats["gpu"]["load_s"].append(time.perf_counter() - start)

    def _evict(self, name: str, zero: bool = True) -> None:
        """Free `name`'s pages and zero its rows in every buffer: rows no adapter owns stay zero. With
        zero False the rows stay for the write that replaces it at the same virtual slot (`_place`)."""
        assert not self.refcount.get(name), f"evicting pinned adapter {name!r}"
        slot = self.slot_of.pop(name)
        if zero:
            self._write(slot, None)
        n = self._pages_for(self.slot_ranks[slot])
        self.owner[slot:slot + n] = [None] * n
        self.slot_ranks[slot] = 0
        del self.slot_since[name]
        self.draining.discard(name)
        self._run_cache.clear()
        self.stats["gpu"]["evictions"] += 1

    # stats --------------------------------------------------------------------------------------------
    def adapter_stats(self) -> dict:
        """Capacity, occupancy, hits, misses, evictions and load latency (seconds, p50/p99) per tier,
        and each registered adapter's tier ("gpu", "cpu", "loading", "failed" or "disk").

        Units: "cpu" and "disk" count adapters; "gpu" counts rank rows (capacity max_loras x
        max_lora_rank, used: rows of owned pages) and adds "adapters" (resident adapters) and
        "page_rows" (rank rows per page)."""
        tiers = {}
        rows = self.page * sum(o is not None for o in self.owner)
        for tier, capacity, used in (("gpu", self.num_slots * self.max_lora_rank, rows),
                                     ("cpu", self.max_cpu_loras, len(self.cpu))):
            s = self.stats[tier]
            tiers[tier] = {"capacity": capacity, "used": used, "hits": s["hits"], "misses": s["misses"],
                           "evictions": s["evictions"], "load_s_p50": _percentile(s["load_s"], 0.5),
                           "load_s_p99": _percentile(s["load_s"], 0.99)}
        tiers["gpu"].update(adapters=len(self.slot_of), page_rows=self.page)
        tiers["disk"] = {"capacity": None, "used": len(self.registry)}

        def tier_of(name: str) -> str:
            if name in self.slot_of:
                return "gpu"
            if name in self.cpu:
                return "cpu"
            return "loading" if name in self.loading else "failed" if name in self.failed else "disk"

        return {"tiers": tiers, "pinned": dict(self.refcount), "draining": sorted(self.draining),
                "adapters": {n: tier_of(n) for n in self.registry}}

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


__all__ = ["AdapterError", "AdapterInUseError", "AdapterManager"]
