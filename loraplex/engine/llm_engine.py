"""The continuous-batching engine: one frozen base model, many adapters, one step at a time.

`step()` is schedule, execute, update (nano-vllm's shape). Not thread-safe: one thread drives it
(`LLM` in the caller's thread, `AsyncLLM` in its own).

Faults are isolated per request (vLLM isolates a failing request the same way): an exception in one
request's sampling, stop check or detokenization ends that request alone with finish reason "abort" and
`RequestOutput.error`, and every other request of the step goes on. Placing a request's adapter in a slot
is its own too (the scheduler ends it). Only an exception that belongs to no request (the forward pass)
leaves `step()`; the caller then aborts the batch and steps on (`AsyncLLM` does).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from loraplex import isa, threads
from loraplex.adapters.manager import AdapterInUseError, AdapterManager
from loraplex.engine.block_manager import BASE_IDENTITY, BlockManager, cdiv
from loraplex.engine.config import EngineConfig
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.loader import DUMMY_CONFIGS, iter_safetensors, load_config, resolve_model
from loraplex.engine.model import LlamaModel
from loraplex.engine.model_runner import ModelRunner, StepResult, kv_cache_bytes_per_block
from loraplex.engine.request import Request, RequestOutput, RequestStatus, output_prefix
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput, is_stop_token
from loraplex.engine.structured_output import GrammarState, StructuredOutputs
from loraplex.kernels import attach_fused_shrink, cpu_greedy, pack_linears
from loraplex.kernels.cpu_gemm import available_memory_bytes
from loraplex.model_config import LORA_FUSED_GROUPS, ModelConfig

logger = logging.getLogger(__name__)


def pick_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_fast_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 GEMMs beat fp32; False
    when `LORAPLEX_CPU_ISA=avx2` holds the process to AVX2 (`loraplex.isa`)."""
    if isa.cap():
        return False
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": bf16 on CUDA and on CPUs with fast bf16 matmul, fp32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {sorted(names)}")
    return names[dtype]


def default_kv_cache_memory(device: torch.device, weight_bytes: int) -> int:
    """Bytes for the KV cache: 90% of free GPU memory after the weights (vLLM's default), 1 GiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(free * 0.9) - weight_bytes // 8, 256 << 20)
    return 1 << 30


class LLMEngine:
    """Requests in, token deltas out. See `loraplex.LLM` for the arguments."""

    def __init__(self, model: str = "smollm2-135m-instruct", *, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto", load_format: str = "auto", **engine_kwargs):
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.config = EngineConfig(**engine_kwargs)
        # PyTorch's CPU threads (None on a GPU)
        self.num_threads = threads.configure(self.config.num_threads) if self.device.type == "cpu" else None
        if load_format == "dummy":
            hf_cfg = DUMMY_CONFIGS[model] if model in DUMMY_CONFIGS else load_config(Path(model))
            path = None
        elif load_format == "auto":
            path = resolve_model(model)
            hf_cfg = load_config(path)
        else:
            raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
        self.model_name = model
        self.model_config = ModelConfig.from_hf_config(hf_cfg)
        if self.config.max_model_len:
            self.model_config.max_model_len = min(self.model_config.max_model_len, self.config.max_model_len)
        self.tokenizer = _load_tokenizer(path)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))

        self.model = LlamaModel.build(self.model_config, self.dtype, self.device)
        if path is None:
            _init_dummy(self.model, self.config.seed)
        else:
            self.model.load_hf_weights(iter_safetensors(path))
        self.model.eval()

        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        block_bytes = kv_cache_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        kv_bytes = self.config.kv_cache_memory or default_kv_cache_memory(self.device, weight_bytes)
        num_blocks = self.config.num_kv_blocks or kv_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {kv_bytes} bytes is smaller than one KV block ({block_bytes} bytes)")
        cfg = self.config
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.prefix_cache_scope)
        self.adapters = AdapterManager(self.model_config, max_lora_rank=cfg.max_lora_rank, max_loras=cfg.max_loras,
                                       max_cpu_loras=cfg.max_cpu_loras, dtype=self.dtype, device=self.device)
        base: list[tuple[nn.Linear, str]] = []  # every layer's base projections and their pack_linears kind
        for layer, buffers in zip(self.model.layers, self.adapters.buffers, strict=True):
            layer.self_attn.lora = {m: buffers[m] for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
            layer.mlp.lora = {m: buffers[m] for m in ("gate_proj", "up_proj", "down_proj")}
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            base += zip(linears, ("decoder", "decoder", "gate_up", "decoder"), strict=True)
            if self.device.type == "cpu" and self.config.max_loras:  # shrink inside the base GEMMs (kernels docs)
                for linear, group in zip(linears, LORA_FUSED_GROUPS, strict=True):
                    attach_fused_shrink(linear, [buffers[m] for m in group])
        if self.device.type == "cpu":  # decode-sized GEMMs on weights packed once (kernels/cpu_gemm.py)
            # the KV cache is allocated after this: its bytes are not there for the packed copies
            free = max(0, available_memory_bytes() - num_blocks * block_bytes)
            free -= pack_linears(base + [(self.model.lm_head, "lm_head")], memory_bytes=free)
            cpu_greedy.attach(self.model.lm_head, memory_bytes=free)  # greedy rows skip the logits where it can
        self.scheduler = Scheduler(self.config, self.block_manager, self.adapters, self.eos_token_ids,
                                   self.model_config.max_model_len)
        self.runner = ModelRunner(self.model, self.block_manager, self.dtype, self.device)
        self.requests: dict[str, Request] = {}
        self.num_requests_by_adapter: Counter[str] = Counter()  # unfinished requests (waiting or running)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.num_batched_rows = 0  # sum over steps of the requests scheduled in the step
        self.num_generated_tokens = 0
        # Test hook for fault isolation: called as inject_fault(stage, request) at "sample" (before the
        # request's token is sampled) and "update" (before it is appended and checked for a stop), where
        # what it raises is a fault of that request, and as inject_fault("forward", None) before each
        # forward pass, where it is a fault of the step. None in production.
        self.inject_fault: Callable[[str, Request | None], None] | None = None

    # requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    tenant_id: int | None = None, tenant_weight: float = 1.0) -> Request:
        """Queue a request. tenant_id and tenant_weight are its tenant and that tenant's fair-share weight
        (`loraplex.engine.fair_share`; no tenant is one tenant). Raises ValueError for an empty or too long
        prompt, out-of-vocabulary token ids or sampling values (a ParamError naming the field), a duplicate
        id, an unknown adapter or a weight that is not > 0 (nothing is queued)."""
        return self.add_requests([prompt_token_ids], [params or SamplingParams()], adapter,
                                 None if request_id is None else [request_id], tenant_id, tenant_weight)[0]

    def add_requests(self, prompts: list[list[int]], params: list[SamplingParams], adapter: str | None = None,
                     request_ids: list[str] | None = None, tenant_id: int | None = None,
                     tenant_weight: float = 1.0, *, shed: bool = False,
                     grammars: dict[int, object] | None = None) -> list[Request]:
        """Queue one call's requests (a prompt list, `n` choices) all or none: every one is checked as in
        `add_request` before any is queued. shed=True (a server) also raises EngineOverloadedError, with
        nothing queued, when the waiting queue has no room for them (`Scheduler.has_room`). grammars: the
        compiled matchers of the params' json_schemas by `id(schema)` (`AsyncLLM.compile_schemas`), so
        this thread only copies them; a schema not in it is compiled here."""
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter {adapter!r} is not loaded")
        if not (isinstance(tenant_weight, (int, float)) and 0 < tenant_weight < float("inf")):
            raise ValueError(f"tenant_weight must be a number > 0, got {tenant_weight!r}")
        ids = request_ids if request_ids is not None else [None] * len(prompts)
        reqs = [self._make_request(p, sp, adapter, rid, tenant_id, float(tenant_weight), grammars)
                for p, sp, rid in zip(prompts, params, ids, strict=True)]
        if len({r.request_id for r in reqs}) < len(reqs):
            raise ValueError("request ids within one call must be distinct")
        num_tokens = sum(r.num_prompt_tokens for r in reqs)
        if shed and not self.scheduler.has_room(len(reqs), num_tokens, tenant_id=tenant_id,
                                                tenant_weight=tenant_weight):
            sched, cfg = self.scheduler, self.config
            raise EngineOverloadedError(
                f"the engine's waiting queue is full: {len(sched.waiting)} requests with {sched.num_waiting_tokens} "
                f"tokens to prefill and an estimated wait of {sched.estimated_wait_s(len(reqs)):.1f} s (bounds "
                f"{cfg.max_num_waiting_seqs} beyond free places, {cfg.max_num_waiting_tokens} tokens, "
                f"{cfg.max_queue_wait_s} s)")
        if adapter is not None:
            self.adapters.forget_failure(adapter)  # a new request retries a load that failed before
        for req in reqs:
            self.requests[req.request_id] = req
            if adapter is not None:
                self.num_requests_by_adapter[adapter] += 1
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.sampling_params.stop)
            self.scheduler.add_request(req)
        return reqs

    def _make_request(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                      request_id: str | None, tenant_id: int | None, tenant_weight: float,
                      grammars: dict[int, object] | None = None) -> Request:
        """A checked, not yet queued request (ValueError as in `add_request`)."""
        n = len(prompt_token_ids)
        max_len = self.model_config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= max_len:
            raise ValueError(f"the prompt has {n} tokens, but the model's context is {max_len} tokens")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        need = min(n + params.max_tokens, max_len)
        if cdiv(need, self.block_manager.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs {need} tokens of "
                             f"KV cache, but the whole cache holds {capacity} tokens")
        if any(t < 0 or t >= self.model_config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        params.check_vocab(self.model_config.vocab_size)
        kwargs = {"request_id": request_id} if request_id is not None else {}
        identity = BASE_IDENTITY if adapter is None else self.adapters.identity(adapter)
        req = Request(list(prompt_token_ids), params, adapter=adapter, tenant_id=tenant_id,
                      tenant_weight=tenant_weight, kv_identity=identity, **kwargs)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if params.json_schema is not None:  # through AsyncLLM: compiled already, in a worker thread
            compiled = (grammars or {}).get(id(params.json_schema))
            req.grammar = GrammarState(compiled) if compiled is not None else self.structured.new_state(
                params.json_schema)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks and adapter pin are freed in this call. None if unknown."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._last_output(req)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter. KeyError if unknown; AdapterInUseError while any unfinished request (running or
        waiting) uses it."""
        if self.num_requests_by_adapter[name]:
            raise AdapterInUseError(f"adapter {name!r} is used by {self.num_requests_by_adapter[name]} "
                                    "unfinished request(s)")
        self.adapters.unregister(name)

    def _forget(self, req: Request) -> None:
        """`req` ended and its last output is built: drop it (idempotent)."""
        if self.requests.pop(req.request_id, None) is not None and req.adapter is not None:
            self.num_requests_by_adapter[req.adapter] -= 1
            if not self.num_requests_by_adapter[req.adapter]:
                del self.num_requests_by_adapter[req.adapter]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. Returns a delta for every request that produced a token or finished."""
        self.adapters.poll()  # loads that landed since the last step are admissible in this one
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.adapters.wait_for_loads(timeout=0.1)  # all that can run waits on adapter loads: no spinning
        result = StepResult()
        if not sched.is_empty:
            started = time.perf_counter()
            before_sample = None
            if self.inject_fault is not None:
                self.inject_fault("forward", None)
                before_sample = lambda r: self.inject_fault("sample", r)  # noqa: E731
            result = self.runner.execute(sched, self.adapters.slot_ranks, before_sample)
            self.scheduler.observe_step_time(sched, time.perf_counter() - started)
        self.num_steps += 1
        self.num_batched_rows += len(sched.requests)
        return self._update(sched, result)

    def _update(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        before_update = None if self.inject_fault is None else (lambda r: self.inject_fault("update", r))
        for rid, lps in result.prompt_logprobs.items():  # before any output of this step is built
            self.requests[rid].prompt_logprobs.extend(lps)
        update = self.scheduler.update_from_output(sched, result.tokens, result.errors, before_update)
        outputs = [self._last_output(req) for req in sched.aborted]
        self.num_generated_tokens += len(update.new_tokens)
        for req, token in update.new_tokens:
            lp = result.logprobs.get(req.request_id)
            if lp is not None:
                req.output_logprobs.append(lp)
            try:
                # A stop token is not detokenized; a stop string wins over length on the same token.
                if (self.tokenizer is not None and not is_stop_token(req, token, self.eos_token_ids)
                        and self.detokenizers[req.request_id].add_token(token)):
                    if req.is_finished:
                        req.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                outputs.append(self._output(req, [token]))
            except Exception as exc:
                outputs.append(self._fail(req, exc))
        outputs.extend(self._fail(req, exc) for req, exc in update.failed)
        return outputs

    def _last_output(self, req: Request) -> RequestOutput:
        """The last output of `req`, ended without a new token; if building it raises, `req` is forgotten
        all the same (a request left in self.requests would never end)."""
        try:
            return self._output(req, [])
        except Exception as exc:
            return self._fail(req, exc)

    def _fail(self, req: Request, exc: Exception) -> RequestOutput:
        """End `req` alone for a fault of its own; its last output carries the error."""
        logger.error("request %s failed and was aborted: %r", req.request_id, exc, exc_info=exc)
        req.error = f"{type(exc).__name__}: {exc}"
        if not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        else:  # finished by its stop check, then failed producing its output
            req.status = RequestStatus.FINISHED_ABORTED
        detok = self.detokenizers.pop(req.request_id, None)
        self._forget(req)
        return RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                             token_ids=list(req.output_token_ids), text=detok.text if detok else "",
                             finish_reason=req.finish_reason, adapter=req.adapter, error=req.error,
                             adapter_failed=req.adapter_failed, num_cached_tokens=max(0, req.num_cached_tokens),
                             prompt_logprobs=_prompt_logprobs(req, copy=True))

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        delta = detok.delta(req.is_finished)
        ttft = req.first_token_time - req.arrival_time if req.first_token_time else None
        latency = req.finish_time - req.arrival_time if req.finish_time else None
        asked, lps = req.sampling_params.logprobs is not None, req.output_logprobs
        if req.is_finished:
            del self.detokenizers[req.request_id]
            self._forget(req)
            token_ids, text, logprobs = list(req.output_token_ids), detok.text, list(lps) if asked else None
        else:  # built only if read: no per-step copy that grows with the output (RequestOutput)
            token_ids, text = output_prefix(req.output_token_ids), detok.snapshot()
            logprobs = output_prefix(lps) if asked else None
        delta_logprobs = lps[len(lps) - len(new_tokens):] if asked else None
        return RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                             token_ids=token_ids, text=text, finish_reason=req.finish_reason,
                             adapter=req.adapter, ttft_s=ttft, latency_s=latency, delta_text=delta,
                             delta_token_ids=new_tokens, error=req.error,
                             adapter_failed=req.adapter_failed, num_cached_tokens=max(0, req.num_cached_tokens),
                             logprobs=logprobs, delta_logprobs=delta_logprobs,
                             prompt_logprobs=_prompt_logprobs(req, copy=req.is_finished))


def _prompt_logprobs(req: Request, copy: bool) -> list | None:
    """What an output of `req` carries as `prompt_logprobs`: None unless asked; else its list, shared by
    its outputs while it runs (complete by its first token, and never appended to after: no per-step
    copy), copied in its last output."""
    if req.sampling_params.prompt_logprobs is None:
        return None
    return list(req.prompt_logprobs) if copy else req.prompt_logprobs


def _load_tokenizer(path: Path | None):
    if path is None or not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _init_dummy(model: LlamaModel, seed: int) -> None:
    """Small random weights (std 0.02, norms at 1): realistic magnitudes, no NaN, for benchmarks."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
