"""The in-process systems a serving benchmark compares, each replaying a `Workload` in real time.

    engine      our engine, continuous batching: requests join the running batch at the next step
    static      our engine with `static_batching`: a new batch starts only when the last one is done
    base        our engine on the same workload with every adapter removed (the multi-adapter upper bound)
    peft        transformers + PEFT mixed-adapter `generate(adapter_names=...)`, static batches of the
                requests that have arrived (at most `batch_size`), each run to its longest row

Every system sees a request only once its arrival time has passed, decodes greedily and never stops on
EOS (each row makes exactly `output_len` tokens), so all of them do the same work. Our engine also gets
each request's tenant, as `loraplex serve` gives it the caller's (`run_engine`'s `tenants`), so that it
schedules the same way in-process and behind the gateway. Times are
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


def run_engine(llm, workload: Workload, *, static: bool = False,
               tenants: bool = True) -> tuple[list[RequestRecord], RunStats]:
    """Replay `workload` through `llm.engine` (a `loraplex.LLM` whose adapters are loaded).

    tenants: queue each request under its tenant, numbered 1, 2, ... in name order, as the bench's HTTP
    server numbers the tenants it creates (`http_client.make_tenants`), so that the fair-share policy
    sees the same tenants in-process as behind the gateway; False: all under no tenant (one tenant:
    first come, first served within a priority), as an engine without tenants (vLLM) schedules."""
    engine = llm.engine
    was_static, engine.config.static_batching = engine.config.static_batching, static
    pending = deque(sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s))
    tenant_ids = {name: i + 1 for i, name in enumerate(sorted({r.tenant for r in workload.requests}))}
    records = [RequestRecord(r.arrival_s, None, None, r.prompt_len, 0, r.adapter) for r in workload.requests]
    index_of: dict[str, int] = {}
    stats = RunStats(num_preemptions=engine.scheduler.num_preemptions)
    before = llm.adapter_stats()["tiers"]["slots"]
    cpu0, start = time.process_time(), time.perf_counter()
    try:
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and workload.requests[pending[0]].arrival_s <= now:
                i = pending.popleft()
                r = workload.requests[i]
                params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
                try:
                    req = engine.add_request(r.prompt_token_ids, params, r.adapter,
                                             tenant_id=tenant_ids[r.tenant] if tenants else None)
                    index_of[req.request_id] = i
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
        stats.server_cpu_s = time.process_time() - cpu0  # this process: the engine's threads
    finally:
        engine.config.static_batching = was_static
        for rid in list(index_of):
            engine.abort_request(rid)
    after = llm.adapter_stats()["tiers"]["slots"]
    stats.adapter_hits = after["hits"] - before["hits"]
    stats.adapter_misses = after["misses"] - before["misses"]
    stats.num_preemptions = engine.scheduler.num_preemptions - stats.num_preemptions
    return records, stats


def warm_up_engine(llm, workload: Workload) -> None:
    """`workload.warm_up()` through `llm` (a `loraplex.LLM`), untimed."""
    reqs = workload.warm_up()
    llm.generate([r.prompt_token_ids for r in reqs],
                 [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs],
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


def peer_python(explicit: str | None = None) -> Path | None:
    """The peer's Python for the `vllm` systems: `explicit` (--peer-python), else `LORAPLEX_PEER_PYTHON`,
    else `.peer/vllm/bin/python` where `scripts/peer-vllm` puts it; None when the one asked for does not
    exist (an explicit path that is not a file is never replaced by a default: the run says vLLM is
    skipped rather than measure another vLLM than the one named)."""
    import os

    candidates = [explicit] if explicit else [os.environ.get("LORAPLEX_PEER_PYTHON"), ".peer/vllm/bin/python"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def vllm_peer_environ(workdir: Path) -> dict[str, str]:
    """The environment of the vLLM peer run from `workdir` (which holds its copy of vllm_peer.py):
    `threads.peer_environ()`, and under `LORAPLEX_CPU_ISA=avx2` a `sitecustomize.py` written there and put
    first on PYTHONPATH, so that every process of the peer (vLLM's engine core runs in its own) holds
    vLLM to its AVX2 library from the start (`vllm_peer.hold_to_avx2`)."""
    import os

    from loraplex import isa
    from loraplex.threads import peer_environ

    env = peer_environ()
    if isa.cap() == "avx2":
        (workdir / "sitecustomize.py").write_text("import vllm_peer\n\nvllm_peer.hold_to_avx2()\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(workdir), env.get("PYTHONPATH", "")) if p)
    return env


def run_vllm(python: Path, workload: Workload, adapter_dirs: dict[str, Path], *, model_dir: Path, dtype: str,
             threads: int, max_num_seqs: int, max_loras: int, max_lora_rank: int, workdir: Path,
             lora: bool = True, max_num_batched_tokens: int) -> tuple[list[RequestRecord], RunStats, str]:
    """`run_vllm_many` with one workload: (records, step counts, vLLM's version)."""
    [(records, stats)], version = run_vllm_many(
        python, [workload], adapter_dirs, model_dir=model_dir, dtype=dtype, threads=threads,
        max_num_seqs=max_num_seqs, max_loras=max_loras, max_lora_rank=max_lora_rank, workdir=workdir, lora=lora,
        max_num_batched_tokens=max_num_batched_tokens)
    return records, stats, version


def run_vllm_many(python: Path, workloads: list[Workload], adapter_dirs: dict[str, Path], *, model_dir: Path,
                  dtype: str, threads: int, max_num_seqs: int, max_loras: int, max_lora_rank: int, workdir: Path,
                  lora: bool = True, max_num_batched_tokens: int,
                  ) -> tuple[list[tuple[list[RequestRecord], RunStats]], str]:
    """Replay `workloads` through vLLM's offline engine in a subprocess of the peer's `python`
    (`vllm_peer.py`), with `enable_lora` and one LoRARequest per adapter (`lora`), or vLLM's base-only
    engine with LoRA off; the workloads run one after another in one vLLM engine (it loads and compiles
    once), with prefix caching off and our prefill chunk budget (`max_num_batched_tokens`), its threads
    bound to the first `threads` cores this process may use. vLLM's `max_lora_rank` is the workloads'
    largest rank rounded up to a power of two (at most `max_lora_rank`): vLLM's punica kernels pad every
    adapter to it, so a larger setting only slows vLLM down (64 for rank-8 adapters made it 5.7x slower
    on a 2-core CPU). Returns, per workload, the records and step counts, and vLLM's version. Raises
    RuntimeError with the peer's last output lines when it fails."""
    import json
    import os
    import subprocess

    def as_job(reqs: list[BenchRequest]) -> list[dict]:
        return [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len, "adapter": r.adapter,
                 "arrival_s": r.arrival_s} for r in reqs]

    every = [r for w in workloads for r in w.requests]
    longest = max(r.prompt_len + r.output_len for r in every)
    used = sorted({r.adapter for r in every if r.adapter is not None})
    if lora:  # vLLM pads every slot to max_lora_rank: give it the workload's largest rank, as a user would
        ranks = [json.loads((adapter_dirs[name] / "adapter_config.json").read_text())["r"] for name in used] or [8]
        max_lora_rank = min(max_lora_rank, max(8, 1 << (max(ranks) - 1).bit_length()))
    job = {"model": str(model_dir), "dtype": dtype, "threads": threads, "max_num_seqs": max_num_seqs,
           "max_model_len": max(512, -(-longest // 256) * 256), "max_loras": max_loras,
           "max_num_batched_tokens": max_num_batched_tokens, "cpus": sorted(os.sched_getaffinity(0))[:threads],
           "max_lora_rank": max_lora_rank,
           "adapters": {name: str(adapter_dirs[name]) for name in used} if lora else {},
           "warmup": as_job(workloads[0].warm_up()),  # the warm-up our engine gets
           "runs": [as_job(w.requests) for w in workloads]}
    job_path, result_path = workdir / "vllm-job.json", workdir / "vllm-result.json"
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    # A copy in workdir: the script's folder goes first on the peer's sys.path, and loraplex/bench is not
    # a folder the peer should import from.
    script = workdir / "vllm_peer.py"
    script.write_text(Path(__file__).with_name("vllm_peer.py").read_text())
    proc = subprocess.run([str(python), str(script), str(job_path), str(result_path)], capture_output=True, text=True,
                          env=vllm_peer_environ(workdir))
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"vLLM peer failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(result_path.read_text())
    out = []
    for workload, run in zip(workloads, result["runs"], strict=True):
        records = []
        for r, got in zip(workload.requests, run["records"], strict=True):
            rec = RequestRecord(r.arrival_s, got["first_token_s"], got["finish_s"], r.prompt_len,
                                len(got["token_ids"]), r.adapter, got["error"], got["token_ids"])
            if rec.error is None and rec.num_output_tokens != r.output_len:
                rec.error = f"finished after {rec.num_output_tokens} of {r.output_len} tokens"
            records.append(rec)
        out.append((records, RunStats(num_steps=run["num_steps"], num_batched_rows=run["num_batched_rows"],
                                      step_log=run["steps"])))
    return out, result["vllm"]
