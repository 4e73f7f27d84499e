"""Small helpers shared by tests."""

from __future__ import annotations

import torch

from loraplex.adapters.synthetic import write_random_adapter

__all__ = ["chat_ids", "peft_generate", "write_random_adapter"]


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
