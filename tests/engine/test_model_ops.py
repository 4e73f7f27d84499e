"""The decoder's elementwise ops against Hugging Face's forms: fp32 RMSNorm through `F.rms_norm` and
RoPE rotated in place by the compiled kernel (fp32 and bf16) give the same bits as the four-op PyTorch
expressions that LlamaForCausalLM uses. The fused residual add + RMSNorm and SiLU x up (one pass each on
the compiled kernel) are within a few ulps of fp64 in fp32, keep PyTorch's residual sum, and in bf16 round
where HF's bf16 forms round: equal to them but for rare one-ulp flips."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.model import RMSNorm, RotaryEmbedding, _rotate_half
from loraplex.kernels import cpu_ext
from tests.helpers import built_cpu_ext


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x = (torch.randn(37, 576, generator=gen) * 4).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-5))


def test_rope_in_place_is_hf_bit_for_bit_and_leaves_v_alone():
    built_cpu_ext()
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 4096, 10000.0)
    T, nh, nkv, d = 37, 9, 3, 64
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=gen) * 3
    positions = torch.randint(0, 4096, (T,), generator=gen)
    q, k = qkv[:, :nh * d].reshape(T, nh, d), qkv[:, nh * d:(nh + nkv) * d].reshape(T, nkv, d)
    cos, sin = rope.cos[positions][:, None, :], rope.sin[positions][:, None, :]
    want_q, want_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin  # HF's apply_rotary_pos_emb
    x = qkv.clone()
    assert rope.rotate_qk_(positions, x, nh + nkv, d)
    assert torch.equal(x[:, :nh * d].view(T, nh, d), want_q)
    assert torch.equal(x[:, nh * d:(nh + nkv) * d].view(T, nkv, d), want_k)
    assert torch.equal(x[:, (nh + nkv) * d:], qkv[:, (nh + nkv) * d:])  # v untouched
    # rows with a stride (a view into a wider buffer) rotate the same
    wide = torch.zeros(T, qkv.shape[1] + 8)
    wide[:, :qkv.shape[1]] = qkv
    assert rope.rotate_qk_(positions, wide[:, :qkv.shape[1]], nh + nkv, d)
    assert torch.equal(wide[:, :qkv.shape[1]], x) and not wide[:, qkv.shape[1]:].any()


@pytest.mark.parametrize("d", [64, 20, 40])  # 20, 40: halves of 10 and 20 columns, vectors and a tail
def test_bf16_rope_in_place_is_hf_bit_for_bit(d):
    """bf16 rows, with cos and sin cast to bf16 as HF casts them, round each product and each sum as the
    PyTorch bf16 ops do."""
    built_cpu_ext()
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(d, 4096, 10000.0)
    T, nh, nkv = 19, 9, 3
    qkv = (torch.randn(T, (nh + 2 * nkv) * d, generator=gen) * 3).bfloat16()
    positions = torch.randint(0, 4096, (T,), generator=gen)
    q, k = qkv[:, :nh * d].reshape(T, nh, d), qkv[:, nh * d:(nh + nkv) * d].reshape(T, nkv, d)
    cos = rope.cos[positions].bfloat16()[:, None, :]
    sin = rope.sin[positions].bfloat16()[:, None, :]
    want_q, want_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    x = qkv.clone()
    assert rope.rotate_qk_(positions, x, nh + nkv, d)
    assert torch.equal(x[:, :nh * d].view(T, nh, d), want_q)
    assert torch.equal(x[:, nh * d:(nh + nkv) * d].view(T, nkv, d), want_k)
    assert torch.equal(x[:, (nh + nkv) * d:], qkv[:, (nh + nkv) * d:])  # v untouched
    with pytest.raises(RuntimeError, match="of x's dtype"):  # fp32 tables for bf16 rows
        cpu_ext.load().rope_inplace(x, rope.cos[positions], rope.sin[positions], 1, d)
    cos2, sin2 = rope.rows(positions[:2], torch.bfloat16)
    with pytest.raises(RuntimeError, match="must not overlap"):  # rows that share memory
        cpu_ext.load().rope_inplace(qkv[:1].expand(2, -1), cos2, sin2, 1, d)
    assert not rope.rotate_qk_(positions, qkv.view(T, -1, d), nh + nkv, d)  # 3-D: the PyTorch form


def test_rope_rows_are_gathered_once_per_positions_tensor_and_fp16_takes_the_pytorch_form():
    rope = RotaryEmbedding(8, 64, 10000.0)
    positions = torch.tensor([3, 1, 60])
    cos, _ = rope.rows(positions, torch.float32)
    assert rope.rows(positions, torch.float32)[0] is cos  # the next layer of the step reuses them
    assert rope.rows(positions.clone(), torch.float32)[0] is not cos
    assert torch.equal(cos, rope.cos[positions])
    qk = torch.randn(3, 16, dtype=torch.float16)
    assert not rope.rotate_qk_(positions, qk, 2, 8)  # fp16: the PyTorch form
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_ext.load().rope_inplace(torch.randn(3, 16), rope.cos[positions], rope.sin[positions], 3, 8)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of fp32's spacing at want (want computed in fp64)."""
    spacing = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return ((got.double() - want).abs() / spacing.double()).max().item()


def _norm_and_rows(rows: int, hidden: int, seed: int) -> tuple[RMSNorm, torch.Tensor, torch.Tensor]:
    """An fp32 RMSNorm with a random weight, and x [rows, hidden] (scaled by 4) and r to add to it."""
    built_cpu_ext()
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    return norm, torch.randn(rows, hidden, generator=gen) * 4, torch.randn(rows, hidden, generator=gen)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 40)])  # 40: a tail past the 16-lane vectors
def test_fused_add_rms_norm_adds_in_place_and_is_within_ulps_of_fp64(rows, hidden):
    """x += r is PyTorch's own sum bit for bit; the norm after it is within 3 ulps of fp64 (the sum of
    squares runs in another order than PyTorch's, so bits may differ) and of F.rms_norm."""
    norm, x, r = _norm_and_rows(rows, hidden, seed=3)
    want_x = x + r
    xd = want_x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    from loraplex.engine import model

    assert model._fused_ext(x, r) is cpu_ext.load()  # the kernel's path, not the fallback
    with torch.inference_mode():
        got = norm.add_norm(x, r)
        assert torch.equal(got, cpu_ext.load().add_rms_norm(want_x.clone(), torch.zeros_like(r), norm.weight, 1e-5))
    assert torch.equal(x, want_x)  # the residual stream, updated in place
    assert _ulps(got, want) <= 3, _ulps(got, want)
    assert (got - F.rms_norm(want_x, (hidden,), norm.weight, 1e-5)).abs().max() <= 4e-6 * want.abs().max()
    # the PyTorch form, where the kernel is not taken (fp16; or FUSED_ELEMENTWISE off): add, then forward
    xh, rh = x.clone().half(), r.half()
    with torch.inference_mode():
        got_h = norm.half().add_norm(xh, rh)
    assert torch.equal(got_h, hf_rms_norm(x.half() + rh, norm.weight, 1e-5))


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| of two bf16 tensors in units of bf16's spacing at want, element by element."""
    spacing = 2.0 ** (torch.frexp(want.float().abs().clamp_min(1e-30)).exponent.float() - 8)
    return (got.float() - want.float()).abs() / spacing


@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 40)])
def test_bf16_fused_add_rms_norm_rounds_where_hf_rounds(rows, hidden):
    """bf16: x += r is PyTorch's bf16 sum bit for bit; the norm equals HF's bf16 form but where the fp32
    value before a rounding differs in its last bits (the sum of squares' order): one bf16 ulp of the
    normalized value, times a weight of mantissa up to 2, so up to two of the product."""
    norm, x, r = _norm_and_rows(rows, hidden, seed=6)
    norm, x, r = norm.bfloat16(), x.bfloat16(), r.bfloat16()
    want_x = x + r
    want = hf_rms_norm(want_x, norm.weight, 1e-5)
    from loraplex.engine import model

    assert model._fused_ext(x, r) is cpu_ext.load()
    with torch.inference_mode():
        got = norm.add_norm(x, r)
    assert torch.equal(x, want_x)  # the residual stream, updated in place
    assert got.dtype == torch.bfloat16 and _bf16_ulps(got, want).max() <= 2
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (3, 24)])
def test_bf16_fused_silu_mul_rounds_where_hf_rounds(rows, inter):
    """bf16: silu rounded, then times up and rounded, as F.silu(gate) * up in bf16; exp differs from
    PyTorch's within an fp32 ulp, so an element could be one bf16 ulp off (none is on these draws; the
    gates below exp's flush point are the test after this one)."""
    built_cpu_ext()
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).bfloat16()
    gate_up[0, :4] = torch.tensor([float("nan"), 200.0, -200.0, 0.0])
    got = cpu_ext.load().silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    assert torch.isnan(got[0, 0]) and not torch.isnan(got[:, 1:]).any()
    assert torch.equal(got[0, 1:4], want[0, 1:4])
    ulps = _bf16_ulps(got, want)
    ulps[0, 0] = 0
    assert ulps.max() <= 1 and (got[:, 1:] == want[:, 1:]).float().mean() >= 0.99


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (3, 24)])
def test_fused_silu_mul_is_within_ulps_of_fp64_and_keeps_nan_and_extremes(rows, inter):
    built_cpu_ext()
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([float("nan"), 200.0, -200.0, 0.0])  # exp(-g) overflows in PyTorch's form
    got = cpu_ext.load().silu_mul(gate_up)
    g, u = gate_up.double().split(inter, dim=-1)
    want = g * torch.sigmoid(g) * u
    assert got.shape == (rows, inter) and torch.isnan(got[0, 0]) and not torch.isnan(got[:, 1:]).any()
    finite = want.isfinite()
    finite[0, 0] = False
    assert _ulps(got[finite], want[finite]) <= 4, _ulps(got[finite], want[finite])
    assert torch.equal(got[0, 1:4], (F.silu(gate_up[0, :4]) * gate_up[0, inter:inter + 4])[1:])
    with pytest.raises(RuntimeError, match="even number of columns"):
        cpu_ext.load().silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_below_exps_flush_point_is_pytorchs(dtype):
    """Gates in [-88.72, -87.3), where exp(gate) is no longer a normal float but PyTorch's
    gate / (1 + exp(-gate)) still is (about -5e-37), times an up of 1e30: PyTorch's value in the vector
    lanes as in the tail (fp32 within a few ulps, bf16 equal), and -0 below, NaN for -inf, as PyTorch."""
    built_cpu_ext()
    # bf16's own values (its spacing is 0.5 here): three in the window, one above it, two below, -inf, 0
    gates = torch.tensor([-87.5, -88.0, -88.5, -87.0, -89.0, -200.0, float("-inf"), 0.0])
    inter = 40  # columns 0-31 in the vector lanes, 32-39 in the tail
    gate_up = torch.ones(1, 2 * inter)
    gate_up[0, :8] = gates
    gate_up[0, 32:40] = gates
    gate_up[0, inter:] = 1e30
    gate_up = gate_up.to(dtype)
    got = cpu_ext.load().silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    for cols in (slice(0, 8), slice(32, 40)):
        g, w = got[0, cols], want[0, cols]
        assert torch.isnan(g[6]) and torch.isnan(w[6])  # -inf: -inf / inf
        assert torch.equal(g[4:6], w[4:6]) and (g[4:6] == 0).all() and g[7] == w[7] == 0  # -0 below, as PyTorch
        assert (w[:4] < -1e-8).all()  # the window's values (and one above it), not flushed
        if dtype == torch.bfloat16:
            assert torch.equal(g[:4], w[:4])
        else:
            assert ((g[:4] - w[:4]).abs() <= 4 * torch.finfo(torch.float32).eps * w[:4].abs()).all(), (g, w)


def test_the_model_takes_the_fused_ops_only_for_fp32_or_bf16_rows_of_one_dtype():
    from loraplex.engine import model

    built_cpu_ext()
    assert model._fused_ext(torch.randn(4, 8)) is cpu_ext.load()
    assert model._fused_ext(torch.randn(4, 8, dtype=torch.bfloat16)) is cpu_ext.load()
    assert model._fused_ext(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16)) is None
    assert model._fused_ext(torch.randn(4, 8, dtype=torch.float16)) is None
    assert model._fused_ext(torch.randn(8, 4).t()) is None  # columns not contiguous
    assert model._fused_ext(torch.randn(1, 8).expand(4, 8)) is None  # rows overlap: no in-place write there
    with pytest.raises(RuntimeError, match="must not overlap"):
        cpu_ext.load().add_rms_norm(torch.randn(1, 8).expand(4, 8), torch.randn(4, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ext.load().add_rms_norm(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        cpu_ext.load().silu_mul(torch.randn(4, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_gives_the_same_bits_whichever_loop_a_row_takes(dtype):
    """A row whose |gate| are all at most 87.3 takes silu_mul's short loop, one with a larger gate its
    general loop: on the columns the two rows share (random gates, the bound itself, tiny and zero gates,
    NaN of either sign), both give the same bits; the tail past the vectors is the same scalar code."""
    built_cpu_ext()
    gen = torch.Generator().manual_seed(9)
    inter = 1536
    gate_up = (torch.randn(2, 2 * inter, generator=gen) * 8).to(dtype)
    top = 87.3 if dtype == torch.float32 else 87.0  # the bound, or bf16's largest value under it
    specials = torch.tensor([top, -top, 87.0, -87.0, 1e-30, -1e-30, 1e-40, -1e-40, 0.0, -0.0, float("nan"),
                             -float("nan"), 50.0, -50.0])
    gate_up[:, : len(specials)] = specials.to(dtype)
    gate_up[1] = gate_up[0]
    gate_up[1, inter - 1] = 100.0  # the second row's last vector holds a gate past the bound: the general loop
    assert gate_up[0, :inter].float().abs().nan_to_num().max() <= 87.3
    got = cpu_ext.load().silu_mul(gate_up)
    bits = got.view(torch.int32 if dtype == torch.float32 else torch.int16)
    assert torch.equal(bits[0, : inter - 1], bits[1, : inter - 1])
    assert torch.isnan(got[0, 10]) and torch.isnan(got[0, 11])
