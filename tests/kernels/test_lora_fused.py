"""`lora_linear` with the shrink fused into the base GEMM (CPU packed path), against the dense truth."""

import pytest
import torch
from lora_cases import DEVICE, assert_matches, make_case

from loraplex.kernels import LoRAWeights, attach_fused_shrink, lora_linear, lora_ops
from loraplex.kernels.cpu_packed import fused_shrink_of

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the fused shrink is the CPU path (slot mirrors)")


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.setattr(lora_ops, "_backend", "auto")


def _fused_case(num_tokens, popularity, num_adapters, dtype, page, h_outs=(80, 24, 24), bias=True, seed=0):
    """A case whose base output comes from a real nn.Linear (finite x on every row), with the shrink
    room attached; returns (case, linear, base output before the attach)."""
    case = make_case(num_tokens, popularity, num_adapters, dtype, 96, list(h_outs), "zero", seed=seed, page=page)
    case.x[torch.isnan(case.x)] = 0.5  # rows without an adapter: finite, they go through the GEMM too
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(96, sum(h_outs), bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / 10)
        if bias:
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen))
    base = linear(case.x).detach()
    attach_fused_shrink(linear, case.slices)
    return case, linear, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page", [0, 8])
@pytest.mark.parametrize("popularity", ["identical", "skewed", "uniform", "zipf"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_fused_shrink_matches_dense(dtype, page, popularity, num_tokens):
    case, linear, base = _fused_case(num_tokens, popularity, 3, dtype, page, seed=num_tokens)
    fs, w = fused_shrink_of(linear), case.slices[0]
    out = lora_linear(case.x, linear, case.slices, case.meta)
    pages = sum(-(-case.meta.slot_ranks[s] // w.page) for s in case.meta.seg_slots_list)
    packed = lora_ops._pick_backend(case.x, case.meta, case.slices) == "packed"
    assert (fs.key is not None) == (packed and pages <= fs.cap_pages)  # in the GEMM when packed and it fits
    assert_matches(out, case, base)
    assert torch.equal(linear(case.x), base)  # the module alone computes what it did before the attach


def test_single_slice_without_bias():
    case, linear, base = _fused_case(40, "skewed", 2, torch.bfloat16, 8, h_outs=(80,), bias=False, seed=3)
    out = lora_linear(case.x, linear, case.slices, case.meta)
    assert fused_shrink_of(linear).key is not None
    assert_matches(out, case, base)


def test_rows_rewritten_after_a_slot_write():
    """A new adapter written into an active slot between steps: the rows under the weight follow it."""
    case, linear, base = _fused_case(24, "uniform", 3, torch.float32, 8, seed=5)
    assert_matches(lora_linear(case.x, linear, case.slices, case.meta), case, base)
    slot = case.meta.seg_slots_list[0]
    gen = torch.Generator().manual_seed(9)
    for w in case.slices:
        r = w.ranks_list[slot]
        w.set_slot(slot, torch.randn(r, 96, generator=gen), torch.randn(w.B.shape[1], r, generator=gen), 0.75)
    assert_matches(lora_linear(case.x, linear, case.slices, case.meta), case, base)


def test_more_pages_than_the_room_falls_back(monkeypatch):
    """Active adapters needing more rank rows than the room under the weight: the unfused path, same values."""
    case, linear, base = _fused_case(64, "uniform", 12, torch.float32, 8, seed=6)
    fs = fused_shrink_of(linear)
    monkeypatch.setattr(fs, "cap_pages", 2)
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS_16BIT", (1024, 1 << 20))  # fp32 with the BGMV kernel: packed too
    assert lora_ops._pick_backend(case.x, case.meta, case.slices) == "packed"
    out = lora_linear(case.x, linear, case.slices, case.meta)
    assert fs.key is None
    assert_matches(out, case, base)


def test_bgmv_and_forced_backends_are_not_fused(monkeypatch):
    case, linear, base = _fused_case(64, "uniform", 12, torch.bfloat16, 8, seed=7)
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS_16BIT", (8, 1 << 20))  # 12 adapters: the bgmv path
    assert_matches(lora_linear(case.x, linear, case.slices, case.meta), case, base)
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS_16BIT", (1024, 1 << 20))
    monkeypatch.setattr(lora_ops, "_backend", "packed")
    assert_matches(lora_linear(case.x, linear, case.slices, case.meta), case, base)
    assert fused_shrink_of(linear).key is None


def test_attach_refuses_a_linear_of_other_shape():
    w = LoRAWeights.empty(2, 8, 16, 24, torch.float32, "cpu")
    with pytest.raises(ValueError, match="cannot fuse a shrink into a linear of weight"):
        attach_fused_shrink(torch.nn.Linear(16, 32), [w])


def test_a_slice_the_adapters_leave_alone():
    """Adapters with rank 0 in the middle slice (k_proj untargeted): its columns stay the base output."""
    case, linear, base = _fused_case(33, "uniform", 3, torch.float32, 8, seed=8)
    for s in case.meta.seg_slots_list:
        case.slices[1].set_slot(s, None, None, 0.0)
    out = lora_linear(case.x, linear, case.slices, case.meta)
    assert fused_shrink_of(linear).key is not None
    assert_matches(out, case, base)
    assert torch.equal(out[:, 80:104], base[:, 80:104])


def test_widths_not_a_multiple_of_16_stay_unfused():
    """An output width whose fp32 GEMM is not bit-stable with extra rows: nothing is attached."""
    w = LoRAWeights.empty(2, 8, 16, 75, torch.float32, "cpu")
    linear = torch.nn.Linear(16, 75)
    weight = linear.weight
    assert attach_fused_shrink(linear, [w]) is None and fused_shrink_of(linear) is None and linear.weight is weight


def test_a_weight_rebound_after_the_attach_is_refused():
    case, linear, _ = _fused_case(24, "uniform", 3, torch.float32, 8, seed=5)
    lora_linear(case.x, linear, case.slices, case.meta)
    assert fused_shrink_of(linear).key is not None
    linear.load_state_dict({k: v.clone() for k, v in linear.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match="re-bound after attach_fused_shrink"):
        lora_linear(case.x, linear, case.slices, case.meta)


@pytest.mark.parametrize(("name", "dtype"), [("onednn", torch.float32), ("onednn", torch.bfloat16),
                                             ("avx2", torch.float32), ("avx512", torch.float32)])
@pytest.mark.parametrize("num_tokens", [1, 7, 24])
def test_fused_shrink_over_a_packed_base(name, dtype, num_tokens, monkeypatch):
    """With the base weight packed (for oneDNN, or for our AVX2 or AVX-512 GEMM) the base GEMM runs on the
    packed copy and the shrink rows apart (`cpu_gemm`): the same values to rounding."""
    from loraplex.kernels import cpu_ext, cpu_gemm

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN")
    if dtype == torch.bfloat16 and not cpu_gemm.ONEDNN_BF16:
        pytest.skip("this CPU has no oneDNN bf16 kernels, so bf16 weights are not packed")
    if name == "onednn" and dtype == torch.float32 and num_tokens == 1:
        pytest.skip("oneDNN's fp32 decoder range starts at 2 rows")
    ext = cpu_ext.load()
    if name == "avx2" and (ext is None or not ext.avx2_available()):
        pytest.skip("the CPU kernels are not built, or this CPU has no AVX2 + FMA")
    if name == "avx512" and (ext is None or not ext.avx512_available()):
        pytest.skip("the CPU kernels are not built, or this CPU has no AVX-512")
    monkeypatch.setattr(cpu_gemm, "backend", name)
    case, linear, base = _fused_case(num_tokens, "uniform", 3, dtype, 8, seed=11)
    assert cpu_gemm.pack_linears([(linear, "decoder")], memory_bytes=1 << 40, name=name)
    assert linear.packed_backend == name and cpu_gemm.takes_packed(linear, case.x)
    with torch.no_grad():  # rows without an adapter: the packed GEMM's bits (ours round unlike F.linear's)
        base = cpu_gemm.linear(linear, case.x)
    packed_calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda m, x: packed_calls.append(x.shape[0]) or real(m, x))
    out = lora_linear(case.x, linear, case.slices, case.meta)
    fs = fused_shrink_of(linear)
    assert fs.key is not None and packed_calls == [num_tokens]  # the base GEMM ran on the packed copy
    assert (fs.expand_t is not None) == (dtype == torch.float32)  # oneDNN's expand: fp32 only
    assert_matches(out, case, base)
