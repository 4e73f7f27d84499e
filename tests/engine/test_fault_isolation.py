"""One request's fault ends that request alone; a fault of the step ends the batch and the engine keeps
serving; a full waiting queue sheds a whole call and queues nothing. Real default model, fp32."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.async_llm import AsyncLLM
from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import ParamError, SamplingParams
from tests.helpers import chat_ids, write_random_adapter

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name a fruit.", "Say hi.", "Count to five.",
             "What is water made of?", "Tell me a color.", "Why is the sky blue?", "Name a planet."]


class Poison:
    """inject_fault hook: raises at `stage` for the requests whose id starts with "poison"."""

    def __init__(self, stage: str):
        self.stage = stage
        self.num_raised = 0

    def __call__(self, stage: str, req: Request | None) -> None:
        if stage == self.stage and req is not None and req.request_id.startswith("poison"):
            self.num_raised += 1
            raise RuntimeError(f"injected {stage} fault")


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    eng = LLMEngine(str(model_path), dtype="float32", max_loras=2, max_lora_rank=8, kv_cache_memory=64 << 20,
                    max_num_seqs=16)
    path = tmp_path_factory.mktemp("adapter") / "b"
    write_random_adapter(path, eng.model_config, r=8, alpha=16, seed=3)
    eng.adapters.register("tenant-b-adapter", path)
    return eng


def batch_of_eight(tokenizer) -> list[tuple[list[int], SamplingParams, str | None, str]]:
    """8 requests of two tenants: a's on the base model (greedy and seeded sampling), b's on its adapter."""
    rows = []
    for i, q in enumerate(QUESTIONS):
        tenant = 1 if i % 2 == 0 else 2  # tenant 1 on the base model, 2 on its adapter
        params = SamplingParams(max_tokens=12, temperature=0 if i % 4 < 2 else 0.8, seed=i, ignore_eos=True)
        rows.append((chat_ids(tokenizer, q), params, None if tenant == 1 else "tenant-b-adapter", tenant))
    return rows


def run(engine: LLMEngine, rows, poisoned: list[int] | None = None, join_after: int = 3) -> dict:
    """Run the rows to the end; `poisoned` (a prompt) joins the running batch after `join_after` steps.
    Returns {request_id: last RequestOutput}."""
    finals = {}
    for i, (ids, params, adapter, tenant) in enumerate(rows):
        engine.add_request(ids, params, adapter, request_id=f"row-{i}", tenant_id=tenant)
    num_steps = 0
    while engine.has_unfinished_requests():
        if poisoned is not None and num_steps == join_after:
            engine.add_request(poisoned, SamplingParams(max_tokens=12, temperature=0), request_id="poison-0",
                               tenant_id=1)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        num_steps += 1
    return finals


@pytest.mark.parametrize("stage", ["sample", "update"])
def test_a_failing_request_ends_alone_and_the_batch_keeps_its_tokens(engine, tokenizer, stage):
    rows = batch_of_eight(tokenizer)
    clean = run(engine, rows)
    poison = Poison(stage)
    engine.inject_fault = poison
    try:
        mixed = run(engine, rows, poisoned=chat_ids(tokenizer, "Tell me a story."))
    finally:
        engine.inject_fault = None
    assert poison.num_raised >= 1
    bad = mixed.pop("poison-0")
    assert bad.finish_reason == "abort" and bad.error == f"RuntimeError: injected {stage} fault"
    assert bad.token_ids == []
    assert sorted(mixed) == sorted(clean) == [f"row-{i}" for i in range(8)]
    for rid, out in clean.items():
        assert mixed[rid].token_ids == out.token_ids, rid
        assert mixed[rid].finish_reason == "length" and mixed[rid].error is None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests


def test_out_of_vocab_values_are_refused_before_anything_is_queued(engine, tokenizer):
    ids = chat_ids(tokenizer, "hi")
    vocab = engine.model_config.vocab_size
    for params, param in ((SamplingParams(top_k=10**30), "top_k"), (SamplingParams(top_k=vocab + 1), "top_k"),
                          (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids")):
        with pytest.raises(ParamError) as e:
            engine.add_requests([ids, ids], [SamplingParams(), params])
        assert e.value.param == param and f"{vocab}" in str(e.value)
    assert not engine.has_unfinished_requests() and not engine.requests
    out = run(engine, [(ids, SamplingParams(top_k=vocab, temperature=1.0, seed=1, max_tokens=2), None, 1)])
    assert out["row-0"].finish_reason in ("stop", "length")  # top_k = vocab size is the largest allowed


def test_a_full_waiting_queue_sheds_a_whole_call(model_path, tokenizer):
    eng = LLMEngine(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=32 << 20,
                    max_num_seqs=2, max_num_batched_tokens=64, max_num_waiting_seqs=3, max_num_waiting_tokens=200)
    ids = chat_ids(tokenizer, "Say hi.")  # 31 tokens
    p = SamplingParams(max_tokens=4, temperature=0)
    eng.add_requests([ids] * 4, [p] * 4, shed=True)  # the empty queue takes a call larger than its bounds
    eng.step()  # 2 run, 2 wait
    assert len(eng.scheduler.running) == 2 and len(eng.scheduler.waiting) == 2
    eng.add_requests([ids], [p], shed=True)  # 3 waiting: the bound
    with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
        eng.add_requests([ids], [p], shed=True)
    assert len(eng.scheduler.waiting) == 3 and len(eng.requests) == 5  # nothing of the refused call queued
    eng.add_requests([ids] * 3, [p] * 3)  # the offline path (LLM) is never shed
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_failing_forward_pass_ends_the_batch_and_the_engine_keeps_serving(model_path, tokenizer):
    async def main():
        llm = AsyncLLM(str(model_path), dtype="float32", max_loras=1, max_lora_rank=8, kv_cache_memory=32 << 20)
        try:
            await asyncio.wait_for(check(llm), timeout=120)
        finally:
            llm.shutdown()

    async def check(llm):
        ids = chat_ids(tokenizer, "What is the capital of France?")
        greedy = SamplingParams(max_tokens=20, temperature=0)
        failures = []

        def fail_once(stage, req):
            if stage == "forward" and not failures:
                failures.append(stage)
                raise RuntimeError("injected forward fault")

        llm.engine.inject_fault = fail_once
        deltas = await llm.submit([ids, ids], [greedy, greedy], ["x-0", "x-1"])
        ended = [await deltas.get(), await deltas.get()]
        assert {o.request_id for o in ended} == {"x-0", "x-1"}
        assert all(o.finish_reason == "abort" for o in ended)
        assert all(o.error == "the engine step failed: RuntimeError: injected forward fault" for o in ended)
        outs = [o async for o in llm.generate(ids, greedy)]  # the engine serves the next request
        assert "".join(o.delta_text for o in outs) == "The capital of France is Paris."
        assert outs[-1].finish_reason == "stop" and outs[-1].error is None

    asyncio.run(main())


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_an_adapter_whose_weights_overflow_ends_its_requests_alone(engine, tokenizer, tmp_path, prompt_logprobs):
    """Finite weights so large that the forward overflows (upload takes them: they are finite) give NaN
    logits on that adapter's rows only: those requests end with the reason, the other rows keep their tokens.
    So do the logits of its prompt positions, when it asks for their log-probabilities."""
    rows = batch_of_eight(tokenizer)[::2]  # base rows only: the fixture's two slots hold b's adapter and this one
    clean = run(engine, rows)
    write_random_adapter(tmp_path / "huge", engine.model_config, r=8, alpha=8e6, seed=5, b_std=1e37)
    engine.adapters.register("huge", tmp_path / "huge")
    try:
        engine.add_request(chat_ids(tokenizer, "Hello there"), SamplingParams(max_tokens=6, temperature=0,
                                                                              prompt_logprobs=prompt_logprobs),
                           "huge", request_id="poison-huge")
        mixed = run(engine, rows)
    finally:
        engine.adapters.unregister("huge")
    bad = mixed.pop("poison-huge")
    assert bad.finish_reason == "abort" and bad.token_ids == []
    reason = " in 1 of 1 row(s)" if prompt_logprobs is None else ""  # the prompt's may come first (another text)
    assert bad.error.startswith(f"ValueError: the model produced non-finite logits (NaN or Inf){reason}")
    assert bad.prompt_logprobs == (None if prompt_logprobs is None else [None])  # none computed finite
    assert {rid: o.token_ids for rid, o in mixed.items()} == {rid: o.token_ids for rid, o in clean.items()}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests
