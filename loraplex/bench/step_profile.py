"""Where one engine step's time goes: `python -m loraplex.bench.step_profile --threads 1`.

Puts the engine in a steady state (B requests decoding, each with about `context` tokens of context,
over 16 rank-8 adapters on q/k/v/o, or the base model alone) and times `steps` decode steps, then one
prefill chunk of `max_num_batched_tokens` tokens, with wall-clock timers wrapped around the engine's own
functions for the run (the CPU runs them synchronously, so a wrapped call's wall time is its cost):

    base GEMMs      the q/k/v, o, gate/up and down projections on a base-only step (F.linear, or the
                    GEMM on a packed weight (ours on AVX2 or AVX-512, oneDNN or MKL), `kernels/cpu_gemm.py`;
                    with our GEMM, the gate/up one applies SiLU x up in its epilogue, which is counted here)
    LoRA            the same projections with adapters, minus their base-only time (on the CPU the
                    shrink of some adapters runs inside the base GEMM, so only the difference is LoRA)
    attention       `paged_attention`: writing this step's K/V and attending
    lm_head         `compute_logits` on the sampled rows, and `greedy_tokens` on the greedy ones where the
                    lm_head's bf16 screen finds their tokens without the logits (`kernels/cpu_greedy.py`)
    norms, RoPE...  the rest of the forward pass: embedding, RMSNorm, RoPE, SiLU x up, residual adds
    metadata        `ModelRunner.prepare`: the step's tensors built in Python (positions, slot mapping,
                    block tables, LoRA segments)
    sampling        `sample_rows`
    scheduling      `Scheduler.schedule` and `update_from_output`
    the rest        the step's total minus all of the above: detokenization, outputs, Python glue

Prints one Markdown table (milliseconds per step, and the share of the step) with the machine's CPU
flags, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from loraplex.bench import report

ROWS = ("base GEMMs", "LoRA", "attention", "lm_head", "norms, RoPE, SiLU, residual", "metadata (Python)",
        "sampling", "scheduling", "the rest (detokenize, outputs, glue)")


class Timers:
    """Accumulated wall seconds and calls per name while `patched()` is active (the decoder layers then run
    their pieces through Python, not as one `decoder_layer` call, so that each piece is timed). `seconds`
    is per step after `steady_decode`; `calls` is always the total over the timed steps."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        """`fn` timed under `name`; a call inside another of the same name (the base GEMM inside
        `lora_linear`) is not counted twice."""

        def timed(*args, **kwargs):
            self.depth[name] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth[name] -= 1
                if not self.depth[name]:
                    self.seconds[name] += time.perf_counter() - t0
                    self.calls[name] += 1

        return timed

    @contextlib.contextmanager
    def patched(self, engine):
        from loraplex.engine import attention as attention_mod
        from loraplex.engine import model as model_mod
        from loraplex.engine import model_runner as runner_mod
        from loraplex.kernels import cpu_gemm as cpu_gemm_mod

        lm_head = engine.model.lm_head
        linear_forward = nn.Linear.forward
        timed_linear = self.wrap("projections", linear_forward)
        base_linear = model_mod.base_linear  # the packed-weight GEMMs go around nn.Linear.forward
        timed_base = self.wrap("projections", base_linear)

        def linear(mod, x):
            return linear_forward(mod, x) if mod is lm_head else timed_linear(mod, x)

        def base(mod, x):
            return base_linear(mod, x) if mod is lm_head else timed_base(mod, x)

        # Calls that go around base_linear and paged_attention, which were counted in the forward's rest
        # until 2026-12-07: silu_mul_linear (the gate/up GEMM with SiLU x up in its epilogue, our packed
        # GEMM) and, in the last layer of a step that samples some rows only, linear_columns (q/k/v's
        # columns) and paged_attention_rows. Each entry: (object, attribute, timer name; None: the base
        # GEMM's own wrapper above, which leaves the lm_head out).
        patches = [(model_mod, "paged_attention", "attention"), (model_mod, "lora_linear", "projections"),
                   (model_mod, "base_linear", None), (model_mod, "silu_mul_linear", "projections"),
                   (cpu_gemm_mod, "linear_columns", "projections"),
                   (attention_mod, "paged_attention_rows", "attention"), (runner_mod, "sample_rows", "sampling"),
                   (engine.runner, "prepare", "metadata"), (engine.model, "compute_logits", "lm_head"),
                   (engine.model, "greedy_tokens", "lm_head"), (engine.scheduler, "schedule", "scheduling"),
                   (engine.scheduler, "update_from_output", "scheduling")]
        originals = [getattr(obj, attr) for obj, attr, _ in patches]
        fused_layer = model_mod.FUSED_LAYER
        try:
            model_mod.FUSED_LAYER = False  # each piece through its Python call, where the wrappers time it
            nn.Linear.forward = linear
            for (obj, attr, name), fn in zip(patches, originals, strict=True):
                setattr(obj, attr, base if name is None else self.wrap(name, fn))
            engine.model.forward = self.wrap("forward", engine.model.forward)
            yield self
        finally:
            model_mod.FUSED_LAYER = fused_layer
            nn.Linear.forward = linear_forward
            for (obj, attr, _), fn in zip(patches, originals, strict=True):
                if isinstance(obj, type(model_mod)):
                    setattr(obj, attr, fn)
                else:
                    delattr(obj, attr)  # the instance's own attribute goes; the class's method shows again
            del engine.model.forward


def decode_out_len(rows: int, context: int, steps: int, chunk: int) -> int:
    """Output tokens each of `rows` requests (of `context` prompt tokens, arriving at once) asks for so that
    all of them still decode together for `steps` steps after the last prefill. A request whose prefill is
    done decodes in each later prefill step, so a shorter output ends before the timed steps: with
    steps + 8 tokens, what this profile asked for until 2026-12-05, 8 timed steps of "64 rows" of 170
    tokens decoded 224 rows in all, 28 a step. The prefills take at most rows x context / (chunk - rows)
    steps: each step's `chunk` tokens go first to the decodes, at most `rows` of them."""
    return steps + 2 + -(-rows * context // max(1, chunk - rows))


def steady_decode(llm, rows: int, context: int, adapters: list[str] | None, steps: int) -> tuple[Timers, float]:
    """`rows` requests prefilled to `context` tokens, then `steps` decode steps timed; (timers, step s).
    Raises RuntimeError if a timed step did not decode all `rows` requests."""
    from loraplex.engine.sampling_params import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(rows)
    vocab = engine.model_config.vocab_size
    out_len = decode_out_len(rows, context, steps, engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    ids = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        adapter = adapters[i % len(adapters)] if adapters else None
        ids.append(engine.add_request(prompt, params, adapter).request_id)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode step after the prefills
    timers = Timers()
    batched = engine.num_batched_rows
    with timers.patched(engine):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    decoded = engine.num_batched_rows - batched
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    if decoded != rows * steps:
        raise RuntimeError(f"the timed steps decoded {decoded} rows, not {steps} x {rows}")
    timers.seconds = defaultdict(float, {k: v / steps for k, v in timers.seconds.items()})
    return timers, total / steps


def one_prefill(llm, tokens: int, adapters: list[str] | None) -> tuple[Timers, float]:
    """One request whose first prefill chunk is `tokens` tokens; that step timed."""
    from loraplex.engine.sampling_params import SamplingParams

    engine = llm.engine
    prompt = torch.randint(0, engine.model_config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(7))
    rid = engine.add_request(prompt.tolist(), SamplingParams(max_tokens=1, temperature=0),
                             adapters[0] if adapters else None).request_id
    timers = Timers()
    with timers.patched(engine):
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return timers, total


def vllm_steps(python: Path, rows: list[int], context: int, steps: int, chunk: int, model: str, dtype: str,
               threads: int, adapter_dirs: dict[str, Path], workdir: Path) -> dict[str, tuple[float, float]]:
    """vLLM's step times on the same shapes, by column: (with adapters, base only) seconds. A decode step
    is the median of vLLM's steps in which all `rows` requests (of `context` prompt tokens, arriving at
    once) made a token and none made its first: pure decode steps, timed around `LLMEngine.step`; a
    prefill chunk is the TTFT of one `chunk`-token prompt."""
    from statistics import median

    from loraplex.bench.systems import run_vllm_many
    from loraplex.bench.workload import BenchRequest, Workload
    from loraplex.engine.loader import resolve_model

    names = sorted(adapter_dirs)
    gen = torch.Generator().manual_seed(3)

    def workload(n: int, prompt_len: int, out_len: int, lora: bool) -> Workload:
        return Workload(None, [BenchRequest(0.0, "t", names[i % len(names)] if lora else None,
                                            torch.randint(0, 49152, (prompt_len,), generator=gen).tolist(), out_len)
                               for i in range(n)])

    by_mode = []
    for lora in (True, False):  # one vLLM engine per mode runs every shape
        works = [workload(n, context, decode_out_len(n, context, steps, chunk), lora) for n in rows] + [
            workload(1, chunk, 1, lora)]
        runs, _ = run_vllm_many(python, works, adapter_dirs, model_dir=resolve_model(model), dtype=dtype,
                                threads=threads, max_num_seqs=64, max_loras=16, max_lora_rank=8, workdir=workdir,
                                lora=lora, max_num_batched_tokens=chunk)
        times = [median(s for s, made, firsts in stats.step_log if made == n and not firsts)
                 for n, (_, stats) in zip(rows, runs[:-1], strict=True)]
        by_mode.append(times + [runs[-1][0][0].first_token_s])
    heads = [f"decode, {n} rows" for n in rows] + [f"prefill chunk, {chunk} tokens"]
    return {h: (with_lora, base) for h, with_lora, base in zip(heads, *by_mode, strict=True)}


def breakdown(lora: Timers, lora_step: float, base: Timers, base_step: float) -> dict[str, float]:
    """Seconds per step by ROWS, from a step with adapters and the same step on the base model alone."""
    s, b = lora.seconds, base.seconds
    gemm = b["projections"]
    inner = s["projections"] + s["attention"]
    out = {"base GEMMs": gemm, "LoRA": max(0.0, s["projections"] - gemm), "attention": s["attention"],
           "lm_head": s["lm_head"], "norms, RoPE, SiLU, residual": max(0.0, s["forward"] - inner),
           "metadata (Python)": s["metadata"], "sampling": s["sampling"], "scheduling": s["scheduling"]}
    out["the rest (detokenize, outputs, glue)"] = max(0.0, lora_step - sum(out.values()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loraplex.bench.step_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default="1,16,64", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=170, help="tokens of context per decoding request")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    ap.add_argument("--attention", choices=("auto", "torch"), default="auto",
                    help="torch: the PyTorch attention path instead of the compiled kernel (what the kernel buys)")
    ap.add_argument("--peer-python", help="vLLM's Python (scripts/peer-vllm): adds vLLM's step times on the same "
                                          "shapes; default $LORAPLEX_PEER_PYTHON or .peer/vllm/bin/python if present")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from loraplex import LLM
    from loraplex.adapters.synthetic import write_random_adapter

    if args.attention == "torch":
        from loraplex.engine import attention

        attention.cpu_ext.load = lambda: None
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, max_loras=16, max_cpu_loras=16, max_num_seqs=64,
              num_threads=args.threads, enable_prefix_caching=False)
    names = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(16):
            path = Path(tmp) / f"a{i}"
            write_random_adapter(path, llm.engine.model_config, r=8, alpha=16,
                                 targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=i)
            llm.load_adapter(f"a{i}", path)
            names.append(f"a{i}")
        steady_decode(llm, 16, args.context, names, 2)  # warm-up: slots filled, first-touch allocations
        columns = {}
        for rows in (int(r) for r in args.rows.split(",")):
            lt, ls = steady_decode(llm, rows, args.context, names, args.steps)
            bt, bs = steady_decode(llm, rows, args.context, None, args.steps)
            columns[f"decode, {rows} rows"] = (breakdown(lt, ls, bt, bs), ls, bs)
        chunk = llm.engine.config.max_num_batched_tokens
        lt, ls = one_prefill(llm, chunk, names)
        bt, bs = one_prefill(llm, chunk, None)
        columns[f"prefill chunk, {chunk} tokens"] = (breakdown(lt, ls, bt, bs), ls, bs)
        from loraplex.bench.systems import peer_python

        peer = peer_python(args.peer_python)
        vllm = {} if peer is None else vllm_steps(
            peer, [int(r) for r in args.rows.split(",")], args.context, args.steps, chunk, "smollm2-135m-instruct",
            args.dtype, args.threads, {n: Path(tmp) / n for n in names}, Path(tmp))
    print(f"machine: {report.machine()}; CPU flags: {report.cpu_flags()}; {args.dtype}, {args.threads} thread(s), "
          f"context {args.context}, 16 rank-8 adapters on q/k/v/o, attention {args.attention}; "
          f"commit {report.commit()}; pid {os.getpid()}\n")
    heads = list(columns)
    print("| ms per step (share) | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for row in ROWS:
        cells = [f"{columns[h][0][row] * 1e3:.1f} ({columns[h][0][row] / columns[h][1]:.0%})" for h in heads]
        print(f"| {row} | " + " | ".join(cells) + " |")
    print("| **step, with adapters** | " + " | ".join(f"**{columns[h][1] * 1e3:.1f}**" for h in heads) + " |")
    print("| step, base model only | " + " | ".join(f"{columns[h][2] * 1e3:.1f}" for h in heads) + " |")
    if vllm:
        print("| vLLM step, with adapters | " + " | ".join(f"{vllm[h][0] * 1e3:.1f}" for h in heads) + " |")
        print("| vLLM step, base model only (LoRA off) | " + " | ".join(f"{vllm[h][1] * 1e3:.1f}" for h in heads) + " |")
    else:
        print("\nvLLM: not installed (scripts/peer-vllm), so no vLLM figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
