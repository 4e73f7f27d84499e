"""Shared fixtures: the real default model (converted once per machine) and PEFT adapters made on it."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when it is first
# imported (peft and transformers import it), so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model's cached directory; the first run on a machine downloads and converts it."""
    from loraplex.engine.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own LlamaForCausalLM on the same weights, fp32: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def plain_hf_model(model_path):
    """A second transformers model on the same weights that no test wraps: the parity tests' PEFT fixtures
    inject LoRA layers into `hf_model` in place, after which its plain forward runs their active adapter."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def trained_adapters(model_path, tmp_path_factory) -> dict:
    """{name: directory} of adapters trained now with PEFT (examples/train_adapters.py, fp32) and written
    by its save_pretrained: "upper" answers in upper case, "json" with a JSON object."""
    import time

    from examples.train_adapters import train_adapter
    from tests.helpers import TRAINED_ADAPTER_STEPS

    root = tmp_path_factory.mktemp("trained")
    started = time.perf_counter()
    paths = {
        name: train_adapter(name, root, steps, seed=0, model_path=model_path, bf16=False)["path"]
        for name, steps in TRAINED_ADAPTER_STEPS.items()
    }
    print(f"trained {', '.join(paths)} in {time.perf_counter() - started:.1f} s")
    return paths
