"""Adapter paging between three tiers: disk, host memory (CPU) and the engine's adapter slots.

Letters: S adapter slots (`max_loras`), R max rank (`max_lora_rank`), L layers.

- disk: every registered adapter (validated once at registration, tensors dropped);
- CPU: an LRU cache of loaded adapters, at most `max_cpu_loras` (pinned host memory on CUDA);
- slots: the stacked per-layer buffers the LoRA op reads (`LoRAWeights`, A [S, R, H_in],
  B [S, H_out, R]); on the CPU path these are the "GPU" tier.

Disk -> CPU loads run on a background thread; the scheduler never waits for one (`can_acquire` says
no and starts the load, S-LoRA / vLLM style). CPU -> slot copies are a plain copy on CPU and run on a
side CUDA stream on GPU. A request pins its adapter's slot (reference count) from admission to finish
or preemption; pinned adapters are never evicted from any tier.

No starvation (after LoRAX's adapter exchange): when the oldest waiting request's adapter cannot get a
slot because every slot is pinned, the adapter that has held its slot longest is put to *draining*: it
admits no new requests, and once its running requests finish its slot goes to the waiting adapter.
Same verbs as the KV block manager, saying no with None / False: `can_acquire`, `acquire`, `release`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

from loraplex.adapters.peft import AdapterError, LoRAAdapter, load_peft_adapter, validate_peft_adapter
from loraplex.engine.config import LORA_TARGET_MODULES, EngineConfig, ModelConfig
from loraplex.kernels import LoRAWeights

logger = logging.getLogger(__name__)


class AdapterInUseError(RuntimeError):
    """An adapter that running or waiting requests use cannot be unloaded."""


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class AdapterManager:
    """Registered adapters and their residency in the CPU cache and the S slots."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: torch.dtype,
                 device: torch.device | str):
        self.model_cfg = model_cfg
        self.max_lora_rank = engine_cfg.max_lora_rank
        self.num_slots = engine_cfg.max_loras
        self.max_cpu_loras = engine_cfg.max_cpu_loras
        self.dtype = dtype
        self.device = torch.device(device)
        # buffers[layer][module]: allocated for every targetable projection of every layer.
        self.buffers: list[dict[str, LoRAWeights]] = [
            {m: LoRAWeights.empty(self.num_slots, self.max_lora_rank, *model_cfg.lora_module_shape(m), dtype, device)
             for m in LORA_TARGET_MODULES}
            for _ in range(model_cfg.num_hidden_layers)
        ]
        self.registry: dict[str, Path] = {}  # disk tier
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.loading: dict[str, tuple[Future, int]] = {}  # disk -> CPU in flight, with registration epoch
        self.failed: dict[str, str] = {}  # adapters whose load failed, with the reason
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.slot_since: dict[str, int] = {}  # when each resident adapter got its slot (tick)
        self.refcount: dict[str, int] = {}
        self.draining: set[str] = set()
        self.free_slots = list(range(self.num_slots))
        self.slot_ranks = [0] * self.num_slots
        self._epoch: dict[str, int] = {}
        self._epochs = itertools.count()
        self._ticks = itertools.count()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-adapter-load")
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
        validate_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank)
        self.registry[name] = Path(path)
        self._epoch[name] = next(self._epochs)
        self.failed.pop(name, None)

    def unregister(self, name: str) -> None:
        """Forget `name` in every tier. KeyError if unknown, AdapterInUseError while pinned."""
        if name not in self.registry:
            raise KeyError(f"adapter {name!r} is not loaded")
        if self.refcount.get(name, 0):
            raise AdapterInUseError(f"adapter {name!r} is used by {self.refcount[name]} running request(s)")
        if name in self.slot_of:
            self._evict_slot(name)
        self.cpu.pop(name, None)
        future = self.loading.pop(name, None)
        if future is not None:
            future[0].cancel()
        del self.registry[name], self._epoch[name]
        self.failed.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self.registry

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
        self.loading[name] = (self._loader.submit(self._read, name, self.registry[name]), self._epoch[name])
        return False

    def _read(self, name: str, path: Path) -> tuple[LoRAAdapter, float]:
        start = time.perf_counter()
        adapter = load_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank, name=name,
                                    dtype=self.dtype)
        if self.device.type == "cuda":
            for m in adapter.modules.values():
                m.A, m.B = m.A.pin_memory(), m.B.pin_memory()
        return adapter, time.perf_counter() - start

    # slots --------------------------------------------------------------------------------------------
    def _evictable(self) -> str | None:
        """The slot holder to evict next: a draining adapter first, else the LRU one; only unpinned."""
        unpinned = [n for n in self.slot_of if not self.refcount.get(n)]
        return next((n for n in unpinned if n in self.draining), unpinned[0] if unpinned else None)

    def can_acquire(self, name: str) -> bool:
        """True if a request for `name` can be admitted now; otherwise starts what makes it possible.

        Resident and not draining: yes. In host memory with a free or evictable slot: yes. Not in host
        memory: no, the request is skipped for this step (the scheduler's `prefetch` pass loads it).
        """
        if name in self.slot_of:
            return name not in self.draining
        if name not in self.cpu:
            return False  # the scheduler's prefetch pass loads it, oldest waiting request first
        return bool(self.free_slots) or self._evictable() is not None

    def make_room_for(self, name: str | None) -> None:
        """`name` is the adapter of the oldest request that waits for a slot (None: no such request).

        If every slot is pinned, drain the adapter resident longest; with nobody waiting, stop draining.
        """
        if name is None:
            self.draining.clear()
            return
        if name in self.slot_of or self.free_slots or self._evictable() is not None or self.draining:
            return
        if name not in self.cpu:
            return  # drain only once the waiting adapter could use the slot
        victim = min(self.slot_of, key=self.slot_since.__getitem__)
        self.draining.add(victim)

    def acquire(self, name: str) -> int | None:
        """Pin `name` in a slot, copying it in from host memory if needed; None if it cannot be now."""
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
            if not self.free_slots:
                self._evict_slot(self._evictable())
            slot = self.free_slots.pop(0)
            try:
                self._copy_in(name, slot)
            except Exception:
                self.free_slots.append(slot)
                raise
        self.refcount[name] = self.refcount.get(name, 0) + 1
        return self.slot_of[name]

    def release(self, name: str) -> None:
        """Unpin one use of `name`; it stays resident until evicted."""
        self.refcount[name] -= 1
        if not self.refcount[name]:
            del self.refcount[name]

    def _copy_in(self, name: str, slot: int) -> None:
        start = time.perf_counter()
        adapter = self.cpu[name]
        stream = torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else nullcontext()
        with stream:
            for layer, modules in enumerate(self.buffers):
                for module, weights in modules.items():
                    m = adapter.modules.get((layer, module))
                    weights.set_slot(slot, None if m is None else m.A, None if m is None else m.B,
                                     0.0 if m is None else m.scaling)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self.slot_of[name] = slot
        self.slot_since[name] = next(self._ticks)
        self.slot_ranks[slot] = adapter.rank
        self.stats["gpu"]["load_s"].append(time.perf_counter() - start)

    def _evict_slot(self, name: str) -> None:
        assert not self.refcount.get(name), f"evicting pinned adapter {name!r}"
        slot = self.slot_of.pop(name)
        del self.slot_since[name]
        self.draining.discard(name)
        self.slot_ranks[slot] = 0
        self.free_slots.append(slot)
        self.stats["gpu"]["evictions"] += 1

    # stats --------------------------------------------------------------------------------------------
    def adapter_stats(self) -> dict:
        """Capacity, occupancy, hits, misses, evictions and load latency (seconds, p50/p99) per tier,
        and each registered adapter's tier ("gpu", "cpu", "loading", "failed" or "disk")."""
        tiers = {}
        for tier, capacity, used in (("gpu", self.num_slots, len(self.slot_of)),
                                     ("cpu", self.max_cpu_loras, len(self.cpu))):
            s = self.stats[tier]
            tiers[tier] = {"capacity": capacity, "used": used, "hits": s["hits"], "misses": s["misses"],
                           "evictions": s["evictions"], "load_s_p50": _percentile(s["load_s"], 0.5),
                           "load_s_p99": _percentile(s["load_s"], 0.99)}
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
