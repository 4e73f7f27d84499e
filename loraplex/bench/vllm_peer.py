"""Replays a `loraplex bench` workload through vLLM's offline engine, for the `vllm` and `vllm-base`
systems. Run by the peer's Python (`scripts/peer-vllm`), not ours: it imports only vLLM and the
standard library, reads a job as JSON and writes one record per request as JSON.

    <peer python> vllm_peer.py job.json result.json

job: {"model": HF directory, "dtype", "threads", "cpus" (the cores to bind them to), "max_num_seqs",
"max_num_batched_tokens" (the prefill chunk budget, the same as ours), "max_model_len", "max_loras",
"max_lora_rank", "kv_cache_gib", "adapters": {name: PEFT directory} (empty: LoRA off, vLLM's
base-only engine), "warmup": [request], "runs": [[request]]}; request: {"prompt_token_ids",
"output_len", "adapter" (name or null), "arrival_s"}. The runs replay one after another in one engine.
result: {"vllm": version, "vllm_kernels" (the kernel libraries its processes loaded), "load_s", "runs": [{"records": [{"first_token_s", "finish_s", "token_ids",
"error"}], "num_steps", "num_batched_rows", "steps": [[seconds, rows that made a token, rows that made
their first]]}]}. Times are seconds from the start of the replay, as
`loraplex.bench.systems` measures ours; vLLM gets each request once its arrival time has passed
(`LLMEngine.add_request`), and its steps are driven by `LLMEngine.step`, as vLLM's own offline
`LLM.generate` does, so TTFT is seen per step.
"""

from __future__ import annotations

import json
import os
import sys
import time


def hold_to_avx2() -> bool:
    """Under `LORAPLEX_CPU_ISA=avx2` (loraplex/isa.py, inherited from the bench), make vLLM load its AVX2
    kernels (`vllm._C_AVX2`) on a CPU with AVX-512, as it does on an AVX2-only one: vLLM 0.32's
    `CpuPlatform.import_kernels` picks the library by `torch.cpu._is_avx512_supported()` and
    `_is_avx512_bf16_supported()`, which read the CPU, not `ATEN_CPU_CAPABILITY` (that variable, and
    `ONEDNN_MAX_CPU_ISA`, come with the environment and hold PyTorch's and oneDNN's own kernels). Call
    before vLLM is imported, in every process of the peer: vLLM's engine core runs in a process of its own,
    which a patch in this one alone did not reach (it mapped `_C`), so the bench runs it from a
    `sitecustomize` beside this script (`systems.vllm_peer_environ`). True if it held them."""
    if os.environ.get("LORAPLEX_CPU_ISA", "").strip().lower() != "avx2":
        return False
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    return True


def vllm_kernels() -> list[str]:
    """The vLLM kernel libraries (`_C`, `_C_AVX512`, `_C_AVX2`, from the `.abi3.so` names) mapped into this
    process and its descendants (vLLM's engine core runs in a child), sorted; read from /proc (Linux), []
    where it cannot be read."""
    root = os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        for name in ("_C", "_C_AVX512", "_C_AVX2"):
            if f"/vllm/{name}.abi3.so" in maps:
                found.add(name)
    return sorted(found)


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    threads = int(job["threads"])
    # vLLM's CPU worker binds one OpenMP thread per listed core; the KV cache is sized in GiB.
    cpus = job.get("cpus") or list(range(threads))  # cores this process may use: a cpuset or taskset holds
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cpus[:threads]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 4)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    held = hold_to_avx2()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    lora = bool(job["adapters"])
    kwargs = dict(enable_lora=True, max_loras=job["max_loras"], max_lora_rank=job["max_lora_rank"]) if lora else {}
    # Prefix caching off: loraplex has none yet (issue 20), and vLLM's would serve the timed run's first
    # prompts from the warm-up's KV blocks.
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              enable_prefix_caching=False, seed=0, **kwargs)
    engine = llm.llm_engine
    ids = {name: i + 1 for i, name in enumerate(sorted(job["adapters"]))}
    loras = {name: LoRARequest(name, ids[name], path) for name, path in job["adapters"].items()}
    load_s = time.perf_counter() - t0
    kernels = vllm_kernels()
    if held and kernels != ["_C_AVX2"]:  # the switch above missed (vLLM changed how it picks): say so, not a wrong table
        raise RuntimeError(f"LORAPLEX_CPU_ISA=avx2, but vLLM's processes loaded {kernels or 'no kernel library'}, "
                           "not only vllm._C_AVX2")

    def replay(requests: list[dict]) -> dict:
        records = [{"first_token_s": None, "finish_s": None, "token_ids": [], "error": None} for _ in requests]
        pending = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"])
        steps = rows = 0
        log = []
        start = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and requests[pending[0]]["arrival_s"] <= now:
                i = pending.pop(0)
                r = requests[i]
                params = SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True)
                try:
                    engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]}, params,
                                       lora_request=loras.get(r["adapter"]) if r["adapter"] else None)
                except Exception as exc:  # refused: that request's own failure, as in our runner
                    records[i]["error"] = f"{type(exc).__name__}: {exc}"
            if not engine.has_unfinished_requests():
                if pending:
                    time.sleep(max(0.0, requests[pending[0]]["arrival_s"] - now))
                continue
            before = time.perf_counter() - start
            outputs = engine.step()
            t = time.perf_counter() - start
            made = firsts = 0
            for out in outputs:
                rec = records[int(out.request_id)]
                tokens = list(out.outputs[0].token_ids)
                if tokens and rec["first_token_s"] is None:
                    rec["first_token_s"] = t
                    firsts += 1
                if len(tokens) > len(rec["token_ids"]):
                    made += 1
                rec["token_ids"] = tokens
                if out.finished:
                    rec["finish_s"] = t
            if made:
                steps += 1
                rows += made
            log.append([t - before, made, firsts])
        return {"records": records, "num_steps": steps, "num_batched_rows": rows, "steps": log}

    if job.get("warmup"):
        replay(job["warmup"])
    result = {"vllm": vllm.__version__, "vllm_kernels": kernels, "load_s": load_s, "runs": [replay(run) for run in job["runs"]]}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
