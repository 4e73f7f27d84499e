"""Adapter registry and adapter slots: which adapters the engine knows and which sit in its LoRA buffers.

Letters: S adapter slots (`max_loras`), R max rank (`max_lora_rank`), L layers.

The engine's stacked per-layer buffers (`LoRAWeights`, A [S, R, H_in], B [S, H_out, R]) have S slots.
A request pins its adapter's slot from admission to finish or preemption (reference count); an
unpinned slot is evicted in LRU order when another adapter needs one. Same verbs as the KV block
manager, saying no with None / False: `can_acquire`, `acquire`, `release`.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from loraplex.adapters.peft import AdapterError, LoRAAdapter, load_peft_adapter
from loraplex.engine.config import LORA_TARGET_MODULES, EngineConfig, ModelConfig
from loraplex.kernels import LoRAWeights


class AdapterInUseError(RuntimeError):
    """An adapter that running or waiting requests use cannot be unloaded."""


class AdapterManager:
    """Registered adapters (host memory) and their assignment to the S slots of the LoRA buffers."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: torch.dtype,
                 device: torch.device | str):
        self.model_cfg = model_cfg
        self.max_lora_rank = engine_cfg.max_lora_rank
        self.num_slots = engine_cfg.max_loras
        self.dtype = dtype
        # buffers[layer][module]: allocated for every targetable projection of every layer.
        self.buffers: list[dict[str, LoRAWeights]] = [
            {m: LoRAWeights.empty(self.num_slots, self.max_lora_rank, *model_cfg.lora_module_shape(m), dtype, device)
             for m in LORA_TARGET_MODULES}
            for _ in range(model_cfg.num_hidden_layers)
        ]
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self.refcount: dict[str, int] = {}
        self.free_slots = list(range(self.num_slots))
        self.slot_ranks = [0] * self.num_slots
        self.num_hits = self.num_misses = self.num_evictions = 0

    # registry -----------------------------------------------------------------------------------
    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        """Validate and load a PEFT adapter into host memory under `name`.

        Raises AdapterError (bad adapter, nothing kept) or ValueError if `name` is taken.
        """
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first")
        adapter = load_peft_adapter(path, self.model_cfg, max_lora_rank=self.max_lora_rank, name=name,
                                    dtype=self.dtype)
        self.adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Forget `name` and free its slot. KeyError if unknown, AdapterInUseError while pinned."""
        if name not in self.adapters:
            raise KeyError(f"adapter {name!r} is not loaded")
        if self.refcount.get(name, 0):
            raise AdapterInUseError(f"adapter {name!r} is used by {self.refcount[name]} request(s)")
        if name in self.slot_of:
            self._evict(name)
        del self.adapters[name]

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    # slots --------------------------------------------------------------------------------------
    def can_acquire(self, name: str) -> bool:
        """True if `name` is resident, or a slot is free or held only by unpinned adapters."""
        if name in self.slot_of or self.free_slots:
            return True
        return any(not self.refcount.get(n, 0) for n in self.slot_of)

    def acquire(self, name: str) -> int | None:
        """Pin `name` in a slot (loading it, evicting the LRU unpinned adapter if needed); None if no slot."""
        if name in self.slot_of:
            self.num_hits += 1
            self.slot_of.move_to_end(name)
        else:
            if not self.can_acquire(name):
                return None
            self.num_misses += 1
            if not self.free_slots:
                victim = next(n for n in self.slot_of if not self.refcount.get(n, 0))
                self._evict(victim)
            self._load(name, self.free_slots.pop(0))
        self.refcount[name] = self.refcount.get(name, 0) + 1
        return self.slot_of[name]

    def release(self, name: str) -> None:
        """Unpin one use of `name`; the adapter stays resident until evicted."""
        self.refcount[name] -= 1
        if not self.refcount[name]:
            del self.refcount[name]

    def _load(self, name: str, slot: int) -> None:
        adapter = self.adapters[name]
        for layer, modules in enumerate(self.buffers):
            for module, weights in modules.items():
                m = adapter.modules.get((layer, module))
                if m is None:
                    weights.set_slot(slot, None, None, 0.0)
                else:
                    weights.set_slot(slot, m.A, m.B, m.scaling)
        self.slot_of[name] = slot
        self.slot_ranks[slot] = adapter.rank

    def _evict(self, name: str) -> None:
        slot = self.slot_of.pop(name)
        self.slot_ranks[slot] = 0
        self.free_slots.append(slot)
        self.num_evictions += 1


__all__ = ["AdapterError", "AdapterInUseError", "AdapterManager"]
