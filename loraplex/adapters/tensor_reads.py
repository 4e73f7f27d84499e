"""Reading an adapter's tensors from its safetensors file: the first read after validation
(`read_stacked`, every value checked finite and within the dtype) and later reads by the `ReadPlan`
recorded then (`read_planned`), which skip parsing while the file is the one validated.
"""

from __future__ import annotations

import math
import os
import struct
import threading

import torch

from loraplex.adapters.lora_adapter import SAFETENSORS_NAME, LoRAAdapter, ReadPlan, StackedModule
from loraplex.adapters.peft_config import LoRAModuleSpec
from loraplex.adapters.safetensors_check import DTYPE_ITEMSIZE, AdapterError, TensorInfo
from loraplex.model_config import ModelConfig

_read_buffer = threading.local()  # each loading thread's file buffer, reused from one read to the next
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_unchanged(path: str, identity: tuple[int, ...], buf: bytearray) -> bool:
    """Read the file at `path` into buf[:size] if it is the file `identity` describes and stays so
    while it is read (fstat before and after); False otherwise. Raises OSError if it cannot be opened."""
    size = identity[2]
    with open(path, "rb") as f:
        return (file_identity(os.fstat(f.fileno())) == identity and f.readinto(memoryview(buf)[:size]) == size
                and file_identity(os.fstat(f.fileno())) == identity)


def _value_range(data: torch.Tensor, dtype: torch.dtype) -> tuple[bool, bool]:
    """(every value of `data` is finite, every value is also within `dtype`'s range): one `aminmax`,
    in which NaN propagates, about 10x cheaper than `isfinite`."""
    lo, hi = (float(v) for v in torch.aminmax(data))
    finite = math.isfinite(lo) and math.isfinite(hi)
    return finite, finite and max(-lo, hi) <= torch.finfo(dtype).max


def make_read_plan(adapter: LoRAAdapter, identity: tuple[int, ...], tensors_path: str, header: dict[str, TensorInfo],
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
        if plan.config_path is not None and file_identity(os.stat(plan.config_path)) != plan.config_identity:
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


def read_stacked(tensors_path: str, identity: tuple[int, ...], header: dict[str, TensorInfo],
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
