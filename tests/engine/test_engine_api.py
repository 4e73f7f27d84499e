"""Public API behaviour: refusals, streaming, abort, sampling knobs, other Llama-family checkpoints."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import time

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.adapters.peft import AdapterError
from loraplex.engine.async_llm import AsyncLLM
from loraplex.engine.detokenizer import IncrementalDetokenizer
from tests.helpers import chat_ids


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), dtype="float32", max_loras=2, max_lora_rank=16, kv_cache_memory=32 << 20)


def test_prompt_longer_than_context_is_refused(llm):
    n = llm.engine.model_config.max_model_len
    with pytest.raises(ValueError, match=f"the prompt has {n} tokens, but the model's context is {n} tokens"):
        llm.generate([[1] * n])
    assert not llm.engine.has_unfinished_requests()


def test_unknown_adapter_and_bad_params_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
        llm.generate(["hi", "there"], adapters=[None, "nope"])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_kv_cache_too_small_for_one_request_is_a_clear_error(model_path):
    tiny = LLM(str(model_path), dtype="float32", num_kv_blocks=2, block_size=16, max_lora_rank=8, max_loras=1)
    with pytest.raises(ValueError, match="needs 40 tokens of KV cache, but the whole cache holds 32 tokens"):
        tiny.generate([[5] * 30], SamplingParams(max_tokens=10))
    out = tiny.generate([[5] * 10], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_refused_adapter_leaves_nothing_loaded(llm, tmp_path):
    from safetensors.torch import save_file

    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "use_dora": True}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        llm.load_adapter("dora", tmp_path)
    prefix = "base_model.model.model.layers"
    save_file({f"{prefix}.{i}.self_attn.q_proj.lora_{ab}.weight": torch.zeros(shape)
               for i in range(30) for ab, shape in (("A", (8, 576)), ("B", (576, 8)))},
              tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="use_dora"):
        llm.load_adapter("dora", tmp_path)
    assert llm.list_adapters() == []
    config["use_dora"] = False
    config["r"] = 32  # more than max_lora_rank=16
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="max_lora_rank"):
        llm.load_adapter("too-big", tmp_path)
    assert llm.list_adapters() == []


def test_stop_strings_and_stop_tokens(llm, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    full = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0))[0]
    assert full.text == "The capital of France is Paris."
    cut = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0, stop=[" is P"]))[0]
    assert cut.text == "The capital of France" and cut.finish_reason == "stop"
    stop_tok = full.token_ids[2]
    by_token = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert by_token.token_ids == full.token_ids[:3] and by_token.finish_reason == "stop"
    assert by_token.text == tokenizer.decode(full.token_ids[:2])
    length = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0))[0]
    assert length.token_ids == full.token_ids[:3] and length.finish_reason == "length"


def test_top_k_1_is_greedy(llm, tokenizer):
    ids = chat_ids(tokenizer, "Name a fruit.")
    greedy = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    top1 = llm.generate([ids], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3))[0]
    assert top1.token_ids == greedy.token_ids


def test_detokenizer_never_splits_a_utf8_character(tokenizer):
    text = "Crème brûlée 🍮 et thé 🍵!"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    deltas = []
    for i in ids:
        detok.add_token(i)
        deltas.append(detok.delta(finished=False))
    deltas.append(detok.delta(finished=True))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_never_streams_part_of_a_stop_string(tokenizer):
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(tokenizer, stop=["three"])
    streamed = ""
    stopped = False
    for i in ids:
        stopped = detok.add_token(i)
        streamed += detok.delta(finished=stopped)
        if stopped:
            break
    assert stopped and streamed == "one two " and "thr" not in streamed


def test_step_outputs_copy_nothing_that_grows_and_still_read_as_of_their_step(llm, tokenizer):
    """An unfinished request's output holds its tokens and text as of its step, built only when read (no
    per-step copy of the whole output, Deliver 2 of issue 18); the finished one holds the full lists."""
    engine = llm.engine
    rid = engine.add_request(chat_ids(tokenizer, "Count from one to twenty."),
                             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).request_id
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    *steps, last = outs
    assert len(steps) == 11 and last.finished and len(last.token_ids) == 12
    assert all(callable(o._token_ids) and callable(o._text) for o in steps)  # nothing built during the steps
    assert not callable(last._token_ids)
    for i, o in enumerate(steps):
        assert o.token_ids == last.token_ids[:i + 1] and o.delta_token_ids == [last.token_ids[i]]
        assert last.text.startswith(o.text)
    assert "".join(o.delta_text for o in outs) == last.text
    assert last.text == tokenizer.decode(last.token_ids, skip_special_tokens=True)
    fresh = [o for o in engine.step()]  # nothing running: no outputs
    assert fresh == []
    copy = pickle.loads(pickle.dumps(steps[3]))  # pickled with its lists built
    assert copy == steps[3] and copy.token_ids == last.token_ids[:4] and copy is not steps[3]


def test_async_streaming_abort_and_a_free_event_loop(model_path, tokenizer):
    async def main():
        engine = AsyncLLM(str(model_path), dtype="float32", max_lora_rank=8, max_loras=1,
                          kv_cache_memory=32 << 20)
        ids = chat_ids(tokenizer, "What is the capital of France?")
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        deltas = [d async for d in engine.generate(ids, SamplingParams(max_tokens=20, temperature=0))]
        assert "".join(d.delta_text for d in deltas) == "The capital of France is Paris."
        assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])
        assert ticks >= 5  # the loop kept running while the engine worked
        # A consumer that leaves early aborts its request and frees its KV blocks.
        stream = engine.generate(ids, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        bm = engine.engine.block_manager
        for _ in range(100):
            if bm.num_free_blocks == bm.num_blocks and not engine.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert bm.num_free_blocks == bm.num_blocks and not engine.engine.requests
        with pytest.raises(ValueError, match="the prompt is empty"):
            async for _ in engine.generate([], None):
                pass
        tick_task.cancel()
        engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_local_hf_directories_of_the_llama_family(tmp_path, arch):
    """Random tiny Qwen2 (q/k/v bias) and Mistral checkpoints: our logits equal transformers'."""
    import transformers

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cls_cfg, cls_model = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    torch.manual_seed(0)
    hf = cls_model(cls_cfg(**kw)).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_lora_rank=8, max_loras=1, kv_cache_memory=4 << 20)
    prompt = [3, 17, 42, 99, 7, 250]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          min_new_tokens=6)[0, len(prompt):].tolist()
    assert out.token_ids == ref


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickled weights are never loaded"):
        LLM(str(tmp_path))


def test_dummy_weights_run():
    llm = LLM("tiny-llama", load_format="dummy", dtype="float32", max_lora_rank=8, max_loras=1,
              kv_cache_memory=1 << 20)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == ""


def test_cli_generate_answers_a_chat_prompt(model_path):
    t = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "loraplex.cli", "generate", "--model", str(model_path),
                          "--prompt", "What is the capital of France?", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["text"] == "The capital of France is Paris." and out["finish_reason"] == "stop"
    assert time.monotonic() - t < 120
    bad = subprocess.run([sys.executable, "-m", "loraplex.cli", "generate", "--model", str(model_path),
                          "--prompt", "x", "--use", "ghost"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--use 'ghost' names no adapter" in bad.stderr


def test_async_engine_survives_callers_cancelled_mid_request():
    """A caller cancelled while its request is being added or streamed must not kill the engine thread."""

    async def main():
        engine = AsyncLLM("tiny-llama", load_format="dummy", dtype="float32", max_lora_rank=8, max_loras=1,
                          kv_cache_memory=1 << 20)
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

        async def consume():
            return [d async for d in engine.generate([1, 2, 3], params)]

        for delay in (0, 0.001, 0.01, 0.05):
            task = asyncio.create_task(consume())
            await asyncio.sleep(delay)
            task.cancel()
            try:  # cancelled mid-add or mid-stream, or (at the longest delay) maybe already done
                await task
            except asyncio.CancelledError:
                pass
        assert engine._thread.is_alive() and engine.is_alive()
        outs = [d async for d in engine.generate([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 3
        bm = engine.engine.block_manager
        for _ in range(200):
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.requests and bm.num_free_blocks == bm.num_blocks
        engine.shutdown()
        assert not engine.is_alive()  # what /health and a scale-out replica's health check read

    asyncio.run(main())


def test_a_wedged_step_loop_shows_in_seconds_without_progress():
    """What a scale-out replica's health check reads: 0 while the loop is idle, growing while a command (or
    a step) does not return, 0 again once it has."""

    async def main():
        engine = AsyncLLM("tiny-llama", load_format="dummy", dtype="float32", max_lora_rank=8, max_loras=1,
                          kv_cache_memory=1 << 20)
        await asyncio.sleep(0.3)
        assert engine.seconds_without_progress() == 0.0  # idle for 0.3 s: not stuck
        stuck = asyncio.ensure_future(engine.call(time.sleep, 1.5))  # the engine thread busy in one command
        await asyncio.sleep(0.2)
        engine.abort_nowait("nobody")  # work queued behind it
        await asyncio.sleep(1.0)
        assert 0.9 <= engine.seconds_without_progress() <= 1.5
        await stuck
        await asyncio.sleep(0.1)
        assert engine.seconds_without_progress() == 0.0
        engine.shutdown()

    asyncio.run(main())


def test_submit_to_is_one_command_and_one_hand_off_per_step(tmp_path):
    """A call registers its adapter and queues its requests in one engine command (a request waits for
    one step boundary, not two), and each step's outputs of the call reach its sink in one call."""
    from loraplex.adapters.synthetic import write_random_adapter

    async def main():
        engine = AsyncLLM("tiny-llama", load_format="dummy", dtype="float32", max_lora_rank=8, max_loras=1,
                          kv_cache_memory=1 << 20)
        write_random_adapter(tmp_path / "a", engine.engine.model_config, r=4, alpha=8, seed=1)
        commands = []
        put = engine._commands.put
        engine._commands.put = lambda cmd: (commands.append(cmd), put(cmd))[1]
        calls, done = [], asyncio.Event()

        def sink(outs):
            calls.append([(o.request_id, len(o.token_ids), o.finished) for o in outs])
            if sum(finished for batch in calls for _, _, finished in batch) == 3:
                done.set()

        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        await engine.submit_to([[1, 2, 3], [4, 5], [6]], [params] * 3, ["r0", "r1", "r2"], sink, adapter="a",
                               adapter_path=str(tmp_path / "a"))
        assert len(commands) == 1 and "a" in engine.engine.adapters
        await asyncio.wait_for(done.wait(), 60)
        engine._commands.put = put
        # The three prompts prefill in one step, then decode together: every step hands over all three.
        assert calls == [[(f"r{i}", n, n == 5) for i in range(3)] for n in range(1, 6)]
        engine.shutdown()

    asyncio.run(main())
