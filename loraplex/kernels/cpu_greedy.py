"""Greedy tokens without the fp32 logits: `csrc/greedy_head_cpu.cpp`'s bf16 screen and exact fp32 recheck.

Letters: B rows (hidden states of the requests that sample), H hidden size, V vocab.

Semantics: `greedy_tokens(lm_head, hidden)[b] == linear(lm_head, hidden)[b].max(-1).indices` (the first
largest logit), for every row it screens; the other rows are -1 and the caller computes their logits.
The screen runs where the exact recheck reproduces the lm_head's own arithmetic: an fp32 lm_head that
`cpu_gemm.pack_linears` packed for our avx512 GEMM (each logit one FMA chain in k order), on a CPU with
AVX512-BF16. There the screen's [B, V] product runs on bf16 pairs at twice the fp32 FMA rate and no
logits are written; at 64 rows of the default model, 17 ms against the fp32 lm_head's 35 ms plus its
argmax (docs/performance.md). `LORAPLEX_GREEDY_HEAD=0` turns it off.

The bound, the candidates and why the result is the fp32 argmax are in the C++ file's header.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from loraplex.kernels import cpu_ext, cpu_gemm

logger = logging.getLogger(__name__)

enabled = os.environ.get("LORAPLEX_GREEDY_HEAD", "1") != "0"


def norms_rounded_up(weight: torch.Tensor) -> torch.Tensor:
    """weight [V, H] -> [V] fp32: each row's L2 norm, computed in fp64 and rounded up to fp32 (the screen's
    bound needs norms no smaller than the true ones)."""
    exact = weight.detach().double().norm(dim=1)
    out = exact.float()
    return torch.where(out.double() < exact, torch.nextafter(out, torch.tensor(float("inf"))), out)


def attach(lm_head: nn.Linear, memory_bytes: int | None = None) -> bool:
    """Give `lm_head` the screen's copy of its weight (`greedy_packed`, bf16 pairs, half the fp32 bytes, and
    `greedy_norms` [V]) where the screen can run (see the module docstring; no bias) and
    the copy takes at most `cpu_gemm.MEMORY_SHARE` of `memory_bytes` (default: the machine's available
    memory). Returns whether it did; a copy that does not fit, or a weight the screen cannot bound (a value
    that is not finite or beyond bf16's range), is logged."""
    weight = lm_head.weight
    if (not enabled or lm_head.bias is not None or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or not weight.is_contiguous() or getattr(lm_head, "packed_backend", None) != "avx512"
            or getattr(lm_head, "packed_weight", None) is None):
        return False
    ext = cpu_ext.load()
    if ext is None or not ext.avx512_bf16_available():
        return False
    need = weight.numel() * 2
    have = cpu_gemm.available_memory_bytes() if memory_bytes is None else memory_bytes
    if need > cpu_gemm.MEMORY_SHARE * have:
        logger.warning("greedy rows compute every logit: the lm_head's bf16 screen needs %.0f MiB, more than %d%% "
                       "of the %.0f MiB available", need / 2**20, cpu_gemm.MEMORY_SHARE * 100, have / 2**20)
        return False
    try:
        packed = ext.greedy_head_pack(weight.detach())
    except RuntimeError as exc:  # a value beyond bf16's range, a NaN or an Inf: no bound holds
        logger.info("greedy rows compute every logit: %s", exc)
        return False
    lm_head.greedy_packed = packed
    lm_head.greedy_norms = norms_rounded_up(weight)
    return True


def greedy_tokens(lm_head: nn.Linear, hidden: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """hidden [B, H] -> (tokens, candidates), each a list of B ints: row b's greedy token (-1 where the row
    is left to the caller: a NaN, an Inf or a value beyond bf16's range in it, or a norm too large to rule
    out overflow) and how many
    tokens it computed in fp32. None where the screen does not run: `attach` did not give `lm_head` a
    copy, or `linear(lm_head, hidden)` would not take the packed fp32 copy whose arithmetic the recheck
    reproduces (`cpu_gemm.takes_packed`)."""
    packed = getattr(lm_head, "greedy_packed", None)
    if (packed is None or getattr(lm_head, "packed_backend", None) != "avx512" or not lm_head.weight.is_contiguous()
            or not cpu_gemm.takes_packed(lm_head, hidden)):
        return None
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    tokens, candidates = cpu_ext.load().greedy_head(x, packed, lm_head.greedy_norms, lm_head.weight.detach())
    return tokens.tolist(), candidates.tolist()
