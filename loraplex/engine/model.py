"""Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch over a flattened, ragged batch.

Letters: T tokens in the step (prefill chunks and decodes of many requests, no padding), H hidden,
I intermediate, D head dim, V vocab, L layers.

q/k/v and gate/up are fused into one matmul each (fewer, larger GEMMs); LoRA goes with each base
projection, one adapter per row, through `loraplex.kernels.lora_linear` (on CPU the shrink of some
adapters runs inside the base GEMM; elsewhere the base projection then `add_lora`). Numerics follow
Hugging Face's LlamaForCausalLM (RMSNorm in fp32, RoPE cos/sin in fp32, rotate-half layout), which is
what the parity tests compare against. In fp32 or bf16 on a CPU each residual add runs with the RMSNorm
after it, and SiLU with the multiply by up, in one pass of the compiled kernel (fp32: within a few ulps of
HF's ops; bf16: HF's roundings, with rare flips).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine import attention
from loraplex.engine.attention import AttentionMetadata, paged_attention
from loraplex.kernels import LoRAMeta, LoRAWeights, base_linear, cpu_ext, cpu_gemm, cpu_greedy, lora_linear
from loraplex.kernels.cpu_gemm import OURS, packed_current, silu_mul_linear
from loraplex.model_config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (as HF LlamaRMSNorm).

    fp32 takes PyTorch's fused `F.rms_norm`, whose result equals HF's four-op form bit for bit (tested)
    in one pass instead of four; other dtypes keep HF's form (normalize in fp32, round, then weight)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """x += r in place (x is the residual stream), then this norm of x: x, r [T, H] -> [T, H].

        fp32 or bf16 on a CPU takes the compiled kernel (`kernels/csrc/norm_act_cpu.cpp`), the add and the
        norm in one pass over each row, where PyTorch runs the add and six ops of F.rms_norm (bf16: eight,
        HF's form); its sum of squares runs in another order, so it is within a few fp32 ulps of HF's form,
        not always its bits (bf16: rarely, up to two bf16 ulps; vLLM's fused_add_rms_norm likewise).
        Elsewhere, or where the kernel is not built (`cpu_ext` logs why), the add and then `forward`."""
        w = self.weight
        ext = _fused_ext(x, r) if w.dtype == x.dtype and w.device.type == "cpu" and w.is_contiguous() else None
        if ext is not None:
            return ext.add_rms_norm(x, r, self.weight, self.eps)
        x += r
        return self(x)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., arXiv:2104.09864) in HF's rotate-half layout; cos/sin cached in fp32.

    The rows of a step's positions are gathered once per step and shared by every layer (the layers get
    the same `positions` tensor). fp32 or bf16 q/k on a CPU are rotated in place by the compiled kernel
    (`kernels/csrc/rope_cpu.cpp`, equal to the PyTorch form bit for bit); elsewhere, or where the kernel
    is not built, by PyTorch ops."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._rows: tuple | None = None  # (positions, dtype, cos [T, D], sin [T, D]) of the current step

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D] in `dtype` at `positions` [T]; gathered once for the same positions tensor."""
        cached = self._rows
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            cached = self._rows = (positions, dtype, self.cos[positions].to(dtype), self.sin[positions].to(dtype))
        return cached[2], cached[3]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, nH, D]; k [T, nKV, D] -> rotated (q, k), new tensors."""
        cos, sin = self.rows(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate_qk_(self, positions: torch.Tensor, qk: torch.Tensor, heads: int, head_dim: int) -> bool:
        """Rotate the first `heads` heads of each row of qk [T, >= heads x D] (q's then k's columns of a
        qkv output) in place, if the compiled kernel takes it (fp32 or bf16 on a CPU); False when it does
        not and the caller should use `forward`."""
        if qk.dtype not in FUSED_DTYPES or qk.device.type != "cpu" or qk.dim() != 2 or qk.stride(-1) != 1:
            return False
        ext = cpu_ext.load()
        if ext is None:
            return False
        cos, sin = self.rows(positions, qk.dtype)
        ext.rope_inplace(qk, cos, sin, heads, head_dim)
        return True


FUSED_ELEMENTWISE = True  # residual add + RMSNorm and SiLU x up on the compiled kernel where it runs
FUSED_LAYER = True  # a whole decoder layer in one call of the compiled kernel where every piece runs there
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled RoPE, add + RMSNorm and SiLU x up take


def _fused_ext(*tensors: torch.Tensor):
    """The compiled CPU module if the fused elementwise kernels take these tensors (2-D CPU tensors of one
    dtype, fp32 or bf16, with contiguous, non-overlapping rows; FUSED_ELEMENTWISE on; the kernels built),
    else None."""
    if not FUSED_ELEMENTWISE or tensors[0].dtype not in FUSED_DTYPES or any(
            t.dtype != tensors[0].dtype or t.device.type != "cpu" or t.dim() != 2
            or t.stride(-1) != 1 or t.stride(0) < t.shape[1] for t in tensors):
        return None
    return cpu_ext.load()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """GQA self-attention reading and writing the paged KV cache."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.lora: dict[str, LoRAWeights] = {}

    def forward(self, x, positions, kv_cache, attn: AttentionMetadata, lora: LoRAMeta | None,
                rows: torch.Tensor | None = None, rows_lora: LoRAMeta | None = None):
        """x [T, H]; positions [T]; kv_cache (k, v) each [num_slots, nKV, D] -> [T, H], or with rows [B]
        (indices into the T rows) those rows' outputs alone [B, H], every row's K/V written all the same;
        rows_lora: their `LoRAMeta` (None without adapters). With rows, where the compiled CPU kernels take
        the step (`_rows_only`: fp32 or bf16 on a CPU), the other rows' attention and o_proj are not
        computed, nor their queries where our GEMM packed q/k/v and no q/k/v adapter is loaded."""
        if rows is not None:
            o = self._rows_only(x, positions, kv_cache, attn, lora, rows)
            if o is None:
                return self.forward(x, positions, kv_cache, attn, lora)[rows]
            return self._o_proj(o, rows_lora)
        cfg = self.cfg
        qkv = self._qkv_proj(x, lora)  # [T, q + 2 kv]
        rotated = self.rope.rotate_qk_(positions, qkv, cfg.num_attention_heads + cfg.num_key_value_heads, cfg.head_dim)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_key_value_heads, cfg.head_dim)
        if not rotated:
            q, k = self.rope(positions, q, k)
        o = paged_attention(q, k, v, kv_cache, attn).reshape(-1, cfg.q_size)  # [T, nH * D]
        return self._o_proj(o, lora)

    def _qkv_proj(self, x: torch.Tensor, lora: LoRAMeta | None) -> torch.Tensor:
        """The fused q/k/v projection x [T, H] -> [T, q + 2 kv], with the rows' q/k/v adapters."""
        if lora is not None and "q_proj" in self.lora:
            return lora_linear(x, self.qkv_proj, [self.lora["q_proj"], self.lora["k_proj"], self.lora["v_proj"]], lora)
        return base_linear(self.qkv_proj, x)

    def _o_proj(self, o: torch.Tensor, lora: LoRAMeta | None) -> torch.Tensor:
        """o_proj o [T, nH x D] -> [T, H], with the rows' o_proj adapters."""
        if lora is not None and "o_proj" in self.lora:
            return lora_linear(o, self.o_proj, [self.lora["o_proj"]], lora)
        return base_linear(self.o_proj, o)

    def _rows_only(self, x, positions, kv_cache, attn: AttentionMetadata, lora: LoRAMeta | None,
                   rows: torch.Tensor) -> torch.Tensor | None:
        """The attention output [B, nH x D] of the rows `rows` [B] alone, before o_proj, or None where the
        compiled CPU kernels do not take this step (not a CPU step, a dtype other than fp32 or bf16, shapes
        the attention kernel refuses; decided before any work): then the caller runs every row. The k and
        v columns of the q/k/v projection for every row and its q columns for these rows only where our
        GEMM packed it (`cpu_gemm.linear_columns`; else, or with q/k/v adapters, the whole projection and
        then these rows' q), RoPE, every row's K/V written and these rows' queries attending
        (`paged_attention_rows`). llama.cpp's last layer likewise keeps only the rows whose output is used
        (`inp_out_ids`). Each row's value is its row of `forward`'s to the dtype's rounding (the attention
        sums in another order for a prefill row)."""
        cfg = self.cfg
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ext = attention.rows_kernel(x.device, heads, kv_heads, dim)
        if x.dtype not in FUSED_DTYPES or ext is None:
            return None
        q = kv = None
        if lora is None or "q_proj" not in self.lora:
            kv = cpu_gemm.linear_columns(self.qkv_proj, x, cfg.q_size, cfg.q_size + 2 * cfg.kv_size)  # [T, 2 kv]
            if kv is not None:
                q = cpu_gemm.linear_columns(self.qkv_proj, x[rows], 0, cfg.q_size) if len(rows) else \
                    x.new_empty((0, cfg.q_size))  # [B, q]
        if q is None or kv is None:
            qkv = self._qkv_proj(x, lora)  # [T, q + 2 kv]
            q, kv = qkv[rows, : cfg.q_size], qkv[:, cfg.q_size:]
        cos, sin = self.rope.rows(positions, x.dtype)  # [T, D]
        ext.rope_inplace(kv, cos, sin, kv_heads, dim)  # k's heads come first in kv's columns
        if len(rows):
            ext.rope_inplace(q, cos[rows], sin[rows], heads, dim)
        k = kv[:, : cfg.kv_size].view(-1, kv_heads, dim)
        v = kv[:, cfg.kv_size:].view(-1, kv_heads, dim)
        out = attention.paged_attention_rows(q.view(-1, heads, dim), rows.tolist(), k, v, kv_cache, attn)
        return out.view(-1, cfg.q_size)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.lora: dict[str, LoRAWeights] = {}

    def forward(self, x: torch.Tensor, lora: LoRAMeta | None) -> torch.Tensor:  # [T, H] -> [T, H]
        if lora is not None and "gate_proj" in self.lora:
            h = self._silu_mul(lora_linear(x, self.gate_up_proj, [self.lora["gate_proj"], self.lora["up_proj"]], lora))
        else:
            # [T, I] from the GEMM itself where our packed GEMM takes x (kernels/cpu_gemm.py), else in two steps
            h = silu_mul_linear(self.gate_up_proj, x) if FUSED_ELEMENTWISE else None
            if h is None:
                h = self._silu_mul(base_linear(self.gate_up_proj, x))
        if lora is not None and "down_proj" in self.lora:
            return lora_linear(h, self.down_proj, [self.lora["down_proj"]], lora)
        return base_linear(self.down_proj, h)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        ext = _fused_ext(gate_up)
        if ext is not None:
            return ext.silu_mul(gate_up)  # one pass (kernels/csrc/norm_act_cpu.cpp)
        gate, up = gate_up.split(self.inter, dim=-1)
        return F.silu(gate).mul_(up)  # in place on silu's output: one pass and one buffer fewer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, h, positions, kv_cache, attn, lora, next_norm: RMSNorm, rows=None, rows_lora=None):
        """x [T, H] the residual stream (updated in place), h [T, H] = input_layernorm(x) -> next_norm(x)
        after this layer [T, H]: each residual add goes with the norm after it (vLLM's layers pass the
        residual the same way), so the next layer's input norm (or the final norm) is applied here.

        rows [B] (optional): only these rows go on after attention (every row's K/V is still written;
        where `Attention._rows_only` runs, only these rows' attention is computed), on a copy of theirs of
        x (x itself is then left as it was), and the result is [B, H]; rows_lora is their `LoRAMeta` (None
        without adapters).

        Without adapters or rows, where every kernel below would run compiled on fp32 (`_one_call`), the
        layer is one call of the extension: the same kernels in the same order, the same bits."""
        if rows is None and lora is None and FUSED_LAYER:
            out = self._one_call(x, h, positions, kv_cache, attn, next_norm)
            if out is not None:
                return out
        if rows is not None:
            a = self.self_attn(h, positions, kv_cache, attn, lora, rows, rows_lora)  # [B, H]
            x, lora = x[rows], rows_lora  # [B, H]
            if not len(rows):
                return x
        else:
            a = self.self_attn(h, positions, kv_cache, attn, lora)  # [T, H]
        h = self.post_attention_layernorm.add_norm(x, a)
        return next_norm.add_norm(x, self.mlp(h, lora))

    def _one_call(self, x, h, positions, kv_cache, attn: AttentionMetadata, next_norm: RMSNorm):
        """`forward` without adapters or rows, as one call of `decoder_layer` (kernels/csrc/layer_cpu.cpp),
        or None where the Python path would take another kernel for any piece: then it runs as before.

        The call takes what the Python path would: the four projections on our packed fp32 GEMM (each
        weight still the one packed, T in its row range), RoPE, add + RMSNorm and SiLU x up on the
        compiled kernels, attention on the kernel's vector loops. The checks that stay fixed while the
        weights do are made once and kept (`_LayerPlan`, made again when a module gains or drops a packed
        copy, or a norm's weight or eps or the q/k/v bias is no longer the one kept); per call, the
        linears' weights are checked again, so a weight re-bound since packing sends the layer back to
        the Python path. Unlike `cpu_gemm.linear`, a GEMM that raises is not retried on F.linear: the
        plan holds exactly the conditions under which gemm_linear's own checks pass, and the residual
        stream may already have been added to in place."""
        plan = self.__dict__.get("_plan")
        if (plan is None or plan.next_norm is not next_norm or plan.generation != cpu_gemm.generation
                or not plan.current()):
            plan = self._plan = self._make_plan(next_norm)
        if (plan.args is None or not FUSED_ELEMENTWISE or not attention.PREFILL_KERNEL or x.dtype != torch.float32
                or kv_cache[0].dtype != torch.float32 or not plan.min_rows <= x.shape[0] <= plan.max_rows):
            return None
        for module, ptr in zip(plan.linears, plan.weights, strict=True):
            if module._parameters["weight"].data_ptr() != ptr:
                return None
        qkv_w, qkv_b, o_w, gu_w, down_w, isa, inter, heads, kv_heads, dim, post_w, post_eps, next_w, next_eps = plan.args
        cos, sin = plan.rope.rows(positions, torch.float32)
        return cpu_ext.load().decoder_layer(
            x, h, qkv_w, qkv_b, o_w, gu_w, down_w, isa, inter, cos, sin, heads, kv_heads, dim, kv_cache[0],
            kv_cache[1], attn.block_tables, attn.tiles(heads // kv_heads), attn.block_size, attn.slot_mapping,
            post_w, post_eps, next_w, next_eps)

    def _make_plan(self, next_norm: RMSNorm) -> _LayerPlan:
        """What `_one_call` checks once for this layer and `next_norm` (args None where it cannot run)."""
        cfg, ext = self.self_attn.cfg, cpu_ext.load()
        linears = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        norms = (self.post_attention_layernorm, next_norm)
        ok = (ext is not None and hasattr(ext, "decoder_layer")
              and all(packed_current(m) and m.packed_backend == linears[0].packed_backend in OURS
                      and m.weight.dtype == torch.float32 for m in linears)
              and [m.packed_glu for m in linears] == [0, 0, self.mlp.inter, 0]
              and all(m.bias is None for m in linears[1:])
              and all(n.weight.dtype == torch.float32 and n.weight.device.type == "cpu" and n.weight.is_contiguous()
                      for n in norms)
              and attention.vector_loops(torch.float32, cfg.head_dim)
              and cfg.num_attention_heads // cfg.num_key_value_heads <= attention.MAX_QUERIES_PER_TILE)
        if not ok:
            return _LayerPlan(next_norm, cpu_gemm.generation, 0, -1, (), (), None, None, norms[0])
        qkv, o, gate_up, down = linears
        args = (qkv.packed_weight, qkv.bias, o.packed_weight, gate_up.packed_weight, down.packed_weight,
                qkv.packed_backend, self.mlp.inter, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                norms[0].weight, norms[0].eps, next_norm.weight, next_norm.eps)
        return _LayerPlan(next_norm, cpu_gemm.generation, max(m.packed_rows[0] for m in linears),
                          min(m.packed_rows[1] for m in linears), linears, tuple(m.packed_of[0] for m in linears),
                          self.self_attn.rope, args, norms[0])


class _LayerPlan(NamedTuple):
    """`DecoderLayer._one_call`'s checks made once: for this next norm and packing generation, the rows
    the packed copies take, the four linears (q/k/v, o, gate/up, down) and the data pointers of the
    weights packed, the RoPE module, decoder_layer's arguments (None: the layer stays in Python), and the
    post-attention norm."""

    next_norm: RMSNorm
    generation: int
    min_rows: int
    max_rows: int
    linears: tuple
    weights: tuple
    rope: RotaryEmbedding | None
    args: tuple | None
    post_norm: RMSNorm

    def current(self) -> bool:
        """Whether the norms' weights and eps and the q/k/v bias kept in `args` are still the modules' own
        (the Python path reads them live; a re-bound one makes the plan again)."""
        if self.args is None:
            return True
        bias, post_w, post_eps, next_w, next_eps = self.args[1], *self.args[10:]
        return (self.post_norm._parameters["weight"] is post_w and self.post_norm.eps == post_eps
                and self.next_norm._parameters["weight"] is next_w and self.next_norm.eps == next_eps
                and self.linears[0]._parameters.get("bias") is bias)


class LlamaModel(nn.Module):
    """Embedding, L decoder layers, final norm and lm_head (tied to the embedding when configured)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def build(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
        """An uninitialised model on `device` (parameters hold garbage until weights are loaded).

        Built on the meta device first, so no time goes into random initialisation of large shapes.
        """
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        if cfg.tie_word_embeddings:  # to_empty breaks the tie
            model.lm_head.weight = model.embed_tokens.weight
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta).to(device)
        for layer in model.layers:
            layer.self_attn.rope = rope
        return model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                attn: AttentionMetadata, lora: LoRAMeta | None = None,
                out_rows: torch.Tensor | None = None, out_lora: LoRAMeta | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, H], or [B, H] of the rows out_rows [B]
        (int64 indices into the T rows) alone; out_lora: those rows' `LoRAMeta` where lora is given
        (default `lora.select` of them, which reads out_rows back to the host).

        With out_rows, the last layer's MLP and norms run on those rows only (the rows a step samples), and
        on fp32 or bf16 CPU steps also its attention and o_proj, and its queries where our GEMM packed
        q/k/v (`Attention._rows_only`): no later layer reads the other rows, and every layer's K/V is still
        written. llama.cpp skips the same work for the tokens whose output is not used (`inp_out_ids`). A
        prefill chunk of n tokens then costs about 9/10 of one layer less for its n - 1 first tokens. Each
        row's values are those of the full forward to the dtype's rounding (a sampled prefill row attends
        through the decode loop, which sums in another order; tested)."""
        x = self.embed_tokens(input_ids)  # [T, H], the residual stream
        if not self.layers:
            return self.norm(x) if out_rows is None else self.norm(x[out_rows])
        h = self.layers[0].input_layernorm(x)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        last = len(self.layers) - 1
        for i, (layer, kv_cache, next_norm) in enumerate(zip(self.layers, kv_caches, next_norms, strict=True)):
            if i == last and out_rows is not None:
                if lora is not None and out_lora is None:
                    out_lora = lora.select(out_rows.tolist())
                h = layer(x, h, positions, kv_cache, attn, lora, next_norm, out_rows, out_lora)
            else:
                h = layer(x, h, positions, kv_cache, attn, lora, next_norm)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> fp32 logits [B, V]."""
        return base_linear(self.lm_head, hidden).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """hidden [B, H] -> each row's `compute_logits(hidden)[b].max(-1).indices`, found without the logits
        (kernels/cpu_greedy.py: a bf16 screen, then the few tokens it cannot rule out in exact fp32), or -1
        for a row it leaves to the logits; None where that path does not run."""
        out = cpu_greedy.greedy_tokens(self.lm_head, hidden)
        return None if out is None else out[0]

    def load_hf_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the fused parameters.

        Raises ValueError for a missing or unexpected tensor, or a shape that does not fit.
        """
        cfg = self.cfg
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", cfg.q_size),
                 "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", cfg.intermediate_size)}
        filled: dict[str, int] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.") if not name.startswith("lm_head") else name
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, offset = name, None
            for hf, (ours, off) in fused.items():
                if f".{hf}." in name:
                    target, offset = name.replace(hf, ours), off
            if target not in params:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"unexpected weight {name!r} for a {cfg.model_type} model")
            param = params[target].data
            dst = param if offset is None else param[offset:offset + tensor.shape[0]]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled[target] = filled.get(target, 0) + tensor.shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
