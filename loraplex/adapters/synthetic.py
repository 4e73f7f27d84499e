"""Random PEFT LoRA adapters for tests and benchmarks, written exactly as peft's save_pretrained does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_random_adapter(path, model_cfg, *, r: int, alpha: float, targets=("q_proj", "v_proj"),
                         seed: int = 0, b_std: float = 0.05) -> None:
    """A PEFT LoRA adapter directory exactly as peft's save_pretrained writes it, with random A and B
    (A ~ N(0, 1/H_in), B ~ N(0, b_std)); fast enough to make hundreds."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_cfg.num_hidden_layers):
        for module in targets:
            h_in, h_out = model_cfg.lora_module_shape(module)
            key = f"base_model.model.{model_cfg.hf_module_name(layer, module)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, h_in, generator=gen) / h_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(h_out, r, generator=gen) * b_std
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))


def randomize_lora_weights(peft_model, generator: torch.Generator, b_std: float = 0.05) -> None:
    """Give every LoRA module of a PeftModel random A ~ N(0, 1/H_in) and B ~ N(0, b_std), in place.

    PEFT initialises B to zero (a no-op adapter); tests and benchmarks need adapters that change the output.
    """
    for module in peft_model.modules():
        if hasattr(module, "lora_A"):
            for name in module.lora_A:
                a, b = module.lora_A[name].weight, module.lora_B[name].weight
                a.data = torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5
                b.data = torch.randn(b.shape, generator=generator) * b_std
