"""What a loaded adapter is: its weights per projection over all layers (`LoRAAdapter`), and how to read
the same file again without parsing it (`ReadPlan`). Letters: L layers, r rank, H_in / H_out a
projection's in / out features.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

# The files of a PEFT `save_pretrained` directory (the pickle one is refused: it can run code).
CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"


@dataclass
class LoRAModule:
    """One projection's LoRA weights: delta_y = scaling * (x @ A.T) @ B.T. A: [r, H_in]; B: [H_out, r]."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class StackedModule:
    """One projection's LoRA weights over all L layers, padded to the adapter's largest rank r for it:
    A [L, r, H_in], B [L, H_out, r] (rows / columns past a layer's own rank, and layers the adapter
    does not target, are zeros); `ranks` and `scalings` per layer (0 where not targeted). The engine
    copies an adapter into its slot buffers with a few copies per projection instead of a few per layer."""

    A: torch.Tensor
    B: torch.Tensor
    ranks: list[int]
    scalings: list[float]


@dataclass
class LoRAAdapter:
    """A loaded adapter. `config` is the raw adapter_config.json, `rank` the max r over its modules,
    `num_bytes` the size of the tensors file in bytes, `stacked` its weights per projection name (in
    LORA_TARGET_MODULES) over all layers; `modules` the same per (layer index, projection name);
    `plan` how to read the same file again without parsing it (`read_planned`), or None."""

    name: str
    path: str
    config: dict
    rank: int
    num_bytes: int
    stacked: dict[str, StackedModule]
    plan: ReadPlan | None = field(default=None, repr=False)

    @functools.cached_property
    def modules(self) -> dict[tuple[int, str], LoRAModule]:
        """{(layer, projection): LoRAModule} for every projection the adapter targets, views into `stacked`."""
        return {(layer, module): LoRAModule(s.A[layer, :r], s.B[layer, :, :r], s.scalings[layer])
                for module, s in self.stacked.items() for layer, r in enumerate(s.ranks) if r}


@dataclass(frozen=True)
class ReadPlan:
    """How to read a validated adapter's tensors again without parsing its header and config: the
    file's identity when it was validated (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns; the
    last is set by the kernel on every write, so copying a timestamp back does not hide an edit),
    where its data section starts (bytes), its one safetensors dtype, every tensor's element count in
    file order, and per projection the file-order position of each layer's A and B; and the identity
    of adapter_config.json it was read with (`config_path` None: a config given as a dict, not
    checked again). Only for files of one dtype whose targeted projections each have one rank on
    every layer (no layers_to_transform, no rank_pattern that differs between layers); other adapters
    load through `load_peft_files` each time.
    """

    tensors_path: str
    identity: tuple[int, ...]
    base: int
    dtype: str
    sizes: tuple[int, ...]
    positions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    template: LoRAAdapter  # name, path, config, rank, num_bytes and per-projection ranks and scalings
    config_path: str | None = None
    config_identity: tuple[int, ...] | None = None
