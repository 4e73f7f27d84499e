"""Greedy tokens from the lm_head without the logits (`kernels/cpu_greedy.py`, csrc/greedy_head_cpu.cpp):
the argmax of our avx512 GEMM's fp32 logits, the first on a tie, for every row it screens, including ties
and near ties the bf16 screen cannot resolve; rows it leaves out; where it runs and where it does not."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from loraplex.kernels import cpu_ext, cpu_gemm, cpu_greedy

ext = cpu_ext.load()
BF16 = ext is not None and ext.avx512_bf16_available()
pytestmark = pytest.mark.skipif(not BF16, reason="needs the CPU kernels and a CPU with AVX512-BF16")


def _head(v: int, k: int, gen: torch.Generator, weight: torch.Tensor | None = None) -> nn.Linear:
    """An fp32 [v, k] lm_head (random, or `weight`), packed for our avx512 GEMM and given the screen's copy."""
    head = nn.Linear(k, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, k, generator=gen) / k**0.25 if weight is None else weight)
    assert cpu_gemm.pack_linears([(head, "lm_head")], memory_bytes=1 << 40, name="avx512")
    assert cpu_greedy.attach(head, memory_bytes=1 << 40)
    return head


def _hidden(head: nn.Linear, rows: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, K] hidden states like a last layer's: noise plus a multiple of some token's weight row, so
    that each row has a clear winner and a spread of close runners-up."""
    w = head.weight.detach()
    picks = torch.randint(0, w.shape[0], (rows,), generator=gen)
    return torch.randn(rows, w.shape[1], generator=gen) + 2 * w[picks]


def _fp32_argmax(head: nn.Linear, x: torch.Tensor) -> list[int]:
    """The tokens greedy decoding takes from the logits: our avx512 GEMM's, then max(-1) (first on a tie)."""
    return cpu_gemm.linear(head, x).max(dim=-1).indices.tolist()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("v", "k"), [(49152 // 8, 576), (1000, 73), (48, 64), (50, 2)])
def test_tokens_are_the_fp32_argmax_for_every_tile_height_and_shape(v, k, threads):
    """Rows 1-8 (each tile height), 13, 64 and 100; a last panel of 40 of 48 columns (V = 1000) or 2 of 48
    (V = 50); an odd K (the last bf16 pair half zero); one and two threads (the panels split, the
    candidates merged in column order)."""
    gen = torch.Generator().manual_seed(v + k)
    head = _head(v, k, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 100):
            x = _hidden(head, rows, gen)
            tokens, candidates = cpu_greedy.greedy_tokens(head, x)
            assert tokens == _fp32_argmax(head, x), rows
            assert all(c >= 1 for c in candidates)
    finally:
        torch.set_num_threads(before)


def test_strided_rows_give_the_tokens_of_their_contiguous_copy():
    gen = torch.Generator().manual_seed(1)
    head = _head(500, 64, gen)
    wide = _hidden(head, 9, gen).repeat(1, 3)[:, 64:128]  # rows 192 floats apart
    assert not wide.is_contiguous()
    assert cpu_greedy.greedy_tokens(head, wide)[0] == _fp32_argmax(head, wide.contiguous())


def test_a_tie_goes_to_the_first_token_and_a_near_tie_below_bf16_is_resolved_in_fp32():
    """Tokens 7 and 300 have the same weight row (an exact tie: 7 wins, as max(-1) picks); token 500's row is
    theirs plus 1e-4 in column 0, which no other row uses, so x's column 0 moves token 500's logit alone:
    not at all (a three-way tie), up by 5e-3 or down by 5e-3, far inside the screen's bound (about 0.3
    here). The screen cannot rule out any of the three, so the fp32 recheck decides."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(600, 64, generator=gen) / 64**0.25
    w[:, 0] = 0.0
    w[300] = w[7]
    w[500] = w[7]
    w[500, 0] = 1e-4
    head = _head(600, 64, gen, w)
    x = (10 * w[7]).repeat(3, 1)  # [3, K]
    x[:, 0] = torch.tensor([0.0, 50.0, -50.0])
    tokens, candidates = cpu_greedy.greedy_tokens(head, x)
    logits = cpu_gemm.linear(head, x)
    assert logits[0, 7] == logits[0, 300] == logits[0, 500] and logits[2, 7] == logits[2, 300] > logits[2, 500]
    assert logits[1, 500] > logits[1, 7]
    assert tokens == _fp32_argmax(head, x) == [7, 500, 7]
    assert all(c >= 3 for c in candidates)


def test_correlated_bf16_roundings_do_not_drop_the_argmax():
    """x and W_0 round down to bf16 where W_0 is nonzero, x rounds up where W_1 is: the screened logits put
    token 1 ahead (30.34 against 30.00) though token 0 wins in fp32 (30.2348 against 30.2270). A bound
    built on half of bf16's unit roundoff (2^-9 rather than 2^-8) drops token 0 here."""
    a = 1 + 2**-8 - 2**-23  # bf16: 1.0 (down by almost 2^-8)
    b = 1 + 2**-8 + 2**-23  # bf16: 1 + 2^-7 (up)
    x = torch.tensor([[a] * 30 + [b] * 30])
    w = torch.tensor([[a] * 30 + [0.0] * 30, [0.0] * 30 + [1 + 2**-7] * 14 + [1.0] * 16])
    head = _head(2, 60, torch.Generator(), w)
    logits = cpu_gemm.linear(head, x)
    assert logits[0, 0] > logits[0, 1] + 0.005
    screened = (x.bfloat16().float() @ w.bfloat16().float().t())[0]
    assert screened[1] > screened[0] + 0.3
    assert cpu_greedy.greedy_tokens(head, x)[0] == [0]


def test_a_winner_decided_by_the_fp32_rounding_alone_is_the_gemm_s():
    """Every weight row is a permutation of one vector of mixed magnitudes and x is all ones, so the exact
    logits are all equal and which one wins (and which tie first) is decided by the rounding of the
    GEMM's FMA chain in k order: the recheck must make the same bits."""
    gen = torch.Generator().manual_seed(7)
    k, v = 576, 300
    base = torch.randn(k, generator=gen) * 10 ** (torch.rand(k, generator=gen) * 6 - 3)
    w = torch.stack([base[torch.randperm(k, generator=gen)] for _ in range(v)])
    head = _head(v, k, gen, w)
    x = torch.ones(3, k)
    logits = cpu_gemm.linear(head, x)
    assert len(set(logits[0].tolist())) > 10  # the rounding tells the rows apart
    tokens, candidates = cpu_greedy.greedy_tokens(head, x)
    assert tokens == _fp32_argmax(head, x)
    assert min(candidates) > 10  # the screen could not tell them apart: the recheck decided


def test_a_weight_or_row_beyond_bf16_s_range_is_not_screened():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(100, 16, generator=gen)
    w[3, 2] = 3.4e38  # finite in fp32, inf in bf16
    head = nn.Linear(16, 100, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    assert cpu_gemm.pack_linears([(head, "lm_head")], memory_bytes=1 << 40, name="avx512")
    assert not cpu_greedy.attach(head, memory_bytes=1 << 40)
    with pytest.raises(RuntimeError, match="beyond bf16's range"):
        ext.greedy_head_pack(w)
    # weights small enough that ||x|| max ||W_j|| stays far below fp32's range even with x at 3.4e38:
    # only the check of x's own values leaves that row out
    tiny = _head(100, 16, gen, torch.randn(100, 16, generator=gen) * 1e-5)
    assert 3.4e38 * float(tiny.greedy_norms.max()) < 1e36
    x = torch.zeros(2, 16)
    x[0, 0] = 1.0
    x[1, 0] = 3.4e38
    tokens, _ = cpu_greedy.greedy_tokens(tiny, x)
    assert tokens == [_fp32_argmax(tiny, x[:1])[0], -1]


def test_products_flushed_as_subnormals_are_within_the_bound():
    """bf16(1e-39) is subnormal, so vdpbf16ps drops the product x_0 W_00 and screens token 0's logit as 0,
    against 9e-9 for token 1; in fp32 token 0 wins (1e-8 against 9e-9). Only the bound's absolute term
    for flushed subnormals (about 3e-7 here) keeps token 0 a candidate."""
    x = torch.tensor([[1e31, 1e29]])
    w = torch.tensor([[1e-39, 0.0], [0.0, 9e-38]])
    head = _head(2, 2, torch.Generator(), w)
    logits = cpu_gemm.linear(head, x)
    assert logits[0, 0] > logits[0, 1] > 0
    assert cpu_greedy.greedy_tokens(head, x)[0] == [0]


def test_a_row_with_a_nan_inf_or_a_huge_norm_is_left_to_the_logits_and_the_others_are_not():
    gen = torch.Generator().manual_seed(3)
    head = _head(400, 32, gen)
    x = _hidden(head, 5, gen)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] *= 1e35  # logits may overflow: the caller's logits say what happens
    tokens, candidates = cpu_greedy.greedy_tokens(head, x)
    assert tokens[1:4] == [-1, -1, -1] and candidates[1:4] == [0, 0, 0]
    want = _fp32_argmax(head, x)
    assert [tokens[0], tokens[4]] == [want[0], want[4]]


def test_the_kernel_refuses_what_does_not_fit():
    gen = torch.Generator().manual_seed(4)
    head = _head(100, 64, gen)
    x = _hidden(head, 2, gen)
    w = head.weight.detach()
    with pytest.raises(RuntimeError, match="packed does not hold"):
        ext.greedy_head(x, ext.greedy_head_pack(w[:50]), head.greedy_norms, w)
    packed = head.greedy_packed.view(-1)
    shifted = torch.empty(packed.numel() + 1, dtype=packed.dtype)[1:]  # the right size, 4 bytes off
    shifted.copy_(packed)
    with pytest.raises(RuntimeError, match="not 64-byte aligned"):
        ext.greedy_head(x, shifted, head.greedy_norms, w)
    with pytest.raises(RuntimeError, match=r"with x.s K = 32 columns, got \[100, 64\]"):
        ext.greedy_head(x[:, :32], head.greedy_packed, head.greedy_norms, w)
    with pytest.raises(RuntimeError, match="a NaN, an Inf or a value beyond"):
        ext.greedy_head_pack(torch.full((4, 4), float("inf")))


def test_norms_are_never_below_the_exact_ones():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(2000, 77, generator=gen)
    assert (cpu_greedy.norms_rounded_up(w).double() >= w.double().norm(dim=1)).all()


def test_the_screen_runs_only_on_an_fp32_lm_head_packed_for_our_avx512_gemm(monkeypatch, caplog):
    gen = torch.Generator().manual_seed(6)

    def linear(bias=False):
        lin = nn.Linear(64, 200, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(200, 64, generator=gen))
        return lin

    plain = linear()
    assert not cpu_greedy.attach(plain)  # not packed
    assert cpu_greedy.greedy_tokens(plain, torch.randn(2, 64)) is None
    onednn = linear()
    cpu_gemm.pack_linears([(onednn, "lm_head")], memory_bytes=1 << 40, name="onednn")
    assert not cpu_greedy.attach(onednn)  # another arithmetic than the recheck's FMA chain
    biased = linear(bias=True)
    cpu_gemm.pack_linears([(biased, "lm_head")], memory_bytes=1 << 40, name="avx512")
    assert not cpu_greedy.attach(biased)
    small = linear()
    cpu_gemm.pack_linears([(small, "lm_head")], memory_bytes=1 << 40, name="avx512")
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.cpu_greedy"):
        assert not cpu_greedy.attach(small, memory_bytes=1000)
    assert "needs 0 MiB, more than 25% of the 0 MiB available" in caplog.text
    monkeypatch.setattr(cpu_greedy, "enabled", False)  # LORAPLEX_GREEDY_HEAD=0
    assert not cpu_greedy.attach(small, memory_bytes=1 << 40)
    monkeypatch.setattr(cpu_greedy, "enabled", True)
    assert cpu_greedy.attach(small, memory_bytes=1 << 40)
    x = torch.randn(3, 64, generator=gen)
    assert cpu_greedy.greedy_tokens(small, x)[0] == _fp32_argmax(small, x)
    assert cpu_greedy.greedy_tokens(small, x.double()) is None  # not what the packed copy takes
    small.weight = nn.Parameter(small.weight.detach().clone())  # re-bound: the copies are not of it
    assert cpu_greedy.greedy_tokens(small, x) is None
