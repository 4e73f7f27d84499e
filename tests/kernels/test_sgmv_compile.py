"""The SGMV kernels compile for a Hopper GPU (sm_90, ptxas included) without one.

The interpreter runs the kernels as Python and misses what only the compiler checks (tl.dot minimum
tile sizes, types merged across a runtime `if`, pointer casts), so every TILE_TABLE row is compiled
ahead of time, in a subprocess because this session's kernels are interpreted.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

SCRIPT = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels import triton_sgmv as k

assert not k.INTERPRETED
INT32_TABLES = ("tiles_ptr", "col_blocks_ptr")
INT64_TABLES = ("row_order_ptr", "a_ptrs", "b_ptrs", "rank_ptrs", "scale_ptrs", "r_maxs", "pages", "h_outs",
                "y_offs")


def compile_one(kernel, dtype, constants, num_warps):
    sig = {}
    for name in kernel.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in ("x_ptr", "y_ptr"):
            sig[name] = "*" + dtype
        elif name == "v_ptr":
            sig[name] = "*fp32"
        elif name in INT32_TABLES:
            sig[name] = "*i32"
        elif name in INT64_TABLES:
            sig[name] = "*i64"
        else:
            sig[name] = "i32"
    triton.compile(ASTSource(kernel, sig, constants), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps})


for dtype, tables in (("bf16", k.TILE_TABLE), ("fp32", k.TILE_TABLE[-1:])):
    for _, t in tables:
        common = {"W_DTYPE": getattr(tl, {"bf16": "bfloat16", "fp32": "float32"}[dtype]), "BLOCK_M": t.block_m,
                  "BLOCK_R": t.block_r, "DOT_F32": False, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
        compile_one(k._sgmv_shrink_kernel, dtype, {**common, "BLOCK_K": t.block_k, "SPLIT_K": t.split_k},
                    t.num_warps)
        compile_one(k._sgmv_expand_kernel, dtype, {**common, "BLOCK_N": t.block_n}, t.num_warps)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]
