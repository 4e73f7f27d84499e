"""The HTTP system of the serving benchmark end to end: a real `loraplex serve` subprocess, two tenants
with their own random adapters, the `openai` client streaming; greedy text must match the in-process
engine's on the same prompts and adapters."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from loraplex.adapters.synthetic import write_random_adapter
from loraplex.bench.http_client import run_http
from loraplex.bench.workload import WorkloadSpec, generate

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", kv_cache_memory=64 << 20, max_loras=2, max_num_seqs=8)


def test_run_http_matches_the_engine(tmp_path):
    spec = WorkloadSpec(
        num_adapters=2, num_requests=6, rate=20, prompt_len=(4, 12), output_len=(3, 8), num_tenants=2
    )
    workload = generate(spec)
    assert {r.tenant for r in workload.requests} == {"tenant0", "tenant1"}

    llm = LLM(**ENGINE)
    dirs = {}
    for i, name in enumerate(spec.adapter_names()):
        dirs[name] = tmp_path / name
        write_random_adapter(dirs[name], llm.engine.model_config, r=8, alpha=16, seed=i, b_std=0.2)
        llm.load_adapter(name, dirs[name])
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in workload.requests
    ]
    expected = llm.generate(
        [r.prompt_token_ids for r in workload.requests],
        params,
        adapters=[r.adapter for r in workload.requests],
    )
    del llm

    env = {f"LORAPLEX_{k.upper()}": str(v) for k, v in ENGINE.items()}
    records, stats = run_http(workload, dirs, engine_env=env, log_path=tmp_path / "serve.log")

    assert len(records) == len(workload.requests)
    for rec, req, out in zip(records, workload.requests, expected, strict=True):
        assert rec.ok, (rec.error, (tmp_path / "serve.log").read_text()[-2000:])
        assert rec.adapter == req.adapter and rec.num_prompt_tokens == req.prompt_len
        assert rec.num_output_tokens == req.output_len == len(out.token_ids)
        assert req.arrival_s <= rec.first_token_s <= rec.finish_s
        assert rec.text == out.text
    assert stats.num_steps > 0 and stats.num_batched_rows >= stats.num_steps
    assert stats.adapter_hits + stats.adapter_misses > 0 and stats.num_preemptions == 0
    # CPU seconds over the replay: the server's (its engine made every token) and this process's (the client)
    assert stats.server_cpu_s > 0 and stats.client_cpu_s > 0
