"""Adapters trained for real (examples/train_adapters.py) keep their behaviour in loraplex's engine.

Two adapters are trained in this session on the default model, one that answers in UPPER CASE and one
that answers with a JSON object. In ONE mixed batch with base rows, on questions that are in no training
set, each row must show its own adapter's behaviour (and base rows neither), with the tokens PEFT
generates for that adapter alone. The training takes about 45-60 s on a 2-core CPU with one torch thread.
It runs in fp32 on every machine: with bf16 autocast (the script's default where the CPU has native bf16)
the adapters differ between AVX2 and AVX-512 BF16 machines, and the bf16-trained `upper` wrote a lower-case
word in one held-out answer.
"""

from __future__ import annotations

import json

import pytest
import torch

from examples.train_adapters import HELD_OUT, make_dataset
from loraplex import LLM, SamplingParams
from tests.helpers import TRAINED_ADAPTER_STEPS, chat_ids, peft_generate

pytestmark = pytest.mark.slow

QUESTIONS = HELD_OUT[:2]
MAX_TOKENS = 40  # room for the JSON object to close


@pytest.fixture(scope="module")
def peft_reference(model_path, trained_adapters):
    """A fresh base model with the saved adapters loaded back by PEFT: the reference for the tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    (first, path), *others = trained_adapters.items()
    model = PeftModel.from_pretrained(base, path, adapter_name=first)
    for name, path in others:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def is_upper(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and all(c.isupper() for c in letters)


def json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def test_questions_are_held_out():
    for name in TRAINED_ADAPTER_STEPS:
        assert not set(QUESTIONS) & {q for q, _ in make_dataset(name)}


def test_each_row_shows_its_own_adapters_behaviour(model_path, trained_adapters, peft_reference, tokenizer):
    llm = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=16, kv_cache_memory=64 << 20)
    for name, path in trained_adapters.items():
        llm.load_adapter(name, path)
    rows = [(q, a) for q in QUESTIONS for a in (None, "upper", "json")]
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q, _ in rows],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        adapters=[a for _, a in rows],
    )
    texts = {(q, a): out.text for (q, a), out in zip(rows, outs, strict=True)}
    for (q, adapter), out in zip(rows, outs, strict=True):
        text = out.text
        assert out.adapter == adapter
        if adapter == "upper":
            assert is_upper(text), f"{q!r} -> {text!r}"
        elif adapter == "json":
            answer = json_object(text)
            assert answer is not None and isinstance(answer.get("answer"), str), f"{q!r} -> {text!r}"
        else:
            assert not is_upper(text) and json_object(text) is None, f"base: {q!r} -> {text!r}"
        assert adapter is None or text != texts[q, None]
        expected = peft_generate(peft_reference, chat_ids(tokenizer, q), adapter, MAX_TOKENS)
        assert out.token_ids == expected, (
            f"{adapter} on {q!r}: {out.token_ids} != {expected}"
        )
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
