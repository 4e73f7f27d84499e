"""The decoder's elementwise ops against Hugging Face's forms: fp32 RMSNorm through `F.rms_norm` and
RoPE rotated in place by the compiled kernel give the same bits as the four-op PyTorch expressions that
LlamaForCausalLM uses; other dtypes keep those expressions."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model import RMSNorm, RotaryEmbedding, _rotate_half
from loraplex.kernels import cpu_ext


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
    if cpu_ext.load() is None:
        pytest.fail("the CPU kernels must build here (CI has a compiler)")
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


def test_rope_rows_are_gathered_once_per_positions_tensor_and_bf16_takes_the_pytorch_form():
    rope = RotaryEmbedding(8, 64, 10000.0)
    positions = torch.tensor([3, 1, 60])
    cos, _ = rope.rows(positions, torch.float32)
    assert rope.rows(positions, torch.float32)[0] is cos  # the next layer of the step reuses them
    assert rope.rows(positions.clone(), torch.float32)[0] is not cos
    assert torch.equal(cos, rope.cos[positions])
    qk = torch.randn(3, 16, dtype=torch.bfloat16)
    assert not rope.rotate_qk_(positions, qk, 2, 8)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_ext.load().rope_inplace(torch.randn(3, 16), rope.cos[positions], rope.sin[positions], 3, 8)
