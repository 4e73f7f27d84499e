"""Load and validate PEFT LoRA adapters (a `save_pretrained` directory) for a Llama-family base model.

A directory holds adapter_config.json and adapter_model.safetensors, whose tensors are named

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, H_in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [H_out, r]

(PEFT 0.21.2 writes exactly this: no adapter-name segment; we also accept one, `lora_A.default.weight`,
if all keys agree, and keys without the `base_model.model.` prefix, as get_peft_model_state_dict gives
for a bare model with injected adapters.) Semantics, as in PEFT's lora.Linear: y = x @ W.T + scaling * (x @ A.T) @ B.T.

Checks run config first, then the safetensors header, then the key set and shapes against the config
and the base model, and only then are tensors read (and checked finite). Nothing is kept on failure:
the loaders either return a complete LoRAAdapter or raise AdapterError.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass, field

import torch

from loraplex.adapters.peft_config import LoRAModuleSpec, matching_pattern_keys, resolve_lora_modules
from loraplex.adapters.safetensors_check import (
    DTYPE_ITEMSIZE,
    AdapterError,
    TensorInfo,
    read_safetensors_header,
)
from loraplex.model_config import LORA_TARGET_MODULES, ModelConfig

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
MAX_CONFIG_BYTES = 16 * 1024 * 1024

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z_]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight"
)


@dataclass
class LoRAModule:
    """One projection's LoRA weights: delta_y = scaling * (x @ A.T) @ B.T. A: [r, H_in]; B: [H_out, r]."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class StackedModule:
    """One projection's LoRA weights over all L layers, padded to the adapter's largest rank r for it:
    A [L, r, H_in], B [L, H_out, r] (rows / columns past a layer's own rank, and layers the adapter
    does not target, are zeros); `ranks` and `scalings` per layer (0 where not targeted). The engine
    copies an adapter into its slot buffers with a few copies per projection instead of a few per layer."""

    A: torch.Tensor
    B: torch.Tensor
    ranks: list[int]
    scalings: list[float]


@dataclass
class LoRAAdapter:
    """A loaded adapter. `config` is the raw adapter_config.json, `rank` the max r over its modules,
    `num_bytes` the size of the tensors file in bytes, `stacked` its weights per projection name (in
    LORA_TARGET_MODULES) over all layers; `modules` the same per (layer index, projection name);
    `plan` how to read the same file again without parsing it (`read_planned`), or None."""

    name: str
    path: str
    config: dict
    rank: int
    num_bytes: int
    stacked: dict[str, StackedModule]
    plan: ReadPlan | None = field(default=None, repr=False)

    @functools.cached_property
    def modules(self) -> dict[tuple[int, str], LoRAModule]:
        """{(layer, projection): LoRAModule} for every projection the adapter targets, views into `stacked`."""
        return {(layer, module): LoRAModule(s.A[layer, :r], s.B[layer, :, :r], s.scalings[layer])
                for module, s in self.stacked.items() for layer, r in enumerate(s.ranks) if r}


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
    identity = _identity(os.stat(tensors_path))  # before the header: the data must come from this file
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
        stacked = _read_stacked(tensors_path, identity, header, found, specs, model_config, dtype)
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
    adapter.plan = _read_plan(adapter, identity, tensors_path, header, found, model_config)
    return adapter


@dataclass(frozen=True)
class ReadPlan:
    """How to read a validated adapter's tensors again without parsing its header and config: the
    file's identity when it was validated (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns; the
    last is set by the kernel on every write, so copying a timestamp back does not hide an edit),
    where its data section starts (bytes), its one safetensors dtype, every tensor's element count in
    file order, and per projection the file-order position of each layer's A and B; and the identity
    of adapter_config.json it was read with (`config_path` None: a config given as a dict, not
    checked again). Only for files of one dtype whose targeted projections each have one rank on
    every layer (no layers_to_transform, no rank_pattern that differs between layers); other adapters
    load through `load_peft_files` each time.
    """

    tensors_path: str
    identity: tuple[int, ...]
    base: int
    dtype: str
    sizes: tuple[int, ...]
    positions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    template: LoRAAdapter  # name, path, config, rank, num_bytes and per-projection ranks and scalings
    config_path: str | None = None
    config_identity: tuple[int, ...] | None = None


_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_unchanged(path: str, identity: tuple[int, ...], buf: bytearray) -> bool:
    """Read the file at `path` into buf[:size] if it is the file `identity` describes and stays so
    while it is read (fstat before and after); False otherwise. Raises OSError if it cannot be opened."""
    size = identity[2]
    with open(path, "rb") as f:
        return (_identity(os.fstat(f.fileno())) == identity and f.readinto(memoryview(buf)[:size]) == size
                and _identity(os.fstat(f.fileno())) == identity)


def _value_range(data: torch.Tensor, dtype: torch.dtype) -> tuple[bool, bool]:
    """(every value of `data` is finite, every value is also within `dtype`'s range): one `aminmax`,
    in which NaN propagates, about 10x cheaper than `isfinite`."""
    lo, hi = (float(v) for v in torch.aminmax(data))
    finite = math.isfinite(lo) and math.isfinite(hi)
    return finite, finite and max(-lo, hi) <= torch.finfo(dtype).max


def _read_plan(adapter: LoRAAdapter, identity: tuple[int, ...], tensors_path: str, header: dict[str, TensorInfo],
               found: dict[tuple[int, str], dict[str, str]], model_config: ModelConfig) -> ReadPlan | None:
    dtypes = {info.dtype for info in header.values()}
    num_layers = model_config.num_hidden_layers
    if len(dtypes) != 1 or any(min(m.ranks) != max(m.ranks) for m in adapter.stacked.values()):
        return None
    order = sorted(header, key=lambda k: header[k].begin)
    position = {key: i for i, key in enumerate(order)}
    itemsize = DTYPE_ITEMSIZE[dtypes.pop()]
    template = LoRAAdapter(adapter.name, adapter.path, adapter.config, adapter.rank, adapter.num_bytes,
                           {m: StackedModule(torch.empty(0), torch.empty(0), s.ranks, s.scalings)
                            for m, s in adapter.stacked.items()})
    sizes = tuple((header[k].end - header[k].begin) // itemsize for k in order)
    return ReadPlan(
        tensors_path=tensors_path,
        identity=identity,
        base=identity[2] - sum(sizes) * itemsize,  # the tensors tile the data section to the end of the file
        dtype=header[order[0]].dtype,
        sizes=sizes,
        positions={m: tuple(tuple(position[found[layer, m][ab]] for layer in range(num_layers)) for ab in "AB")
                   for m in adapter.stacked},
        template=template,
    )


_read_buffer = threading.local()  # each loading thread's file buffer, reused from one read to the next


def read_planned(plan: ReadPlan, name: str, dtype: torch.dtype) -> LoRAAdapter | None:
    """Read the adapter `plan` describes again, as `load_peft_files` would, named `name`, in `dtype`.

    No JSON or key parsing: one read into a reused buffer, one `aminmax` (every value finite and within
    `dtype`'s range), one conversion, and one `torch.stack` per projection and A/B. Returns None when
    the file or its adapter_config.json is not the one validated (replaced, or modified since or
    while it was read: its identity differs), could not be read, or holds values the checks refuse;
    the caller then loads it with `load_peft_files`, which says what is wrong. About 6x faster than
    `load_peft_files` (docs/kernels.md).
    """
    size = plan.identity[2]
    buf = getattr(_read_buffer, "buf", None)
    if buf is None or len(buf) < size:
        buf = _read_buffer.buf = bytearray(size)
    try:
        if plan.config_path is not None and _identity(os.stat(plan.config_path)) != plan.config_identity:
            return None
        if not _read_unchanged(plan.tensors_path, plan.identity, buf):
            return None
    except OSError:
        return None
    whole = torch.frombuffer(buf, dtype=_TORCH_DTYPES[plan.dtype], count=sum(plan.sizes), offset=plan.base)
    if not _value_range(whole, dtype)[1]:
        return None
    parts = whole.to(dtype).split(plan.sizes)  # views, of the buffer itself when the dtype is the file's
    tpl = plan.template
    stacked = {}
    for module, (pos_a, pos_b) in plan.positions.items():
        t = tpl.stacked[module]
        r, num_layers = t.ranks[0], len(pos_a)
        stacked[module] = StackedModule(torch.stack([parts[i] for i in pos_a]).view(num_layers, r, -1),
                                        torch.stack([parts[i] for i in pos_b]).view(num_layers, -1, r),
                                        t.ranks, t.scalings)
    return LoRAAdapter(name, tpl.path, tpl.config, tpl.rank, tpl.num_bytes, stacked, plan)


def _read_stacked(tensors_path: str, identity: tuple[int, ...], header: dict[str, TensorInfo],
                  found: dict[tuple[int, str], dict[str, str]], specs: dict[tuple[int, str], LoRAModuleSpec],
                  model_config: ModelConfig, dtype: torch.dtype) -> dict[str, StackedModule]:
    """Read the file once and stack each projection's layers ([L, r, H_in] and [L, H_out, r]) in `dtype`.

    The header is validated already, so the tensors tile the data section: with one dtype in the file
    (the usual case) one finiteness check covers every tensor, and a projection with one rank on every
    layer is one `torch.stack`. Per-tensor work happens only to name the tensor at fault.
    """
    buf = bytearray(identity[2])
    if not _read_unchanged(tensors_path, identity, buf):  # the file whose header was checked, unchanged
        raise AdapterError(f"{SAFETENSORS_NAME}: the file changed while it was read; load it again")
    base = 8 + struct.unpack_from("<Q", buf)[0]

    def view(key: str) -> torch.Tensor:
        info = header[key]
        return torch.frombuffer(buf, dtype=_TORCH_DTYPES[info.dtype], count=math.prod(info.shape),
                                offset=base + info.begin).view(info.shape)

    keys = [found[lm][ab] for lm in specs for ab in ("A", "B")]
    dtypes = {header[k].dtype for k in keys}
    finite = fits = False  # every value is finite in the file / is known to stay finite in `dtype`
    if len(dtypes) == 1 and len(buf) > base:  # the whole data section is one tensor of one dtype
        finite, fits = _value_range(torch.frombuffer(buf, dtype=_TORCH_DTYPES[dtypes.pop()], offset=base), dtype)
    if not finite:  # find the tensor at fault (or check each dtype's tensors on their own)
        for key in keys:
            num_bad = int((~torch.isfinite(view(key))).sum())
            if num_bad:
                raise AdapterError(f"tensor {key!r}: {num_bad} NaN/Inf value(s)")

    num_layers = model_config.num_hidden_layers
    by_module: dict[str, dict[int, LoRAModuleSpec]] = {}
    for (layer, module), spec in specs.items():
        by_module.setdefault(module, {})[layer] = spec
    stacked = {}
    for module, layers in by_module.items():
        h_in, h_out = model_config.lora_module_shape(module)
        r = max(spec.r for spec in layers.values())
        a_views = {layer: view(found[layer, module]["A"]) for layer in layers}
        b_views = {layer: view(found[layer, module]["B"]) for layer in layers}
        if (len(layers) == num_layers and all(spec.r == r for spec in layers.values())
                and len({t.dtype for t in a_views.values()} | {t.dtype for t in b_views.values()}) == 1):
            A = torch.stack([a_views[i] for i in range(num_layers)]).to(dtype)  # [L, r, H_in]
            B = torch.stack([b_views[i] for i in range(num_layers)]).to(dtype)  # [L, H_out, r]
        else:  # layers_to_transform, rank_pattern or mixed dtypes: zero padding where a layer has less
            A = torch.zeros(num_layers, r, h_in, dtype=dtype)
            B = torch.zeros(num_layers, h_out, r, dtype=dtype)
            for layer, spec in layers.items():
                A[layer, :spec.r].copy_(a_views[layer])
                B[layer, :, :spec.r].copy_(b_views[layer])
        if not fits and not (bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())):  # past dtype's range
            for layer, spec in layers.items():
                for ab, t in (("A", A[layer, :spec.r]), ("B", B[layer, :, :spec.r])):
                    num_bad = int((~torch.isfinite(t)).sum())
                    if num_bad:
                        raise AdapterError(f"tensor {found[layer, module][ab]!r}: {num_bad} value(s) overflow {dtype}")
        ranks = [layers[i].r if i in layers else 0 for i in range(num_layers)]
        scalings = [layers[i].scaling if i in layers else 0.0 for i in range(num_layers)]
        stacked[module] = StackedModule(A, B, ranks, scalings)
    return stacked


def validate_peft_files(
    config: dict, tensors_path: str | os.PathLike, model_config: ModelConfig, *, max_lora_rank: int
) -> None:
    """All of load_peft_files' checks (the tensors are read to check they are finite, then dropped)."""
    load_peft_files(config, tensors_path, model_config, max_lora_rank=max_lora_rank)


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
        config_identity = _identity(os.stat(config_path))  # before reading it, for the read plan
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
    "validate_peft_files",
]
