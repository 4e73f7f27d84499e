"""Fixtures for PEFT adapter tests: a tiny random Llama, its ModelConfig, real PEFT adapters saved to disk."""

from __future__ import annotations

import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from loraplex.model_config import ModelConfig  # noqa: E402

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


def tiny_llama(**overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}))


def model_config_for(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_config(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}).to_dict())


@pytest.fixture(scope="session")
def model_config() -> ModelConfig:
    return model_config_for()


@pytest.fixture(scope="session")
def make_llama():
    """make_llama(**LlamaConfig overrides) -> a seeded random LlamaForCausalLM (TINY_LLAMA by default)."""
    return tiny_llama


@pytest.fixture(scope="session")
def make_model_config():
    """make_model_config(**LlamaConfig overrides) -> the matching ModelConfig."""
    return model_config_for


@pytest.fixture
def make_adapter(tmp_path):
    """make_adapter(name="a", model_overrides=None, seed=1, safe_serialization=True, **lora_kwargs) ->
    (directory, PeftModel): a real PEFT adapter with random A and B (init_lora_weights=False)."""

    def make(
        name: str = "a",
        model_overrides: dict | None = None,
        seed: int = 1,
        safe_serialization: bool = True,
        **lora_kwargs,
    ):
        lora_kwargs.setdefault("init_lora_weights", False)
        lora_kwargs.setdefault("r", 4)
        base = tiny_llama(**(model_overrides or {}))
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = peft.get_peft_model(base, peft.LoraConfig(**lora_kwargs))
            path = tmp_path / name
            peft_model.save_pretrained(path, safe_serialization=safe_serialization)
        return path, peft_model

    return make
