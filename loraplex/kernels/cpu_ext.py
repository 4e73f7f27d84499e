"""The compiled CPU BGMV kernel (`csrc/bgmv_cpu.cpp`), built once per machine and PyTorch version.

PyTorch's C++ extension loader compiles it with the machine's C++ compiler and ninja (about 20 s on
a 2-core CPU) into PyTorch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`); later processes load the built library in well under a second.
`scripts/install` builds it (`loraplex build-kernels`), so a server's first start does not. Where it cannot be built (no compiler, a build error) `get()` logs why once and
returns None, and the CPU path falls back to the `embedding_bag` gathers (`reference.add_lora_bgmv`).
`LORAPLEX_CPU_KERNEL=0` turns it off.

The library is linked against OpenMP and parallelizes with `at::parallel_for`, so it runs on
PyTorch's own thread pool (the process has one libgomp, PyTorch's): no second team of threads
competes with the engine's on a small machine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "bgmv_cpu.cpp"
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module = None
_tried = False
enabled = os.environ.get("LORAPLEX_CPU_KERNEL", "1") != "0"
vectorized = True  # the AVX-512 path where the CPU has it; False runs the scalar path (tests)


def module_name() -> str:
    """Name of the built library: the source, flags and PyTorch version hashed in, so a change to any
    of them builds a new one instead of loading a stale one."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([torch.__version__, *CFLAGS, *LDFLAGS]).encode())
    return f"loraplex_bgmv_cpu_{digest.hexdigest()[:12]}"


def get():
    """The compiled module (functions `bgmv`, `avx512_available`, `avx512_bf16_available`), building it on first use; None when
    turned off or when it cannot be built (the reason is logged once). Thread-safe; PyTorch's
    loader also locks the build directory against other processes building it at the same time."""
    global _module, _tried
    if not enabled:
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            _module = _build()
            _tried = True
    return _module


def _build():
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        module = cpp_extension.load(name=module_name(), sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                    extra_ldflags=LDFLAGS, verbose=False)
    except Exception as exc:  # no compiler or ninja, a build error: the gather path still works
        reason = (str(exc).strip().splitlines() or [""])[-1]  # a compiler's last line says most
        logger.warning("CPU LoRA kernel not built (%s: %s); many-adapter CPU steps use the slower "
                       "embedding_bag gathers", type(exc).__name__, reason)
        return None
    logger.info("CPU LoRA kernel ready in %.1f s (AVX-512: %s, AVX512-BF16: %s)", time.perf_counter() - start,
                module.avx512_available(), module.avx512_bf16_available())
    return module
