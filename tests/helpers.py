"""Small helpers shared by tests."""

from __future__ import annotations

from loraplex.adapters.synthetic import write_random_adapter

__all__ = ["chat_ids", "write_random_adapter"]


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user message through the chat template, with the assistant prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
