"""The in-process systems a serving benchmark compares, each replaying a `Workload` in real time.

    engine      our engine, continuous batching: requests join the running batch at the next step
    static      our engine with `static_batching`: a new batch starts only when the last one is done
    base        our engine on the same workload with every adapter removed (the multi-adapter upper bound)
    peft        transformers + PEFT mixed-adapter `generate(adapter_names=...)`, static batches of the
                requests that have arrived (at most `batch_size`), each run to its longest row

Every system sees a request only once its arrival time has passed, decodes greedily and never stops on
EOS (each row makes exactly `output_len` tokens), so all of them do the same work. Times are
`time.perf_counter()` seconds from the start of the replay; TTFT includes the queueing.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch

from loraplex.bench.metrics import RequestRecord, RunStats
from loraplex.bench.workload import BenchRequest, Workload
from loraplex.engine.sampling_params import SamplingParams

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


def run_engine(llm, workload: Workload, *, static: bool = False) -> tuple[list[RequestRecord], RunStats]:
    """Replay `workload` through `llm.engine` (a `loraplex.LLM` whose adapters are loaded)."""
    engine = llm.engine
    was_static, engine.config.static_batching = engine.config.static_batching, static
    pending = deque(sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s))
    records = [RequestRecord(r.arrival_s, None, None, r.prompt_len, 0, r.adapter) for r in workload.requests]
    index_of: dict[str, int] = {}
    stats = RunStats(num_preemptions=engine.scheduler.num_preemptions)
    before = llm.adapter_stats()["tiers"]["slots"]
    start = time.perf_counter()
    try:
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and workload.requests[pending[0]].arrival_s <= now:
                i = pending.popleft()
                r = workload.requests[i]
                params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
                try:
                    index_of[engine.add_request(r.prompt_token_ids, params, r.adapter).request_id] = i
                except ValueError as exc:  # refused (too long for the KV cache, unknown adapter): its own failure
                    records[i].error = str(exc)
            if not engine.has_unfinished_requests():
                if pending:
                    time.sleep(max(0.0, workload.requests[pending[0]].arrival_s - now))
                continue
            outputs = engine.step()
            t = time.perf_counter() - start
            rows = 0
            for out in outputs:
                rec = records[index_of[out.request_id]]
                if out.delta_token_ids:
                    rows += 1
                    if rec.first_token_s is None:
                        rec.first_token_s = t
                if out.finished:
                    rec.finish_s, rec.token_ids = t, out.token_ids
                    rec.num_output_tokens = len(out.token_ids)
                    if out.finish_reason != "length" or rec.num_output_tokens != workload.requests[
                            index_of[out.request_id]].output_len:
                        rec.error = f"finished by {out.finish_reason!r} after {rec.num_output_tokens} tokens"
            if rows:
                stats.num_steps += 1
                stats.num_batched_rows += rows
    finally:
        engine.config.static_batching = was_static
        for rid in list(index_of):
            engine.abort_request(rid)
    after = llm.adapter_stats()["tiers"]["slots"]
    stats.adapter_hits = after["hits"] - before["hits"]
    stats.adapter_misses = after["misses"] - before["misses"]
    stats.num_preemptions = engine.scheduler.num_preemptions - stats.num_preemptions
    return records, stats


def warm_up_engine(llm, workload: Workload, num_requests: int = 32) -> None:
    """Untimed: the workload's first requests at once (8 tokens each), so the first timed steps do not pay
    for first-touch allocations of a large batch, and the most used adapters sit in their slots."""
    reqs = workload.requests[:num_requests]
    llm.generate([r.prompt_token_ids for r in reqs], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 adapters=[r.adapter for r in reqs])


def load_peft_model(model_path: Path, adapter_dirs: dict[str, Path], dtype: torch.dtype):
    """transformers + PEFT holding every adapter of `adapter_dirs` by name; EOS never stops a row."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    return model.to(dtype).eval()


class _StepClock:
    """A transformers StoppingCriteria that only records when each decoding step ends."""

    def __init__(self, start: float):
        self.start, self.times = start, []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter() - self.start)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_peft(model, workload: Workload, *, batch_size: int = 16) -> tuple[list[RequestRecord], RunStats]:
    """Static batches: take up to `batch_size` of the requests that have arrived, left-pad, generate to
    the batch's longest output, then the next batch. Row i's first token is the batch's first step, its
    finish the step that made its output_len-th token."""
    from transformers import StoppingCriteriaList

    pad = 2  # the default model's pad id; masked out by the attention mask either way
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)
    warm = reqs[:batch_size]  # untimed: one small batch pays the one-time costs, as the engine's warm-up does
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([r.prompt_token_ids[:4] + [pad] * (4 - min(4, r.prompt_len))
                                               for r in warm]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad, adapter_names=[r.adapter or BASE for r in warm])
    records = {id(r): RequestRecord(r.arrival_s, None, None, r.prompt_len, r.output_len, r.adapter) for r in reqs}
    stats, nxt = RunStats(), 0
    start = time.perf_counter()
    while nxt < len(reqs):
        now = time.perf_counter() - start
        if reqs[nxt].arrival_s > now:
            time.sleep(reqs[nxt].arrival_s - now)
            now = time.perf_counter() - start
        batch: list[BenchRequest] = []
        while nxt < len(reqs) and len(batch) < batch_size and reqs[nxt].arrival_s <= now:
            batch.append(reqs[nxt])
            nxt += 1
        width, max_new = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
        ids = torch.tensor([[pad] * (width - r.prompt_len) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch])
        clock = _StepClock(start)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=pad, adapter_names=[r.adapter or BASE for r in batch],
                                 stopping_criteria=StoppingCriteriaList([clock]))
        for row, r in enumerate(batch):
            rec = records[id(r)]
            rec.first_token_s, rec.finish_s = clock.times[0], clock.times[r.output_len - 1]
            rec.token_ids = out[row, width : width + r.output_len].tolist()
        stats.num_steps += max_new
        stats.num_batched_rows += max_new * len(batch)
    return [records[id(r)] for r in workload.requests], stats
