"""Small helpers shared by tests."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.synthetic import write_random_adapter
from loraplex.kernels import cpu_ext

__all__ = ["built_cpu_ext", "chat_ids", "peft_generate", "write_random_adapter"]


TRAINED_ADAPTER_STEPS = {"upper": 24, "json": 10}  # the `trained_adapters` fixture's; json is learnt in fewer steps

def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user message through the chat template, with the assistant prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def peft_generate(model, ids: list[int], adapter: str | None, max_new: int) -> list[int]:
    """PEFT's greedy output (up to `max_new` tokens, EOS stops) for one row alone, no padding."""
    names = ["__base__" if adapter is None else adapter]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, adapter_names=names, pad_token_id=2)
    return out[0, len(ids):].tolist()


def built_cpu_ext():
    """The compiled CPU kernels (`cpu_ext.load()`); fails the test where they did not build, since every
    machine the suite runs on (CI included) has a compiler, so a fallback there would hide a broken build."""
    ext = cpu_ext.load()
    if ext is None:
        pytest.fail("the CPU kernels must build here (CI has a compiler)")
    return ext
