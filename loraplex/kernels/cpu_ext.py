"""The compiled CPU kernels, built once per machine, checkout and PyTorch version: the BGMV LoRA kernel
(`csrc/bgmv_cpu.cpp`), the paged attention (`csrc/paged_attention_cpu.cpp`) and fp32 linears on
prepacked weights (`csrc/gemm_cpu.cpp`, loraplex's GEMM for AVX2 and AVX-512; `csrc/packed_gemm_cpu.cpp`,
MKL's packed GEMM), RoPE in place
(`csrc/rope_cpu.cpp`), the decoder's residual add + RMSNorm and SiLU x up in one pass each
(`csrc/norm_act_cpu.cpp`) and the sampler's greedy pick from fp32 logits (`csrc/first_max_cpu.cpp`), one
library.

PyTorch's C++ extension loader compiles it with the machine's C++ compiler and ninja (about 20 s on
a 2-core CPU) under `$TORCH_EXTENSIONS_DIR/loraplex` (default `~/.cache/torch_extensions/loraplex`);
later processes load the built library in about 0.1 s. `scripts/install` builds it (`loraplex
build-kernels`), so a server's first start does not. `get()` hands it to the LoRA path only on CPUs
with AVX-512 (the BGMV kernel's scalar path is the same maths but about 5x slower than the
`embedding_bag` gathers, which run instead elsewhere); `load()` hands it to the attention on every
CPU (its loop is compiled for AVX-512, AVX2 and plain x86-64). Where it cannot be built (no compiler, a
build error) they log why once and return None, and the callers fall back to PyTorch
(`cpu_bgmv.add_lora_bgmv`'s gathers, `attention.py`'s gather and sdpa). `LORAPLEX_CPU_KERNEL=0` turns
it off.

Builds are serialized by an OS lock on a file next to the build directory (released if the process
dies); holding it, a lock file that PyTorch's loader left from a killed build is stale and removed,
so an interrupted build cannot make later starts wait forever.

The library is linked against OpenMP and parallelizes with `at::parallel_for`, so it runs on
PyTorch's own thread pool (the process has one libgomp, PyTorch's): no second team of threads
competes with the engine's on a small machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

import torch

from loraplex import isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "module.cpp", CSRC / "bgmv_cpu.cpp", CSRC / "paged_attention_cpu.cpp", CSRC / "paged_decode_cpu.cpp",
           CSRC / "paged_prefill_cpu.cpp", CSRC / "packed_gemm_cpu.cpp", CSRC / "gemm_cpu.cpp",
           CSRC / "greedy_head_cpu.cpp", CSRC / "first_max_cpu.cpp", CSRC / "rope_cpu.cpp",
           CSRC / "norm_act_cpu.cpp", CSRC / "layer_cpu.cpp"]
HEADERS = [CSRC / "entry_points.h", CSRC / "paged_attention.h", CSRC / "paged_vec.h", CSRC / "bgmv_rows.inc"]
CFLAGS = ("-O3", "-fopenmp") + (("-DLORAPLEX_NO_AVX512",) if isa.cap() == "avx2" else ())  # loraplex.isa
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module = None
_tried = False
enabled = os.environ.get("LORAPLEX_CPU_KERNEL", "1") != "0"
max_lanes = 16  # the widest BGMV path taken where the CPU has it: 16 (AVX-512), 8 (AVX2 + FMA, fp32), 0 (scalar; tests)


def module_name() -> str:
    """Name of the built library: the sources, their paths (one build per checkout: PyTorch's build files
    name a source by path, and another checkout's would rebuild it), flags and PyTorch version hashed
    in, so a change to any of them builds a new one instead of loading a stale one."""
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    digest.update(" ".join([*(str(s.resolve()) for s in SOURCES), torch.__version__, *CFLAGS, *LDFLAGS]).encode())
    return f"loraplex_cpu_{digest.hexdigest()[:12]}"


def build_root() -> Path:
    """Where the builds go: `$TORCH_EXTENSIONS_DIR/loraplex`, default `~/.cache/torch_extensions/loraplex`."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base).expanduser() / "loraplex"


def get(dtype=None):
    """The compiled module for the LoRA path (functions `bgmv`, `avx512_available`, `avx2_available`,
    `avx512_bf16_available`, `bgmv_lanes`, `paged_attention`) for weights of `dtype` (a torch dtype; None:
    only where every dtype has a vector path, i.e. with AVX-512): None when turned off, when it cannot
    be built (each logged once), or where its BGMV has no vector path for `dtype` (that path needs
    AVX-512, or AVX2 + FMA for float32; elsewhere its scalar path is slower than the embedding_bag
    gathers). Builds it on first use. Thread-safe."""
    module = load()
    if module is None:
        return None
    return module if module.bgmv_lanes(dtype == torch.float32, 16) > 0 else None


def load_build(path: str | os.PathLike):
    """The extension module of one built library at `path` (an .so this module built, in this checkout or
    another), for timing several builds in one process (scripts/attn-bench, scripts/gemm-bench). The
    module name is the file's, as `cpp_extension` named its init function. Raises ImportError where the
    file is not such a library."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The compiled module whatever the CPU (the attention runs on every CPU; the tests run the BGMV
    kernel's scalar path), building it on first use; None when turned off or when it cannot be built."""
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


BUILD_WAIT_S = 900.0  # the longest a start waits for another process's build before it goes without the kernels


def _wait_for_lock(lock) -> None:
    """Take the build lock `lock` (an open file); while another process holds it (building: minutes on an
    old 2-core CPU), say so, again every minute, and give up after BUILD_WAIT_S (TimeoutError: the
    kernels are optional, and a holder that is stopped or hung must not keep the server from starting)."""
    start = time.monotonic()
    said = None
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - start
            if waited >= BUILD_WAIT_S:
                raise TimeoutError(f"another process held the build lock {lock.name} for {waited:.0f} s") from None
            if said is None or waited - said >= 60:
                logger.warning("waiting for another process to finish building the CPU kernels (lock %s; %.0f s "
                               "so far)", lock.name, waited)
                said = waited
            time.sleep(0.2)


def _build():
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        name = module_name()
        build_dir = build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_root() / f"{name}.lock", "w") as lock:
            _wait_for_lock(lock)
            (build_dir / "lock").unlink(missing_ok=True)  # PyTorch's, left by a killed build: stale
            if not (build_dir / f"{name}.so").exists():
                logger.warning("building the CPU kernels (once per machine and checkout: under a minute on a "
                               "recent CPU, 4-5 minutes on an older 2-core one)")
            module = cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                                        extra_ldflags=list(LDFLAGS), build_directory=str(build_dir),
                                        verbose=False)
    except Exception as exc:  # no compiler or ninja, a build error: the PyTorch paths still work
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # the compiler's own complaint (an error, a missing program) says more than ninja's last line
        said = [line for line in lines if "error:" in line.lower() or "not found" in line.lower()][:3]
        logger.warning("CPU kernels not built (%s: %s); many-adapter CPU steps use the slower embedding_bag "
                       "gathers, and attention gathers the KV cache for PyTorch's sdpa", type(exc).__name__,
                       " | ".join(said or lines[-1:]))
        return None
    logger.info("CPU kernels ready in %.1f s (AVX-512: %s, AVX512-BF16: %s)", time.perf_counter() - start,
                module.avx512_available(), module.avx512_bf16_available())
    if not module.avx512_available():
        logger.warning("%s: many-adapter bf16/fp16 CPU steps use the embedding_bag gathers, faster here than "
                       "the kernel's scalar path%s", "held to AVX2 (LORAPLEX_CPU_ISA=avx2)" if isa.cap() else
                       "this CPU has no AVX-512", "; fp32 ones its AVX2 path" if module.avx2_available() else "")
    return module
