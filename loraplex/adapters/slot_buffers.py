"""The slot tier's tensors: every layer's adapter-slot buffers, what the model's LoRA ops read, and the
copies that write an adapter into them or clear it.

Letters: L layers, S adapter slots (`max_loras`), R max rank (`max_lora_rank`).

Each targetable projection's buffers for all L layers are one `LoRAStack` (A [L, S, R, H_in],
B [L, S, H_out, R]), so an adapter is copied in with a few copies per projection. On CUDA the copies
run on a side stream, ordered after the work queued so far on the current stream and before the work
queued there next; on CPU they are plain copies.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from loraplex.adapters.peft import LoRAAdapter
from loraplex.kernels import LoRAStack, LoRAWeights
from loraplex.model_config import LORA_FUSED_GROUPS, ModelConfig


class SlotBuffers:
    """`stacks[module]` one projection's buffers of every layer; `layers[l][module]` layer l's views of
    them (`LoRAWeights`), handed to the model's layers once."""

    def __init__(self, model_cfg: ModelConfig, num_slots: int, max_rank: int, page: int, dtype: torch.dtype,
                 device: torch.device):
        self.stacks: dict[str, LoRAStack] = {}
        for group in LORA_FUSED_GROUPS:
            h_in = model_cfg.lora_module_shape(group[0])[0]
            outs = [model_cfg.lora_module_shape(m)[1] for m in group]
            self.stacks.update(zip(group, LoRAStack.empty_group(model_cfg.num_hidden_layers, num_slots, max_rank,
                                                                h_in, outs, dtype, device, page=page), strict=True))
        self.layers: list[dict[str, LoRAWeights]] = [
            {m: stack.layers[layer] for m, stack in self.stacks.items()}
            for layer in range(model_cfg.num_hidden_layers)
        ]
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._device = device

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write `adapter` at virtual slot `slot` of every layer's buffers (None: zero its rows); a few
        copies per projection, all layers at once (`LoRAStack.set_slot`). Raises ValueError when it does
        not fit (`LoRAStack.set_slot`)."""
        for module, stack in self.stacks.items():
            m = None if adapter is None else adapter.stacked.get(module)
            if m is None:
                stack.set_slot(slot, None, None)
            else:
                stack.set_slot(slot, m.A, m.B, m.ranks, m.scalings)

    @contextmanager
    def copying(self):
        """Slot writes inside run on the side copy stream on CUDA (see the module's docstring)."""
        if self._copy_stream is None:
            yield
            return
        main = torch.cuda.current_stream(self._device)
        self._copy_stream.wait_stream(main)
        try:
            with torch.cuda.stream(self._copy_stream):
                yield
        finally:
            main.wait_stream(self._copy_stream)
