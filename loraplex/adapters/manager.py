"""Adapter paging between three tiers: disk, host memory (CPU) and the engine's adapter slots.

Letters: S adapter slots (`max_loras`), R max rank (`max_lora_rank`), V virtual slots (pages).

- disk: every registered adapter (validated at registration, tensors dropped; a read plan is kept so
  later loads of the unchanged files skip parsing, `read_planned`);
- host memory: an LRU cache of loaded adapters, at most `max_cpu_loras`, filled by a background thread
  (`host_cache.HostCache`; pinned host memory on CUDA);
- slots: the per-layer buffers the LoRA op reads (`slot_buffers.SlotBuffers`), paged by rank
  (`slot_pages.SlotPages`: S-LoRA's unified paging, buddy allocation, the anti-starvation reservation).

A request pins its adapter (reference count) from admission to finish or preemption; pinned adapters are
never evicted from any tier. The scheduler sees four methods (`Scheduler.AdapterSlots`): `can_acquire`,
`acquire`, `release` (the KV block manager's verbs, saying no with None / False) and `step`, which hands
over the waiting queue once per step. Evicted adapters' rows are zeroed (or, at the new adapter's own
virtual slot, overwritten and zeroed past its rank), so rows no adapter owns stay zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.peft import (
    CONFIG_NAME,
    SAFETENSORS_NAME,
    AdapterError,
    LoRAAdapter,
    ReadPlan,
    load_peft_adapter,
    read_planned,
)
from loraplex.adapters.slot_buffers import SlotBuffers
from loraplex.adapters.slot_pages import SlotPages
from loraplex.adapters.stats import TierStats
from loraplex.adapters.store import content_digest
from loraplex.model_config import LORA_PAGE_ROWS, ModelConfig

PREFETCH_LOOKAHEAD = 32  # waiting requests whose adapters are prefetched


class AdapterInUseError(RuntimeError):
    """An adapter that running or waiting requests use cannot be unloaded."""


@dataclass(frozen=True)
class Registered:
    """A registered adapter: its directory, how to read it without parsing (None: parse again), its
    registration epoch (a load started for an earlier registration of the name is dropped) and its files'
    content digest (`store.content_digest`: the identity prefix caching keys its K/V by)."""

    path: Path
    read_plan: ReadPlan | None
    epoch: int
    digest: str


class AdapterManager:
    """Registered adapters and their residency in host memory and the slot tier.

    max_lora_rank, max_loras and max_cpu_loras are `EngineConfig`'s; dtype and device the model's.
    """

    def __init__(self, model_cfg: ModelConfig, *, max_lora_rank: int, max_loras: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device | str):
        self.model_cfg = model_cfg
        self.max_lora_rank = max_lora_rank
        self.num_slots = max_loras
        self.dtype = dtype
        self.device = torch.device(device)
        page = LORA_PAGE_ROWS if max_lora_rank % LORA_PAGE_ROWS == 0 else max_lora_rank
        self.pages = SlotPages(max_loras, max_lora_rank, page)
        self.slots = SlotBuffers(model_cfg, max_loras, max_lora_rank, page, dtype, self.device)
        self.host = HostCache(max_cpu_loras, self._read_registered)
        self.registry: dict[str, Registered] = {}  # disk tier
        self.slot_stats = TierStats()
        self._epochs = itertools.count()

    @property
    def buffers(self):
        """Layer l's slot buffers by projection (`LoRAWeights`): what the model's LoRA ops read."""
        return self.slots.layers

    @property
    def slot_ranks(self) -> list[int]:
        """Rank of the adapter at each virtual slot (0 elsewhere), length V: the runner's LoRA metadata."""
        return self.pages.slot_ranks

    # registry (disk tier) -------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, *, validated: bool = False, digest: str | None = None) -> None:
        """Register the PEFT adapter directory `path` under `name`; its tensors load on first use.

        The directory is validated here (every check of `load_peft_adapter`, tensors dropped) unless
        `validated`: files checked already and unchanged since (the gateway's content-addressed store,
        checked at upload), which then get their checks once, on the load thread, at their first load,
        and are read by the plan that load records afterwards. digest: the files' `content_digest` (the
        store's, which the gateway passes), the identity prefix caching keys this adapter's K/V by; None
        computes it from the files when they are validated here, and otherwise (nothing is read) names this
        registration alone, so its K/V are shared with no other registration. Raises AdapterError (bad
        adapter, nothing registered) or ValueError if `name` is taken.
        """
        if name in self.registry:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first")
        read_plan = None
        epoch = next(self._epochs)
        if not validated:
            read_plan = load_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank).plan
            if digest is None:
                digest = content_digest(Path(path, CONFIG_NAME).read_bytes(), Path(path, SAFETENSORS_NAME))
        self.registry[name] = Registered(Path(path), read_plan, epoch, digest or f"registration-{epoch}")
        self.host.forget_failure(name)

    def unregister(self, name: str) -> None:
        """Forget `name` in every tier. KeyError if unknown, AdapterInUseError while pinned."""
        if name not in self.registry:
            raise KeyError(f"adapter {name!r} is not loaded")
        if self.pages.is_pinned(name):
            raise AdapterInUseError(f"adapter {name!r} is used by {self.pages.refcount[name]} running request(s)")
        if name in self.pages:
            with self.slots.copying():
                self.slots.write(self.pages.evict(name), None)
            self.slot_stats.evictions += 1
        if self.pages.reserved is not None and self.pages.reserved[0] == name:
            self.pages.reserve(None)  # nobody waits for the run any more: its owners stop draining
        self.host.drop(name)
        del self.registry[name]

    def __contains__(self, name: str) -> bool:
        return name in self.registry

    def identity(self, name: str) -> str:
        """What the K/V computed under adapter `name` depend on: its content digest. KeyError if unknown."""
        return self.registry[name].digest

    # the scheduler's verbs ------------------------------------------------------------------------------
    def can_acquire(self, name: str) -> bool:
        """True if a request for `name` can be admitted now.

        Failed to load or place: no. Resident and not draining: yes. In host memory with a free or evictable
        run of pages (`SlotPages.find_run`): yes. Not in host memory: no, the request is skipped for this step (`step`
        prefetches it, oldest waiting request first).
        """
        if name in self.host.failed:
            return False  # its load or placement failed: `step` ends its requests
        if name in self.pages:
            return name not in self.pages.draining
        if name not in self.host:
            return False
        return self.pages.find_run(name, self.host[name].rank) is not None

    def acquire(self, name: str) -> int | None:
        """Pin `name` and return its virtual slot, copying it in from host memory if needed; None if it
        cannot be admitted now (`can_acquire`). Raises what placing it raised (`SlotBuffers.write`), after
        marking it failed: the scheduler ends the request, and `step` the others for it."""
        if name in self.pages:
            if name in self.pages.draining:
                return None
            self.slot_stats.hits += 1
        else:
            if not self.can_acquire(name):
                return None
            self.slot_stats.misses += 1
            self.host.touch(name)
            try:
                self._place(name)
            except Exception as exc:
                self.host.failed[name] = f"{type(exc).__name__}: {exc}"
                raise
        return self.pages.pin(name)

    def release(self, name: str) -> None:
        """Unpin one use of `name`; it stays resident until evicted."""
        self.pages.unpin(name)

    def step(self, waiting: Sequence[str | None], num_examined: int | None) -> dict[str, str]:
        """Once per scheduler step, after admission (`Scheduler.schedule`): keep, move or end the
        reservation, prefetch, and return the adapters whose load or placement failed (finished loads are
        taken in before scheduling, `poll`).

        waiting: the adapters of the waiting requests in queue order; admission looked at the first
        `num_examined` and left them there (None: admission did not run, the reservation stands). The
        oldest of those that cannot get pages and is not draining is the one `SlotPages.make_room_for`
        reserves for; when admission stopped (full batch, no token budget, no KV blocks) before it reached
        the adapter the run is reserved for, the reservation stays, or its owners would take new requests at
        the next free place and the drain would start over (starving a large adapter).
        """
        pages = self.pages
        if num_examined is not None:
            head = waiting[:num_examined]
            blocked = next((a for a in head if a is not None and a not in self.host.failed
                            and a not in pages.draining and not self.can_acquire(a)), None)
            reserved = pages.reserved
            if blocked is None and reserved is not None and reserved[0] not in head and reserved[0] in waiting:
                blocked = reserved[0]
            pages.make_room_for(blocked, self.host[blocked].rank if blocked in self.host else None)
        wanted: set[str] = set()
        for name in itertools.islice(waiting, PREFETCH_LOOKAHEAD):
            if name is not None and name not in wanted:
                self.prefetch(name, keep=wanted)
                wanted.add(name)
        return self.host.failed

    def prefetch(self, name: str, keep: set[str] = frozenset()) -> bool:
        """Start loading `name` from disk if it is not in host memory; True once it is there (making room
        as `HostCache.prefetch` does, never evicting a pinned adapter or one in `keep`)."""
        return self.host.prefetch(name, self.registry[name].epoch, lambda n: not self.pages.is_pinned(n), keep)

    def poll(self) -> None:
        """Take in the disk loads that finished (engine thread): the engine calls it before each schedule,
        so admission sees an adapter the step its load lands, and `step` reports the loads that failed."""
        loaded, failed = self.host.poll(lambda n: self.registry[n].epoch if n in self.registry else None)
        for name in loaded:  # a first load through every check: later loads read by its plan
            reg = self.registry[name]
            if reg.read_plan is None and self.host[name].plan is not None:
                self.registry[name] = dataclasses.replace(reg, read_plan=self.host[name].plan)
        for name in failed:
            if self.pages.reserved is not None and self.pages.reserved[0] == name:
                self.pages.reserve(None)

    def forget_failure(self, name: str) -> None:
        """Let the next prefetch of `name` try its load again."""
        self.host.forget_failure(name)

    def wait_for_loads(self, timeout: float) -> None:
        """Sleep until a disk load in flight ends, at most `timeout` seconds; at once if none is."""
        self.host.wait(timeout)

    # loads and copies -----------------------------------------------------------------------------------
    def _read_registered(self, name: str) -> tuple[LoRAAdapter, float]:
        reg = self.registry[name]
        return self.read(name, reg.path, reg.read_plan)

    def read(self, name: str, path: Path, read_plan: ReadPlan | None = None) -> tuple[LoRAAdapter, float]:
        """Load `name` from disk (on the load thread): by its read plan while the file is the one
        registered, else through every check again. Returns (adapter, seconds)."""
        start = time.perf_counter()
        adapter = None if read_plan is None else read_planned(read_plan, name, self.dtype)
        if adapter is None:
            adapter = load_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank, name=name,
                                        dtype=self.dtype)
        if self.device.type == "cuda":
            for m in adapter.stacked.values():  # (adapter.modules keep views of the unpinned copies)
                m.A, m.B = m.A.pin_memory(), m.B.pin_memory()
        return adapter, time.perf_counter() - start

    def _place(self, name: str) -> int:
        """Give `name` (in host memory, not resident) its run of pages and copy it in; returns its virtual
        slot. The adapters evicted for it have their rows zeroed, except at `name`'s own virtual slot, which
        the copy overwrites (zeroing what it leaves). RuntimeError when no run is free or evictable."""
        started = time.perf_counter()
        adapter = self.host[name]
        slot, evicted = self.pages.take(name, adapter.rank)
        self.slot_stats.evictions += len(evicted)
        try:
            with self.slots.copying():
                for _, old in evicted:
                    if old != slot:
                        self.slots.write(old, None)
                self.slots.write(slot, adapter)
        except BaseException:  # never left resident with rows half written: undo the pages first
            self.pages.evict(name)
            with contextlib.suppress(Exception):
                self.slots.write(slot, None)
            raise
        self.slot_stats.load_s.append(time.perf_counter() - started)
        return slot

    # stats --------------------------------------------------------------------------------------------
    def adapter_stats(self) -> dict:
        """Capacity, occupancy, hits, misses, evictions and load latency (seconds, p50/p99) per tier,
        and each registered adapter's tier ("slots", "cpu", "loading", "failed" or "disk").

        Units: "cpu" and "disk" count adapters; "slots" counts rank rows (capacity max_loras x
        max_lora_rank, used: rows of owned pages) and adds "adapters" (resident adapters) and
        "page_rows" (rank rows per page)."""
        pages, host = self.pages, self.host
        tiers = {"slots": self.slot_stats.summary(self.num_slots * self.max_lora_rank, pages.page * pages.num_used_pages),
                 "cpu": host.stats.summary(host.capacity, len(host))}
        tiers["slots"].update(adapters=len(pages.slot_of), page_rows=pages.page)
        tiers["disk"] = {"capacity": None, "used": len(self.registry)}
        return {"tiers": tiers, "pinned": dict(pages.refcount), "draining": sorted(pages.draining),
                "adapters": {n: self.tier(n) for n in self.registry}}

    def tier(self, name: str) -> str:
        """Where adapter `name` is now: "slots" (in an adapter slot, ready for a step), "cpu" (in host
        memory: a slot load is a copy), "loading" (being read by the background thread), "failed" (its
        last read failed) or "disk" (only in the store, or not registered: a cold load). Call on the
        engine thread."""
        if name in self.pages:
            return "slots"
        if name in self.host:
            return "cpu"
        host = self.host
        return "loading" if name in host.loading else "failed" if name in host.failed else "disk"

    def close(self) -> None:
        """Stop the load thread (benchmarks that build many engines in one process)."""
        self.host.close()


__all__ = ["AdapterError", "AdapterInUseError", "AdapterManager"]
