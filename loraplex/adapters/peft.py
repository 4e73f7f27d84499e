"""Load and validate PEFT LoRA adapters (a `save_pretrained` directory) for a Llama-family base model.

A directory holds adapter_config.json and adapter_model.safetensors, whose tensors are named

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, H_in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [H_out, r]

(PEFT 0.21.2 writes exactly this: no adapter-name segment; we also accept one, `lora_A.default.weight`,
if all keys agree, and keys without the `base_model.model.` prefix, as get_peft_model_state_dict gives
for a bare model with injected adapters.) Semantics, as in PEFT's lora.Linear: y = x @ W.T + scaling * (x @ A.T) @ B.T.

Checks run config first, then the safetensors header, then the key set and shapes against the config
and the base model, and only then are tensors read (and checked finite). Nothing is kept on failure:
the loaders either return a complete LoRAAdapter or raise AdapterError. The config's rules are in
`peft_config.py`, the header's in `safetensors_check.py`, the tensor reads in `tensor_reads.py`, and
what a loaded adapter is in `lora_adapter.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import torch

from loraplex.adapters.lora_adapter import (
    CONFIG_NAME,
    PICKLE_NAME,
    SAFETENSORS_NAME,
    LoRAAdapter,
    LoRAModule,
    ReadPlan,
    StackedModule,
)
from loraplex.adapters.peft_config import LoRAModuleSpec, matching_pattern_keys, resolve_lora_modules
from loraplex.adapters.safetensors_check import (
    AdapterError,
    TensorInfo,
    read_safetensors_header,
)
from loraplex.adapters.tensor_reads import file_identity, make_read_plan, read_planned, read_stacked
from loraplex.model_config import LORA_TARGET_MODULES, ModelConfig

MAX_CONFIG_BYTES = 16 * 1024 * 1024

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z_]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight"
)


def _parse_key(key: str, model_config: ModelConfig) -> tuple[int, str, str, str | None]:
    """(layer, module, "A" or "B", adapter-name segment or None) of a tensor name; AdapterError otherwise."""
    m = _KEY.fullmatch(key)
    if m is not None:
        layer, module = int(m["layer"]), m["module"]
        path = key.removeprefix("base_model.model.").split(".lora_")[0]
        if module in LORA_TARGET_MODULES and path == model_config.hf_module_name(layer, module):
            if layer >= model_config.num_hidden_layers:
                raise AdapterError(
                    f"tensor {key!r}: layer {layer} does not exist, the base model has "
                    f"{model_config.num_hidden_layers} layers"
                )
            return layer, module, m["ab"], m["adapter"]
    if "embed_tokens" in key or "lm_head" in key:
        raise AdapterError(f"tensor {key!r}: embeddings and lm_head are not LoRA targets in loraplex")
    if "lora_magnitude_vector" in key:
        raise AdapterError(f"tensor {key!r}: DoRA (use_dora) is not supported")
    if key.endswith(".bias"):
        raise AdapterError(f"tensor {key!r}: LoRA biases (lora_bias) are not supported")
    raise AdapterError(
        f"tensor {key!r} is not a LoRA weight of this model (expected "
        "base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight)"
    )


def _check_shapes(
    config: dict,
    name: str,
    module: str,
    spec: LoRAModuleSpec,
    keys: dict[str, str],
    header: dict[str, TensorInfo],
    model_config: ModelConfig,
) -> None:
    h_in, h_out = model_config.lora_module_shape(module)
    for ab, expected, what in (("A", (spec.r, h_in), "[r, H_in]"), ("B", (h_out, spec.r), "[H_out, r]")):
        key = keys[ab]
        shape = header[key].shape
        if shape == expected:
            continue
        msg = f"tensor {key!r}: shape {list(shape)} does not fit {name}, expected {what} = {list(expected)}"
        rank_dim = 0 if ab == "A" else 1
        feature_dim = 1 - rank_dim
        if len(shape) == 2 and shape[feature_dim] == expected[feature_dim]:
            msg += f" (its rank is {shape[rank_dim]} but {spec.r_source} = {spec.r})"
            overlapping = matching_pattern_keys(config.get("rank_pattern") or {}, name)
            if len(overlapping) > 1:
                msg += (
                    f"; rank_pattern keys {overlapping} all match {name} and the first one in the file wins "
                    "(PEFT's save_pretrained sorts them, which can change the winner)"
                )
        elif len(shape) == 2:
            msg += " (adapter trained for a base model with other layer sizes?)"
        raise AdapterError(msg)


def load_peft_files(
    config: dict,
    tensors_path: str | os.PathLike,
    model_config: ModelConfig,
    *,
    max_lora_rank: int,
    name: str | None = None,
    path: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Validate and load an adapter from its parsed adapter_config.json and its safetensors file.

    For callers that hold the files elsewhere than a save_pretrained directory (an upload in a temp
    dir). `name` defaults to the name of the file's directory, `path` to that directory. Tensors are
    returned in `dtype` (converted after the finiteness check, and checked again so that a float16
    overflow is refused too), as views into one stacked tensor per projection (`LoRAAdapter.stacked`).
    Raises AdapterError naming the field or tensor at fault.
    """
    tensors_path = os.fspath(tensors_path)
    identity = file_identity(os.stat(tensors_path))  # before the header: the data must come from this file
    path = path if path is not None else os.path.dirname(os.path.abspath(tensors_path))
    name = name if name is not None else os.path.basename(path)
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_NAME}: expected a JSON object, got {type(config).__name__}")
    specs = resolve_lora_modules(config, model_config, max_lora_rank=max_lora_rank)
    header, _ = read_safetensors_header(tensors_path)

    found: dict[tuple[int, str], dict[str, str]] = {}
    adapter_segments = set()
    for key in header:
        layer, module, ab, segment = _parse_key(key, model_config)
        adapter_segments.add(segment)
        keys = found.setdefault((layer, module), {})
        if ab in keys:
            raise AdapterError(f"tensor {key!r}: duplicates {keys[ab]!r}")
        keys[ab] = key
        if (layer, module) not in specs:
            raise AdapterError(
                f"tensor {key!r}: {model_config.hf_module_name(layer, module)} is not selected by {CONFIG_NAME} "
                "(target_modules / layers_to_transform / exclude_modules)"
            )
    if len(adapter_segments) > 1:
        raise AdapterError(
            f"{SAFETENSORS_NAME}: tensor names mix adapter-name segments {sorted(map(str, adapter_segments))}"
        )
    for (layer, module), spec in specs.items():
        module_name = model_config.hf_module_name(layer, module)
        keys = found.get((layer, module), {})
        if not keys:
            deepest = max((i for i, _ in found), default=layer)
            hint = " (adapter trained for a model with fewer layers?)" if layer > deepest else ""
            raise AdapterError(
                f"{CONFIG_NAME} targets {module_name} but {SAFETENSORS_NAME} has no lora_A/lora_B for it{hint}"
            )
        for ab, other in (("A", "B"), ("B", "A")):
            if ab not in keys:
                raise AdapterError(
                    f"tensor {keys[other]!r} has no matching lora_{ab} tensor for {module_name}"
                )
        _check_shapes(config, module_name, module, spec, keys, header, model_config)

    try:
        stacked = read_stacked(tensors_path, identity, header, found, specs, model_config, dtype)
    except AdapterError:
        raise
    except Exception as e:  # the header passed our checks, so this is I/O or a file changed under us
        raise AdapterError(f"{SAFETENSORS_NAME}: cannot read tensors: {e}") from None
    adapter = LoRAAdapter(
        name=name,
        path=path,
        config=config,
        rank=max(spec.r for spec in specs.values()),
        num_bytes=os.path.getsize(tensors_path),
        stacked=stacked,
    )
    adapter.plan = make_read_plan(adapter, identity, tensors_path, header, found, model_config)
    return adapter


def read_adapter_config(path: str | os.PathLike) -> dict:
    """Parse `path`/adapter_config.json into a dict; AdapterError if missing, too large or not a JSON object."""
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise AdapterError(f"{CONFIG_NAME} is missing in {os.fspath(path)!r}")
    size = os.path.getsize(config_path)
    if size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_NAME} is {size} bytes, more than {MAX_CONFIG_BYTES}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_NAME} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_NAME}: expected a JSON object, got {type(config).__name__}")
    return config


def load_peft_adapter(
    path: str | os.PathLike,
    model_config: ModelConfig,
    *,
    max_lora_rank: int,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Load the PEFT LoRA adapter saved (save_pretrained) in directory `path` for `model_config`.

    Ranks and scalings follow PEFT (see loraplex/adapters/peft_config.py); `name` defaults to the
    directory's name; tensors come back in `dtype`. An adapter_model.bin (a pickle) is never loaded.
    Raises AdapterError naming the file, field or tensor at fault.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise AdapterError(f"adapter path {path!r} is not a directory")
    config_path = os.path.join(path, CONFIG_NAME)
    try:
        config_identity = file_identity(os.stat(config_path))  # before reading it, for the read plan
    except OSError:
        config_identity = None  # read_adapter_config says what is wrong
    config = read_adapter_config(path)
    tensors_path = os.path.join(path, SAFETENSORS_NAME)
    if not os.path.isfile(tensors_path):
        if os.path.exists(os.path.join(path, PICKLE_NAME)):
            raise AdapterError(
                f"{PICKLE_NAME} is a pickle, which loraplex never loads; convert it to {SAFETENSORS_NAME} "
                "(save_pretrained(..., safe_serialization=True))"
            )
        raise AdapterError(f"{SAFETENSORS_NAME} is missing in {path!r}")
    name = name if name is not None else os.path.basename(os.path.normpath(path))
    adapter = load_peft_files(
        config, tensors_path, model_config, max_lora_rank=max_lora_rank, name=name, path=path, dtype=dtype
    )
    if adapter.plan is not None:  # a later read by plan checks this config file too
        adapter.plan = dataclasses.replace(adapter.plan, config_path=config_path, config_identity=config_identity)
    return adapter


def validate_peft_adapter(path: str | os.PathLike, model_config: ModelConfig, *, max_lora_rank: int) -> None:
    """All of load_peft_adapter's checks; raises AdapterError or returns None."""
    load_peft_adapter(path, model_config, max_lora_rank=max_lora_rank)


__all__ = [
    "CONFIG_NAME",
    "PICKLE_NAME",
    "SAFETENSORS_NAME",
    "AdapterError",
    "LoRAAdapter",
    "LoRAModule",
    "ReadPlan",
    "StackedModule",
    "load_peft_adapter",
    "load_peft_files",
    "read_adapter_config",
    "read_planned",
    "validate_peft_adapter",
]
