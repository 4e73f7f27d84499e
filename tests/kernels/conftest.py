"""Kernel tests run the Triton kernels natively on a GPU and in the Triton interpreter on a CPU.

Triton reads TRITON_INTERPRET when a @triton.jit function is defined, that is when
loraplex.kernels.triton_sgmv is imported, so it is set here, before any test module imports it.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Imported earlier in this session (without the interpreter): define the kernels again.
    if "loraplex.kernels.triton_sgmv" in sys.modules and not sys.modules["loraplex.kernels.triton_sgmv"].INTERPRETED:
        importlib.reload(sys.modules["loraplex.kernels.triton_sgmv"])
