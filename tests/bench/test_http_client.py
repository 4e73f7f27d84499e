"""The HTTP system of the serving benchmark end to end: a real `loraplex serve` subprocess, two tenants
with their own random adapters, the bench's aiohttp client streaming; greedy text must match the in-process
engine's on the same prompts and adapters; and the client's SSE reader on each way a stream can fail."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from loraplex.adapters.synthetic import write_random_adapter
from loraplex.bench.http_client import run_http
from loraplex.bench.workload import WorkloadSpec, generate

ENGINE = dict(dtype="float32", kv_cache_memory=64 << 20, max_loras=2, max_num_seqs=8)


@pytest.mark.slow
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


def test_stream_records_every_failure_as_the_requests_error():
    """The bench client's SSE reader against a real aiohttp server: a refused request, an `error` event in
    the stream (followed by usage and [DONE], as our server sends them), a stream cut before its usage
    chunk and a usage chunk without completion_tokens each become the record's error, never the run's; a
    whole stream, written in pieces that split its lines, with a comment line and `data:` without a
    space, gives its text, first-token time and completion tokens."""
    import asyncio
    import json
    import time

    import aiohttp
    from aiohttp import web

    from loraplex.bench.http_client import _stream
    from loraplex.bench.workload import BenchRequest

    def sse(*events) -> bytes:
        return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)

    chunk = {"choices": [{"index": 0, "text": "Hi", "finish_reason": None}], "usage": None}
    last = {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    whole = b": a comment line\n\n" + sse(chunk).replace(b"data: ", b"data:") + sse(last, usage, b"[DONE]")
    bodies = {
        "ok": [whole[:7], whole[7:40], whole[40:41], whole[41:]],  # pieces that cut lines, and "data" itself
        "error": [sse(chunk, {"error": {"message": "The engine failed", "code": "engine_error"}}, usage, b"[DONE]")],
        "cut": [sse(chunk, last)],
        "bad usage": [sse(chunk, last, {"choices": [], "usage": {"prompt_tokens": 3}}, b"[DONE]")],
    }

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True and body["ignore_eos"] is True and body["prompt"] == [1, 2, 3]
        if body["model"] == "refused":
            return web.json_response({"error": {"message": "no", "code": "model_not_found"}}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in bodies[body["model"]]:
            await resp.write(piece)
            await asyncio.sleep(0.01)  # each piece its own TCP read
        await resp.write_eof()
        return resp

    async def main() -> tuple[dict, float]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            async with aiohttp.ClientSession(base_url=f"http://{host}:{port}") as session:
                start = time.perf_counter()
                return {m: await _stream(session, "base", BenchRequest(0.0, "t", m, [1, 2, 3], 2), start)
                        for m in ("ok", "refused", "error", "cut", "bad usage")}, time.perf_counter() - start
        finally:
            await runner.cleanup()

    recs, elapsed = asyncio.run(main())
    ok = recs["ok"]
    assert ok.ok and ok.text == "Hi!" and ok.num_output_tokens == 2
    assert 0.02 <= ok.first_token_s < ok.finish_s < elapsed  # "Hi" ends in the last piece, after three sleeps
    assert recs["refused"].error.startswith("HTTP 404: ") and "model_not_found" in recs["refused"].error
    assert recs["error"].error == "error event: {'message': 'The engine failed', 'code': 'engine_error'}"
    assert recs["cut"].error == "the stream ended without a finish_reason and a usage chunk"
    assert recs["bad usage"].error == "KeyError: 'completion_tokens'"
    assert not any(recs[m].ok for m in ("refused", "error", "cut", "bad usage"))
