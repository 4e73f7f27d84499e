"""Constrained decoding (`SamplingParams.json_schema`, `engine/structured_output.py`): the grammar mask
per row, the schema cache, and on the real default model answers that validate, logprobs after the
mask against transformers' logits masked by an independent llguidance matcher, seeds, stop strings,
preemption and a failing grammar that ends its own request only."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import ParamError
from loraplex.engine.structured_output import StructuredOutputs, apply_grammar_masks_, schema_key
from tests.helpers import chat_ids

ITEM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 2, "maxLength": 16},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "maxLength": 12}},
    },
    "required": ["title", "year", "genre", "cast"],
    "additionalProperties": False,
}
PROMPT = "Give a film as JSON with its title, year, genre and cast."


@pytest.fixture(scope="module")
def structured(tokenizer):
    return StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_the_cache_keys_a_schema_by_its_canonical_form(structured):
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    b = {"properties": {"y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"}
    assert schema_key(a) == schema_key(b) != schema_key({**a, "required": ["x"]})
    compiled = structured.num_compiled
    assert structured.compile(a) is structured.compile(b)
    assert structured.num_compiled == compiled + 1 and structured.num_cache_hits >= 1


def test_the_cache_is_bounded(tokenizer):
    small = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_cached=2)
    first = small.compile({"type": "integer"})
    small.compile({"type": "string"})
    small.compile({"type": "boolean"})
    assert small.compile({"type": "integer"}) is not first and small.num_compiled == 4


@pytest.mark.parametrize("schema, reason", [
    ({"type": "frob"}, "Invalid type: frob"),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "Unsatisfiable schema: minimum (3) is greater than maximum (2)"),
    ({"$ref": "#/$defs/missing"}, "Pointer '/$defs/missing' does not exist"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "NoExtensionBias"),
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "lexer error: too many expressions constructed"),
])
def test_a_refused_schema_says_the_librarys_reason(structured, schema, reason):
    with pytest.raises(ParamError) as e:
        structured.compile(schema, "response_format")
    assert e.value.param == "response_format" and str(e.value) == f"invalid JSON schema: {reason}"


def test_masks_touch_only_constrained_rows_and_only_disallowed_tokens(structured, tokenizer):
    vocab = len(tokenizer)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    reqs = [Request([1], SamplingParams()) for _ in range(3)]
    reqs[1].grammar = structured.new_state({"type": "integer", "minimum": 0})
    masked = logits.clone()
    assert apply_grammar_masks_(masked, reqs) == [1]
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = masked[1] > float("-inf")
    assert torch.equal(masked[1][allowed], logits[1][allowed])
    texts = [tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()]
    assert texts and all(t[0].isdigit() for t in texts) and "-" not in texts  # minimum 0: no sign
    again = masked.clone()
    apply_grammar_masks_(again, reqs)
    assert torch.equal(again, masked)  # idempotent: a row sampled again after a neighbour failed is the same


def test_the_state_is_rebuilt_from_the_output_tokens(structured, tokenizer):
    state = structured.new_state({"type": "array", "items": {"type": "integer"}})
    tokens = tokenizer.encode("[1,2", add_special_tokens=False)
    for t in tokens:
        state.accept(t)
    fresh = structured.new_state({"type": "array", "items": {"type": "integer"}})
    fresh.forget()
    fresh.sync(tokens)
    words = [np.zeros(1536, dtype=np.int32) for _ in range(2)]
    for s, w in zip((state, fresh), words, strict=True):
        s.matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
    assert np.array_equal(*words) and fresh.num_consumed == len(tokens)
    with pytest.raises(ValueError, match="does not follow"):
        fresh.accept(tokenizer.encode("x", add_special_tokens=False)[0])


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=32 << 20)


def masked_reference(plain_hf_model, tokenizer, prompt: list[int], output: list[int], schema: dict) -> torch.Tensor:
    """[len(output), V]: log_softmax of transformers' logits for each output token, with the tokens an
    llguidance matcher built here (not the engine's) disallows at -inf."""
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}))
    with torch.no_grad():
        logits = plain_hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    words = np.zeros((len(output), (len(tokenizer) + 31) // 32), dtype=np.int32)
    for i, token in enumerate(output):
        matcher.unsafe_compute_mask_ptr(words[i].ctypes.data, words[i].nbytes)
        assert matcher.consume_token(token)
    bits = (torch.from_numpy(words)[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(output), -1)[:, :logits.shape[1]].bool()
    return torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


@pytest.mark.slow
def test_greedy_answers_validate_and_logprobs_are_the_masked_log_softmax(llm, plain_hf_model, tokenizer):
    prompt = chat_ids(tokenizer, PROMPT)
    out = llm.generate([prompt], SamplingParams(max_tokens=120, temperature=0, json_schema=ITEM, logprobs=3))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), ITEM)
    ref = masked_reference(plain_hf_model, tokenizer, prompt, out.token_ids, ITEM)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert token == ref[i].argmax().item() == lp.token_id
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        finite = ref[i][ref[i] > float("-inf")]
        assert len(lp.top) == min(3, finite.numel())  # excluded tokens are not listed
        assert [p for _, p in lp.top] == pytest.approx(finite.topk(len(lp.top)).values.tolist(), abs=1e-4)
    unconstrained = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert unconstrained.token_ids != out.token_ids[:8]  # the model alone would not have written this JSON


@pytest.mark.slow
def test_seeded_constrained_rows_are_the_same_alone_and_batched(llm, tokenizer):
    prompt = chat_ids(tokenizer, PROMPT)
    seeded = SamplingParams(max_tokens=120, temperature=1.0, seed=7, json_schema=ITEM)
    alone = llm.generate([prompt], seeded)[0]
    plain = SamplingParams(max_tokens=16, temperature=0)
    batch = llm.generate([chat_ids(tokenizer, "Hello!"), prompt, chat_ids(tokenizer, "Count to five.")],
                         [plain, seeded, plain])
    assert batch[1].token_ids == alone.token_ids
    if alone.finish_reason == "stop":
        jsonschema.validate(json.loads(alone.text), ITEM)
    else:
        assert alone.finish_reason == "length" and len(alone.token_ids) == 120


@pytest.mark.slow
def test_a_stop_string_ends_a_constrained_row_with_stop(llm, tokenizer):
    out = llm.generate([chat_ids(tokenizer, PROMPT)], SamplingParams(max_tokens=120, temperature=0,
                                                                     json_schema=ITEM, stop=['"year"']))[0]
    assert out.finish_reason == "stop" and out.text.startswith('{"title":"') and '"year"' not in out.text


@pytest.mark.slow
def test_preemption_rebuilds_the_grammar_and_keeps_the_tokens(model_path, llm, tokenizer):
    prompts = [chat_ids(tokenizer, PROMPT), chat_ids(tokenizer, "Describe a comedy film as JSON."),
               chat_ids(tokenizer, "A horror film as JSON, please.")]
    params = SamplingParams(max_tokens=100, temperature=0, json_schema=ITEM)
    expected = llm.generate(prompts, params)
    # just enough KV blocks to admit all three prompts: growing by their answers forces preemption
    small = LLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, block_size=16,
                num_kv_blocks=sum(-(-len(p) // 16) for p in prompts) + 1)
    reqs = [small.engine.add_request(p, params) for p in prompts]
    outs = {}
    while small.engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in small.engine.step() if o.finished})
    assert small.engine.scheduler.num_preemptions > 0
    assert [r.grammar.num_rebuilds for r in reqs] == [r.num_preemptions for r in reqs]  # one per preemption
    for req, exp in zip(reqs, expected, strict=True):
        out = outs[req.request_id]
        assert (out.token_ids, out.finish_reason) == (exp.token_ids, exp.finish_reason)
        jsonschema.validate(json.loads(out.text), ITEM)


@pytest.mark.slow
def test_a_failing_grammar_ends_its_own_request_only(llm, tokenizer):
    engine = llm.engine
    prompt = chat_ids(tokenizer, PROMPT)
    broken = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, json_schema=ITEM))
    fine = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, json_schema=ITEM))
    plain = engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0))
    broken.grammar.matcher.consume_token(tokenizer.encode("x", add_special_tokens=False)[0])  # error state
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[broken.request_id].finish_reason == "abort"
    assert "the grammar failed" in outs[broken.request_id].error
    assert outs[fine.request_id].error is None and outs[fine.request_id].text.startswith('{"title":"')
    assert outs[plain.request_id].error is None and len(outs[plain.request_id].token_ids) == 5


@pytest.mark.slow
def test_async_llm_compiles_schemas_off_the_engine_thread(model_path, tokenizer):
    from loraplex.engine.async_llm import AsyncLLM

    llm = AsyncLLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=16 << 20)
    compiled_on: list[str] = []
    compile_ = llm.engine.structured.compile

    def recording(schema, param="json_schema"):
        before = llm.engine.structured.num_compiled
        result = compile_(schema, param)
        if llm.engine.structured.num_compiled > before:
            compiled_on.append(threading.current_thread().name)
        return result

    llm.engine.structured.compile = recording

    async def run():
        params = SamplingParams(max_tokens=4, temperature=0, json_schema={"type": "array", "maxItems": 2})
        async for out in llm.generate(chat_ids(tokenizer, "A list, please."), params):
            last = out
        return last

    try:
        out = asyncio.run(run())
    finally:
        llm.shutdown()
    assert out.text.startswith("[") and compiled_on and "loraplex-engine" not in compiled_on


def test_a_failing_row_beside_constrained_rows_leaves_their_tokens_as_alone(structured, tokenizer):
    from loraplex.engine.sampler import sample_rows

    logits = torch.randn(3, len(tokenizer), generator=torch.Generator().manual_seed(1))
    logits[2, 5] = float("nan")
    reqs = [Request([1], SamplingParams(temperature=0, logprobs=1)) for _ in range(3)]
    for r in reqs[:2]:
        r.grammar = structured.new_state({"type": "integer"})
    alone = [sample_rows(logits[i:i + 1].clone(), [reqs[i]])[0][0] for i in range(2)]
    tokens, errors, logprobs = sample_rows(logits, reqs)
    assert tokens[:2] == alone and errors[:2] == [None, None] and "non-finite" in str(errors[2])
    assert all(tokenizer.decode([t])[0].isdigit() or tokenizer.decode([t])[0] == "-" for t in tokens[:2])
    assert logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[tokens[0]].item(), abs=1e-5)


def test_a_schema_too_deep_to_hash_is_refused_not_raised(structured):
    schema: dict = {"type": "integer"}
    for _ in range(1000):  # deeper than Python's recursion limit lets json.dumps go
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ParamError, match="the JSON schema is nested too deeply"):
        structured.compile(schema, "response_format")


def test_a_schemas_x_guidance_cannot_change_the_form_of_the_json(structured, tokenizer):
    schema = {"type": "array", "items": {"type": "integer"},
              "x-guidance": {"item_separator": ";", "whitespace_flexible": True, "lenient": True}}

    def follows(text: str) -> bool:
        state = structured.new_state(schema)
        try:
            state.sync(tokenizer.encode(text, add_special_tokens=False))
        except ValueError:
            return False
        return True

    assert follows("[1,2]") and not follows("[1;2]") and not follows("[ 1")
    with pytest.raises(ParamError, match="Unimplemented keys"):  # lenient would have ignored `not`
        structured.compile({"not": {"type": "string"}, "x-guidance": {"lenient": True}})


def test_a_model_without_a_tokenizer_refuses_every_schema_with_the_reason():
    none = StructuredOutputs(None, 100, [0])
    for _ in range(2):  # the reason is remembered, not rebuilt
        with pytest.raises(ParamError, match="structured output is not available for this model: this model has "
                                             "no tokenizer"):
            none.compile({"type": "integer"})
