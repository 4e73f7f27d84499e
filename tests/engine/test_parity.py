"""Token-for-token parity with Hugging Face transformers + PEFT on the real default model (fp32).

Five adapters that differ in rank, alpha, rslora, rank/alpha patterns, layer selection and target
modules run together in ONE mixed batch with base-only rows; each row must equal what PEFT itself
generates for that adapter alone.
"""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.adapters.synthetic import randomize_lora_weights
from loraplex.engine import attention
from loraplex.kernels import cpu_gemm
from tests.helpers import chat_ids, peft_generate

MAX_NEW = 12

ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-linear-rslora-r16": dict(r=16, lora_alpha=32, target_modules="all-linear", use_rslora=True),
    "attn-patterns-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             rank_pattern={"o_proj": 12}, alpha_pattern={"layers.3.self_attn.k_proj": 40}),
    "mlp-regex-r32": dict(r=32, lora_alpha=16, target_modules=r".*\.mlp\.(gate|up|down)_proj"),
    "layers-r8": dict(r=8, lora_alpha=8, target_modules=["o_proj", "gate_proj"], layers_to_transform=[0, 2, 5, 29]),
    "exclude-r64": dict(r=64, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
                        exclude_modules=["v_proj"]),
}

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Give me a word that rhymes with cat.",
    "What is 2 + 3?",
    "Tell me a fun fact about owls.",
]


@pytest.fixture(scope="module")
def peft_model(hf_model, tmp_path_factory):
    """A PeftModel holding the five adapters with small random A and B, saved as PEFT saves them."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    gen = torch.Generator().manual_seed(1234)
    model = None
    for name, kwargs in ADAPTERS.items():
        cfg = LoraConfig(init_lora_weights=False, **kwargs)
        if model is None:
            model = get_peft_model(hf_model, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    randomize_lora_weights(model, gen, b_std=0.05)
    model.save_pretrained(root)  # first adapter at the root, the others in sub-folders
    paths = {name: root / name for name in ADAPTERS}  # peft 0.21 writes every adapter in a sub-folder
    model.eval()
    return model, paths


@pytest.fixture(scope="module")
def llm(model_path, peft_model):
    _, paths = peft_model
    engine = LLM(str(model_path), dtype="float32", max_loras=7, max_lora_rank=64, kv_cache_memory=64 << 20)
    for name, path in paths.items():
        engine.load_adapter(name, path)
    return engine


def test_mixed_batch_matches_peft_token_for_token(llm, peft_model, tokenizer):
    model, _ = peft_model
    rows = [None, *ADAPTERS, None]  # base rows at both ends, every adapter once
    prompts = [chat_ids(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(len(rows))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), adapters=rows)
    expected = [peft_generate(model, ids, a, MAX_NEW) for ids, a in zip(prompts, rows, strict=True)]
    for row, out, exp in zip(rows, outs, expected, strict=True):
        assert out.adapter == row
        n = len(out.token_ids)
        assert out.token_ids == exp[:n], f"adapter {row}: {out.token_ids} != {exp}"
        assert n == MAX_NEW or out.finish_reason == "stop"
    base = expected[0]
    assert all(exp != base for exp in expected[1:-1]), "every adapter must change the output"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_few_adapters_take_the_shrink_inside_the_base_gemm_and_match_peft(llm, peft_model, tokenizer, monkeypatch):
    """Four adapters whose rank pages fit under the base weights (6 pages of 8 rows): the CPU packed
    path runs their shrink inside the base GEMMs (`lora_linear`), and every row still equals PEFT."""
    from loraplex.kernels import cpu_packed

    model, _ = peft_model
    calls = []
    real = cpu_packed.add_lora_fused_packed
    monkeypatch.setattr(cpu_packed, "add_lora_fused_packed", lambda *a: calls.append(1) or real(*a))
    rows = [None, "qv-r8", "all-linear-rslora-r16", "attn-patterns-r4", "layers-r8", None]
    prompts = [chat_ids(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(len(rows))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), adapters=rows)
    assert calls, "the fused shrink was not used"
    for row, ids, out in zip(rows, prompts, outs, strict=True):
        exp = peft_generate(model, ids, row, MAX_NEW)
        assert out.token_ids == exp[:len(out.token_ids)], f"adapter {row}: {out.token_ids} != {exp}"


def test_first_step_logits_within_1e3_of_peft(llm, peft_model, tokenizer):
    model, _ = peft_model
    engine = llm.engine
    rows = [None, *ADAPTERS]
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[: len(rows)]]
    reqs = [engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0), a)
            for ids, a in zip(prompts, rows, strict=True)]
    sched = engine.scheduler.schedule()
    assert len(sched.requests) == len(rows)
    input_ids, positions, attn, lora, sampled, sample_rows, _ = engine.runner.prepare(sched, engine.adapters.slot_ranks)
    hidden = engine.model(input_ids, positions, engine.runner.kv_caches, attn, lora)
    ours = engine.model.compute_logits(hidden[sample_rows])
    for req in reqs:
        engine.abort_request(req.request_id)
    for i, req in enumerate(sampled):
        names = ["__base__" if req.adapter is None else req.adapter]
        with torch.no_grad():
            ref = model(torch.tensor([req.prompt_token_ids]), adapter_names=names).logits[0, -1]
        torch.testing.assert_close(ours[i], ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("adapters", [True, False], ids=["adapters", "base"])
def test_the_last_layer_on_the_sampled_rows_alone_gives_their_rows_of_the_full_forward(llm, peft_model, tokenizer,
                                                                                       adapters, monkeypatch):
    """`out_rows`: the last layer's queries, attention, o_proj and MLP run on the sampled rows only (with
    the adapters of those rows: four of the five here touch the MLP or o_proj); their hidden states equal
    those rows of the full forward to fp32 rounding (a prefill row's attention sums in another order),
    a step that samples nothing gets none, and either way every row's K/V of the last layer is written
    as the full forward writes it."""
    engine = llm.engine
    rows = [None, *ADAPTERS] if adapters else [None] * (len(ADAPTERS) + 1)  # base: q/k/v from their columns
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[: len(rows)]]
    warm = [chat_ids(tokenizer, "Hi")] * len(rows)  # the adapters into slots (other prompts: little cached)
    llm.generate(warm, SamplingParams(max_tokens=1, temperature=0), adapters=rows)
    reqs = [engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0), a)
            for ids, a in zip(prompts, rows, strict=True)]
    sched = engine.scheduler.schedule()
    columns = []  # what each cpu_gemm.linear_columns call gave: None where it did not run
    real = cpu_gemm.linear_columns
    monkeypatch.setattr(cpu_gemm, "linear_columns", lambda *a: columns.append(real(*a)) or columns[-1])
    attended = []  # the rows each paged_attention_rows call attended
    real_rows = attention.paged_attention_rows
    monkeypatch.setattr(attention, "paged_attention_rows", lambda q, r, *a: attended.append(r) or real_rows(q, r, *a))
    try:
        input_ids, positions, attn, lora, sampled, sample_rows, _ = engine.runner.prepare(sched, engine.adapters.slot_ranks)
        assert len(sampled) == len(rows) and (lora is not None) == adapters and len(sample_rows) < len(input_ids)
        full = engine.model(input_ids, positions, engine.runner.kv_caches, attn, lora)  # [T, H]
        last_k, last_v = engine.runner.kv_caches[-1]
        written = last_k[attn.slot_mapping].clone(), last_v[attn.slot_mapping].clone()
        out_rows = torch.tensor(sample_rows)
        for taken in (out_rows, out_rows[:0]):
            last_k[attn.slot_mapping] = float("nan")
            last_v[attn.slot_mapping] = float("nan")
            alone = engine.model(input_ids, positions, engine.runner.kv_caches, attn, lora, taken)  # [B, H]
            assert alone.shape == (len(taken), full.shape[1])
            torch.testing.assert_close(alone, full[taken])  # fp32's default tolerances: rtol 1.3e-6, atol 1e-5
            assert torch.equal(last_k[attn.slot_mapping], written[0])
            assert torch.equal(last_v[attn.slot_mapping], written[1])
        assert attended == [sample_rows, []]  # the sampled rows alone attended in the last layer
        qkv = engine.model.layers[-1].self_attn.qkv_proj
        if not adapters and getattr(qkv, "packed_backend", None) in cpu_gemm.OURS:  # our GEMM packed it
            assert len(columns) == 3 and all(c is not None for c in columns)  # every row's k/v, 5 rows' q, 0 rows
        else:
            assert not adapters or not columns  # q/k/v adapters: the whole projection
    finally:
        for req in reqs:
            engine.abort_request(req.request_id)


def test_request_joining_mid_decode_gets_the_same_tokens(llm, peft_model, tokenizer):
    model, _ = peft_model
    engine = llm.engine
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    early = [engine.add_request(chat_ids(tokenizer, p), greedy, a)
             for p, a in [(PROMPTS[0], "qv-r8"), (PROMPTS[1], None)]]
    for _ in range(5):
        engine.step()
    assert all(r.num_output_tokens >= 3 and not r.is_finished for r in early)
    late_ids = chat_ids(tokenizer, PROMPTS[2])
    late = engine.add_request(late_ids, greedy, "exclude-r64")
    while engine.has_unfinished_requests():
        engine.step()
    assert late.output_token_ids == peft_generate(model, late_ids, "exclude-r64", MAX_NEW)[: late.num_output_tokens]
    alone = llm.generate([late_ids], greedy, adapters="exclude-r64")[0]
    assert alone.token_ids == late.output_token_ids


def test_preemption_under_a_tiny_kv_cache_gives_the_same_tokens(model_path, peft_model, tokenizer):
    model, paths = peft_model
    rows = ["qv-r8", None, "mlp-regex-r32"]
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[3:6]]
    # Just enough blocks to admit all three prompts; growing by MAX_NEW tokens forces preemption.
    num_blocks = sum(-(-len(p) // 16) for p in prompts)
    assert any(len(p) + MAX_NEW > -(-len(p) // 16) * 16 for p in prompts)
    small = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=64, num_kv_blocks=num_blocks,
                block_size=16)
    small.load_adapter("qv-r8", paths["qv-r8"])
    small.load_adapter("mlp-regex-r32", paths["mlp-regex-r32"])
    outs = small.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), adapters=rows)
    engine = small.engine
    assert engine.scheduler.num_preemptions > 0
    for ids, a, out in zip(prompts, rows, outs, strict=True):
        expected = peft_generate(model, ids, a, MAX_NEW)  # PEFT stops at EOS; ignore_eos kept ours going
        assert out.token_ids[: len(expected)] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.adapters.pages.refcount


def test_seeded_sampling_is_the_same_in_any_batch(llm, tokenizer):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    ids = chat_ids(tokenizer, PROMPTS[6])
    alone = llm.generate([ids], params)[0]
    crowd = llm.generate([chat_ids(tokenizer, p) for p in PROMPTS[:3]] + [ids],
                         [SamplingParams(max_tokens=10, temperature=1.0)] * 3 + [params])[3]
    assert alone.token_ids == crowd.token_ids
    other_seed = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0.9, seed=8))[0]
    assert other_seed.token_ids != alone.token_ids


def test_default_model_answers_the_capital_question(model_path):
    llm = LLM(str(model_path), kv_cache_memory=32 << 20)  # dtype auto: bf16 where fast
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=20, temperature=0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_fair_share_and_priority_preemptions_give_the_same_tokens(model_path, peft_model, tokenizer):
    # two rows: a second tenant's request and then an urgent one each preempt the first tenant's newest
    model, paths = peft_model
    small = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=64, max_num_seqs=2,
                kv_cache_memory=64 << 20)
    small.load_adapter("qv-r8", paths["qv-r8"])
    engine = small.engine
    assert engine.config.scheduling_policy == "fair"
    greedy = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[:5]]
    rows = [engine.add_request(prompts[0], SamplingParams(**greedy), "qv-r8", tenant_id=1),
            engine.add_request(prompts[1], SamplingParams(**greedy), None, tenant_id=1),
            engine.add_request(prompts[2], SamplingParams(**greedy), None, tenant_id=1)]
    for _ in range(3):
        engine.step()
    def newest_running():
        assert len(engine.scheduler.running) == 2
        return max(engine.scheduler.running, key=lambda r: r.admission_seq)

    victim = newest_running()
    rows.append(engine.add_request(prompts[3], SamplingParams(**greedy), "qv-r8", tenant_id=2, tenant_weight=2.0))
    engine.step()
    assert victim.num_preemptions == 1 and rows[3] in engine.scheduler.running  # tenant 2 had no row
    victim = newest_running()
    rows.append(engine.add_request(prompts[4], SamplingParams(**greedy, priority=-1), None, tenant_id=1))
    engine.step()
    assert victim.num_preemptions == 1 and rows[4] in engine.scheduler.running  # more urgent than both
    assert engine.scheduler.num_preemptions == 2
    while engine.has_unfinished_requests():
        engine.step()
    for ids, r in zip(prompts, rows, strict=True):
        expected = peft_generate(model, ids, r.adapter, MAX_NEW)
        assert r.output_token_ids[: len(expected)] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


SYSTEM = ("You are the assistant of a small travel company. Answer in one short sentence, politely, and never "
          "invent prices, dates or places. If a question is not about travel, answer it briefly anyway. ") * 3


def system_chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_prefix_caching_gives_the_same_tokens_as_caching_off(model_path, peft_model, tokenizer):
    """Base and adapter rows in one batch share a system prompt, prefilled in chunks, with a KV cache small
    enough that requests are preempted and cached blocks evicted and computed again: every row's greedy
    tokens equal those of an engine without prefix caching."""
    _, paths = peft_model
    rows = [None, "qv-r8", "mlp-regex-r32", None, "exclude-r64", "qv-r8"]
    first = [system_chat_ids(tokenizer, PROMPTS[i]) for i in range(6)]
    # the second wave: new questions, then the first wave's prompts again (cached whole, or evicted)
    waves = [(first, rows), ([system_chat_ids(tokenizer, PROMPTS[(i + 3) % 7]) for i in range(6)] + first[:4],
                             rows + rows[:4])]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    num_blocks = 3 * -(-len(first[0]) // 16)

    def run(caching: bool):
        llm = LLM(str(model_path), dtype="float32", max_loras=3, max_lora_rank=64, num_kv_blocks=num_blocks,
                  block_size=16, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=caching)
        for name in ("qv-r8", "mlp-regex-r32", "exclude-r64"):
            llm.load_adapter(name, paths[name])
        return llm, [llm.generate(prompts, greedy, adapters=r) for prompts, r in waves]

    cached, cached_outs = run(True)
    plain, plain_outs = run(False)
    for wave_on, wave_off in zip(cached_outs, plain_outs, strict=True):
        for on, off in zip(wave_on, wave_off, strict=True):
            assert on.token_ids == off.token_ids, f"adapter {on.adapter}"
            assert off.num_cached_tokens == 0
    bm = cached.engine.block_manager
    assert cached.engine.scheduler.num_preemptions > 0 and bm.num_evicted_blocks > 0
    # the system prompt's full blocks were served under each row's own weights, and some were evicted
    assert sum(o.num_cached_tokens > 0 for o in cached_outs[1]) >= 4
    assert bm.num_cached_hit_tokens > 0 and plain.engine.block_manager.num_cached_blocks == 0
    bm.check()


def test_an_adapter_loaded_again_with_new_weights_never_meets_its_old_blocks(model_path, peft_model, tokenizer):
    model, paths = peft_model
    llm = LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=64, kv_cache_memory=64 << 20)
    ids = system_chat_ids(tokenizer, PROMPTS[0])
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    llm.load_adapter("tenant-adapter", paths["qv-r8"])
    assert llm.generate([ids], greedy, adapters="tenant-adapter")[0].num_cached_tokens == 0
    assert llm.generate([ids], greedy, adapters="tenant-adapter")[0].num_cached_tokens == (len(ids) - 1) // 16 * 16
    assert llm.generate([ids], greedy)[0].num_cached_tokens == 0  # the base model has its own blocks
    llm.unload_adapter("tenant-adapter")
    llm.load_adapter("tenant-adapter", paths["exclude-r64"])  # same name, new weights
    out = llm.generate([ids], greedy, adapters="tenant-adapter")[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == peft_generate(model, ids, "exclude-r64", MAX_NEW)[: len(out.token_ids)]
