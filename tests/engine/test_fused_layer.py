"""A decoder layer in one call of the compiled kernel (`DecoderLayer._one_call`, kernels/csrc/layer_cpu.cpp):
the same bits as the Python layer, hidden states and KV cache alike, on a step of decodes and prefill
chunks; and the Python path wherever one of its pieces would not run compiled."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import model as model_mod
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.sampling_params import SamplingParams
from loraplex.kernels import cpu_ext, cpu_gemm
from tests.helpers import built_cpu_ext


class _Counting:
    """The extension module, counting its decoder_layer calls."""

    def __init__(self, ext):
        self.ext, self.calls = ext, 0

    def __getattr__(self, name):
        fn = getattr(self.ext, name)
        if name != "decoder_layer":
            return fn

        def counted(*args):
            self.calls += 1
            return fn(*args)
        return counted


@pytest.fixture
def engine(monkeypatch):
    ext = built_cpu_ext()
    if not (ext.avx2_available() or ext.avx512_available()):
        pytest.skip("our packed GEMM needs AVX2 + FMA or AVX-512")
    monkeypatch.setattr("loraplex.engine.llm_engine.available_memory_bytes", lambda: 1 << 40)
    monkeypatch.setattr(cpu_gemm, "backend", "auto")
    return LLMEngine("smollm2-135m-shapes", load_format="dummy", dtype="float32", max_loras=1, max_num_seqs=8,
                     enable_prefix_caching=False)


def _mixed_step(engine: LLMEngine):
    """A scheduled step with two decodes and a prefill chunk, prepared: (input_ids, positions, attn, lora)."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for n in (37, 5):
        engine.add_request(torch.randint(0, 49152, (n,), generator=gen).tolist(), params)
    engine.step()  # both prefilled; next step decodes them
    engine.add_request(torch.randint(0, 49152, (70,), generator=gen).tolist(), params)
    sched = engine.scheduler.schedule()
    input_ids, positions, attn, lora, _, _, _ = engine.runner.prepare(sched, engine.adapters.slot_ranks)
    assert attn.num_decode_tokens == 2 and len(attn.prefills) == 1 and lora is None
    return input_ids, positions, attn


def _forward(engine, input_ids, positions, attn, monkeypatch, fused: bool):
    """(hidden [T, H], the step's K and V slots of every layer) of one forward, FUSED_LAYER as given;
    the count of decoder_layer calls."""
    counting = _Counting(cpu_ext.load())
    monkeypatch.setattr(cpu_ext, "_module", counting)
    monkeypatch.setattr(model_mod, "FUSED_LAYER", fused)
    kv = engine.runner.kv_caches
    for k, v in kv:  # the slots this step writes, cleared, so each forward's writes are its own
        k[attn.slot_mapping] = float("nan")
        v[attn.slot_mapping] = float("nan")
    hidden = engine.model(input_ids, positions, kv, attn, None)
    slots = [(k[attn.slot_mapping].clone(), v[attn.slot_mapping].clone()) for k, v in kv]
    monkeypatch.setattr(cpu_ext, "_module", counting.ext)
    return hidden, slots, counting.calls


def test_one_call_per_layer_gives_the_python_layers_bits(engine, monkeypatch):
    input_ids, positions, attn = _mixed_step(engine)
    layers = len(engine.model.layers)
    fused, fused_kv, calls = _forward(engine, input_ids, positions, attn, monkeypatch, True)
    plain, plain_kv, none = _forward(engine, input_ids, positions, attn, monkeypatch, False)
    assert (calls, none) == (layers, 0)
    assert torch.equal(fused, plain) and fused.isfinite().all()
    for (fk, fv), (pk, pv) in zip(fused_kv, plain_kv, strict=True):
        assert torch.equal(fk, pk) and torch.equal(fv, pv) and fk.isfinite().all()


def test_a_layer_whose_piece_would_not_run_compiled_takes_the_python_path(engine, monkeypatch):
    """A linear that dropped its packed copy (after a failed call), a weight re-bound since packing, or a
    row count out of the packed copies' range: that layer goes through Python, the others stay fused, and
    the result is the Python layers' bits. A norm's weight re-bound or its eps changed after the layer's
    first fused call: it stays fused, with the new values."""
    input_ids, positions, attn = _mixed_step(engine)  # every layer has made its plan in the step before
    layers = engine.model.layers
    with torch.no_grad():
        layers[3].post_attention_layernorm.weight = torch.nn.Parameter(layers[3].post_attention_layernorm.weight * 3)
    layers[4].input_layernorm.eps = 0.5  # layer 3's next norm
    plain, _, _ = _forward(engine, input_ids, positions, attn, monkeypatch, False)
    got, _, calls = _forward(engine, input_ids, positions, attn, monkeypatch, True)
    assert calls == len(layers) and torch.equal(got, plain)

    cpu_gemm._drop_packed(layers[1].self_attn.o_proj, input_ids[:, None].float(), RuntimeError("test"))
    with torch.no_grad():  # the same values in a new tensor: the packed copy no longer is this weight's
        layers[2].mlp.down_proj.weight = torch.nn.Parameter(layers[2].mlp.down_proj.weight.clone())
    plain, plain_kv, _ = _forward(engine, input_ids, positions, attn, monkeypatch, False)
    got, got_kv, calls = _forward(engine, input_ids, positions, attn, monkeypatch, True)
    assert calls == len(layers) - 2
    assert torch.equal(got, plain)
    assert all(torch.equal(a, b) for pair, other in zip(got_kv, plain_kv, strict=True) for a, b in zip(pair, other, strict=True))

    for layer in layers:  # more rows than the packed copies take
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if getattr(lin, "packed_rows", None) is not None:
                monkeypatch.setattr(lin, "packed_rows", (1, len(input_ids) - 1))
    monkeypatch.setattr(cpu_gemm, "generation", cpu_gemm.generation + 1)  # what changes packed_rows bumps it
    _, _, calls = _forward(engine, input_ids, positions, attn, monkeypatch, True)
    assert calls == 0
