"""fp32 linears on weights packed for MKL (`kernels/cpu_gemm.py`): as close to the fp64 product as
F.linear is, the row range that takes the packed copy, and the cases where nothing is packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_ext, cpu_gemm

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None or not ext.packed_gemm_available(),
                                reason="the CPU kernels are not built, or this PyTorch has no MKL packed GEMM")


@pytest.mark.parametrize("rows", [16, 64, 100, 256])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, False), (48, 40, True)])
def test_packed_linear_is_as_exact_as_f_linear(rows, n, k, bias):
    """Against the product in fp64: no further off than F.linear (MKL blocks K its own way on the packed
    path, so the two round differently for some shapes; they agree bit for bit on others)."""
    gen = torch.Generator().manual_seed(rows + n)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    packed = ext.packed_gemm_pack(lin.weight.detach())
    with torch.no_grad():
        got = ext.packed_gemm_linear(x, packed, n, lin.bias)
        ours = F.linear(x, lin.weight, lin.bias)
        exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    err, f_err = (got.double() - exact).abs().max().item(), (ours.double() - exact).abs().max().item()
    assert err <= 2 * f_err + 1e-7, (err, f_err)
    assert got.shape == (rows, n) and got.dtype == torch.float32


def test_one_row_with_a_bias_leaves_the_bias_alone():
    lin = nn.Linear(16, 8)
    bias = lin.bias.detach().clone()
    packed = ext.packed_gemm_pack(lin.weight.detach())
    x = torch.randn(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(ext.packed_gemm_linear(x, packed, 8, lin.bias), lin(x), rtol=0, atol=1e-5)
    assert torch.equal(lin.bias.detach(), bias)


def test_a_weight_rebound_or_cast_or_an_x_of_another_width_goes_to_f_linear():
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(32, 24, bias=False)
    assert cpu_gemm.pack_linears([(lin, 8)], memory_bytes=1 << 40)
    lin.packed_weight = ext.packed_gemm_pack(torch.randn(24, 32, generator=gen))  # a stand-in: shows which path ran
    x = torch.randn(4, 32, generator=gen)
    assert not torch.allclose(cpu_gemm.linear(lin, x), lin(x))
    lin.weight = nn.Parameter(lin.weight.detach().clone())  # re-bound (as load_state_dict(assign=True) does)
    torch.testing.assert_close(cpu_gemm.linear(lin, x), lin(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        cpu_gemm.linear(lin, torch.randn(4, 16))  # F.linear's own shape error, not a silent wrong product


def test_few_rows_and_strided_rows_agree_with_f_linear():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=gen)
    packed = ext.packed_gemm_pack(w)
    for rows in (1, 2, 5, 8):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(ext.packed_gemm_linear(x, packed, 300), F.linear(x, w), rtol=0, atol=1e-5)
    wide = torch.randn(20, 100, generator=gen)
    x = wide[:, 10:74]  # rows of 64 with a stride of 100
    torch.testing.assert_close(ext.packed_gemm_linear(x, packed, 300), F.linear(x, w), rtol=0, atol=1e-5)
    assert ext.packed_gemm_linear(torch.empty(0, 64), packed, 300).shape == (0, 300)


def test_a_buffer_of_another_shape_or_dtype_is_refused():
    packed = ext.packed_gemm_pack(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="too small for an \\[49152, 576\\] weight"):
        ext.packed_gemm_linear(torch.randn(4, 576), packed, 49152)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.packed_gemm_linear(torch.randn(4, 16, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="2-D fp32"):
        ext.packed_gemm_pack(torch.randn(32, 16, dtype=torch.float64))


def test_linear_takes_the_packed_copy_only_in_its_row_range():
    """The packed copy here is of another weight, so each result shows which path ran."""
    gen = torch.Generator().manual_seed(2)
    lin = nn.Linear(32, 24, bias=False)
    other = torch.randn(24, 32, generator=gen)
    assert cpu_gemm.pack_linears([(lin, 8)], memory_bytes=1 << 40) == ext.packed_gemm_bytes(24, 32)
    lin.packed_weight = ext.packed_gemm_pack(other)
    for rows, weight in ((1, lin.weight), (2, other), (8, other), (9, lin.weight)):
        x = torch.randn(rows, 32, generator=gen)
        torch.testing.assert_close(cpu_gemm.linear(lin, x), F.linear(x, weight), rtol=0, atol=1e-5)


def test_nothing_is_packed_without_room_or_in_bf16(caplog):
    lin = nn.Linear(64, 64, bias=False)
    assert cpu_gemm.pack_linears([(lin, 256)], memory_bytes=ext.packed_gemm_bytes(64, 64)) == 0
    assert not hasattr(lin, "packed_weight")
    assert "base linears use F.linear" in caplog.text and "more than 25% of" in caplog.text
    half = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    assert cpu_gemm.pack_linears([(half, 256)], memory_bytes=1 << 40) == 0
    assert not hasattr(half, "packed_weight")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_gemm.linear(half, x), half(x))


def test_the_engine_packs_its_base_linears_and_the_switch_turns_it_off(monkeypatch):
    """(Available memory is stood in for: the packed copies of these shapes need about 2 GiB, which a
    small runner may not have free; the refusal itself is tested above.)"""
    from loraplex.engine.llm_engine import LLMEngine

    monkeypatch.setattr("loraplex.engine.llm_engine.available_memory_bytes", lambda: 1 << 40)

    engine = LLMEngine("smollm2-135m-shapes", load_format="dummy", dtype="float32", max_loras=1)
    layer = engine.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.packed_max_rows == (256 if ext.avx512_available() else 64) and lin.packed_weight.dtype == torch.uint8
    assert engine.model.lm_head.packed_max_rows == cpu_gemm.LM_HEAD_MAX_ROWS
    monkeypatch.setattr(cpu_gemm, "enabled", False)
    off = LLMEngine("smollm2-135m-shapes", load_format="dummy", dtype="float32", max_loras=1)
    assert not hasattr(off.model.layers[0].self_attn.qkv_proj, "packed_weight")
