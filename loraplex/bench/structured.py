"""`loraplex bench --preset structured`: what a JSON Schema constrained row costs (issue 21).

Two measurements, on the default model in one process:
- **Throughput with 0%, 50% and 100% constrained rows**, the same workload otherwise: `num_requests`
  chat prompts run together, `max_tokens` greedy output tokens each. The constrained rows follow
  `LIST_SCHEMA`, an array of at least 40 objects, so they too run to max_tokens ("length") and every
  run produces the same number of tokens in the same batch shape; the plain rows run with `ignore_eos`.
  Reported: output tokens/s, steps, and the time inside `apply_grammar_masks_` (fill each constrained
  row's bitmask, unpack it, mask its logits) per step and per constrained row. Runs alternate 0/50/100%
  `repeats` times; pooled.
- **Compile time per schema**, cold (a schema the engine has not seen) and cached, with the per-request
  matcher copy and one mask fill, for llguidance (ours) and, when it is installed, xgrammar beside it
  (the comparison behind choosing llguidance; `pip install xgrammar` to include it).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loraplex.bench.report import commit, cpu_flags, machine

LIST_SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0},
                   "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 18, "maximum": 130},
    "role": {"enum": ["admin", "user", "guest"]},
    "pets": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"kind": {"type": "string"}, "legs": {"type": "integer", "minimum": 0}},
        "required": ["kind", "legs"], "additionalProperties": False}}},
    "required": ["name", "age", "role", "pets"], "additionalProperties": False}
ORDER = {"type": "object", "$defs": {"line": {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
    "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "properties": {"id": {"type": "string"}, "lines": {"type": "array", "items": {"$ref": "#/$defs/line"},
                                                       "minItems": 1, "maxItems": 20},
                   "status": {"enum": ["new", "paid", "shipped"]}},
    "required": ["id", "lines", "status"], "additionalProperties": False}
WIDE = {"type": "object", "properties": {f"field_{i}": {"enum": [f"v{i}_{j}" for j in range(50)]} for i in range(60)},
        "required": [f"field_{i}" for i in range(60)], "additionalProperties": False}
SCHEMAS = {"json_object": {"type": "object"}, "person (nested, enum, bounds)": PERSON,
           "order ($ref, pattern, number)": ORDER, "wide (60 enums of 50)": WIDE, "list (the throughput rows')": LIST_SCHEMA}
PEOPLE = ["Ann (31, admin)", "Bob (45, user)", "Eve (28, guest)", "Tom (70, user)", "Lin (39, admin)",
          "Sam (22, guest)", "Kim (51, user)", "Raj (33, admin)"]


@dataclass(frozen=True)
class StructuredSpec:
    num_requests: int = 32
    max_tokens: int = 64
    fractions: tuple[float, ...] = (0.0, 0.5, 1.0)
    repeats: int = 4
    dtype: str = "auto"


@dataclass
class Run:
    fraction: float
    num_tokens: int
    seconds: float
    num_steps: int
    mask_s: float  # inside apply_grammar_masks_
    num_masked_rows: int  # constrained rows masked, summed over steps
    finish: dict[str, int] = field(default_factory=dict)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        people = ", ".join(PEOPLE[(i + k) % len(PEOPLE)] for k in range(3))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"List these people as JSON: {people}."}],
                                            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_throughput(spec: StructuredSpec, threads: int) -> tuple[list[Run], str]:
    """The 0/50/100% runs; returns them and the engine's dtype."""
    from loraplex import LLM, SamplingParams
    from loraplex.engine import sampler

    llm = LLM(dtype=spec.dtype, num_threads=threads, max_num_seqs=spec.num_requests, enable_prefix_caching=False)
    prompts = _prompts(llm.tokenizer, spec.num_requests)
    timing = {"s": 0.0, "rows": 0}
    masks = sampler.apply_grammar_masks_

    def timed(logits, requests):
        started = time.perf_counter()
        out = masks(logits, requests)
        timing["s"] += time.perf_counter() - started
        timing["rows"] += sum(r.grammar is not None for r in requests)
        return out

    sampler.apply_grammar_masks_ = timed
    plain = SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True, json_schema=LIST_SCHEMA)
    llm.generate(prompts[:4], [constrained, plain] * 2)  # warm-up, and the schema compiled
    runs = []
    try:
        for rep in range(spec.repeats):
            for fraction in spec.fractions:
                every = round(1 / fraction) if fraction else 0
                params = [constrained if every and i % every == 0 else plain for i in range(spec.num_requests)]
                timing.update(s=0.0, rows=0)
                steps = llm.engine.num_steps
                started = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - started
                finish: dict[str, int] = {}
                for o in outs:
                    finish[o.finish_reason] = finish.get(o.finish_reason, 0) + 1
                runs.append(Run(fraction, sum(len(o.token_ids) for o in outs), seconds, llm.engine.num_steps - steps,
                                timing["s"], timing["rows"], finish))
                print(f"structured: {fraction:.0%} constrained, run {rep + 1}: {runs[-1].num_tokens / seconds:.1f} "
                      "tokens/s", flush=True)
    finally:
        sampler.apply_grammar_masks_ = masks
    return runs, str(llm.engine.dtype).removeprefix("torch.")


def _median_us(f, n: int = 50) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        f()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def compile_times(tokenizer, vocab_size: int, eos: list[int]) -> tuple[list[dict], float, float | None]:
    """Per schema: llguidance (cold compile ms, cached us, per-request copy us, first mask fill us) and, if
    installed, xgrammar (compile ms, matcher us, fill us). Also each library's one-time tokenizer set-up (s)."""
    from loraplex.engine.structured_output import StructuredOutputs

    started = time.perf_counter()
    so = StructuredOutputs(tokenizer, vocab_size, eos)
    so.compile({"type": "boolean"})  # builds the tokenizer once
    ll_setup = time.perf_counter() - started
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    xgr_setup = None
    if xgr is not None:
        started = time.perf_counter()
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size),
                                       cache_enabled=False)
        xgr_setup = time.perf_counter() - started
    words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    rows = []
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        matcher = so.compile(schema)
        row = {"schema": name, "ll_compile_ms": (time.perf_counter() - started) * 1e3,
               "ll_cached_us": _median_us(lambda s=schema: so.compile(s)),
               "ll_copy_us": _median_us(lambda m=matcher: m.deep_copy())}
        copy = matcher.deep_copy()
        row["ll_fill_us"] = _median_us(lambda m=copy: m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes))
        if xgr is not None:
            import json

            started = time.perf_counter()
            try:
                compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            except RuntimeError as exc:
                row["xgr_error"] = str(exc).splitlines()[0][-80:]
            else:
                row["xgr_compile_ms"] = (time.perf_counter() - started) * 1e3
                row["xgr_matcher_us"] = _median_us(lambda c=compiled: xgr.GrammarMatcher(c))
                bitmask = xgr.allocate_token_bitmask(1, vocab_size)
                m = xgr.GrammarMatcher(compiled)
                row["xgr_fill_us"] = _median_us(lambda m=m, b=bitmask: m.fill_next_token_bitmask(b, 0))
        rows.append(row)
    return rows, ll_setup, xgr_setup


def write_report(out: Path, runs: list[Run], compiles: tuple[list[dict], float, float | None], spec: StructuredSpec,
                 *, command: str, threads: int, dtype: str) -> None:
    import llguidance

    rows, ll_setup, xgr_setup = compiles
    lines = [
        "# Structured output: what a constrained row costs",
        "",
        f"Command: `{command}` · commit {commit()} · {machine()} · CPU flags: {cpu_flags()} · dtype {dtype}, "
        f"{threads} engine threads · in process (`LLM`), llguidance {llguidance.get_version()}",
        "",
        f"Workload (`loraplex/bench/structured.py`): {spec.num_requests} chat prompts run together, "
        f"{spec.max_tokens} greedy output tokens each; constrained rows follow an array-of-objects schema with "
        "minItems 40 (so they also run to max_tokens and every run has the same tokens and batch shape), plain rows "
        f"run with `ignore_eos`. 50% is every other row. Runs alternate 0/50/100%, {spec.repeats} of each, pooled.",
        "",
        "| constrained rows | output tokens | tokens/s | vs 0% | steps | mask time per step (ms) | "
        "mask time per constrained row and step (us) | finish reasons |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = None
    for fraction in spec.fractions:
        mine = [r for r in runs if r.fraction == fraction]
        tokens, seconds = sum(r.num_tokens for r in mine), sum(r.seconds for r in mine)
        steps, mask_s, masked = sum(r.num_steps for r in mine), sum(r.mask_s for r in mine), sum(
            r.num_masked_rows for r in mine)
        rate = tokens / seconds
        base = rate if fraction == 0 else base
        finish: dict[str, int] = {}
        for r in mine:
            for k, v in r.finish.items():
                finish[k] = finish.get(k, 0) + v
        per_row = f"{mask_s / masked * 1e6:.0f}" if masked else "–"
        lines.append(f"| {fraction:.0%} | {tokens} | {rate:.1f} | {rate / base:.3f}x | {steps} | "
                     f"{mask_s / steps * 1e3:.2f} | {per_row} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(finish.items()))} |")
    lines += [
        "",
        "## Compile time per schema",
        "",
        f"One-time tokenizer set-up: llguidance {ll_setup:.2f} s"
        + (f", xgrammar {xgr_setup:.2f} s." if xgr_setup is not None else " (xgrammar not installed)."),
        "llguidance: *compile* is `StructuredOutputs.compile` on a schema it has not seen (to grammar, validate, "
        "build the matcher, probe its first masks and forced tokens), *cached* the same call after, *copy* the per-request "
        "matcher (`deep_copy`), *fill* one mask at the start. xgrammar: `compile_json_schema` (compact JSON, its "
        "cache off), `GrammarMatcher` per request, `fill_next_token_bitmask`. Medians of 50 where in us.",
        "",
        "| schema | llguidance compile (ms) | cached (us) | copy (us) | fill (us) | xgrammar compile (ms) | "
        "matcher (us) | fill (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "xgr_compile_ms" in r:
            x = f"{r['xgr_compile_ms']:.1f} | {r['xgr_matcher_us']:.0f} | {r['xgr_fill_us']:.0f}"
        elif "xgr_error" in r:
            x = f"refused: {r['xgr_error']} | – | –"
        else:
            x = "– | – | –"
        lines.append(f"| {r['schema']} | {r['ll_compile_ms']:.1f} | {r['ll_cached_us']:.0f} | {r['ll_copy_us']:.0f} | "
                     f"{r['ll_fill_us']:.0f} | {x} |")
    lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def run_all(spec: StructuredSpec, threads: int) -> tuple[list[Run], tuple, str]:
    from transformers import AutoTokenizer

    from loraplex.engine.loader import DEFAULT_MODEL, load_config, resolve_model
    from loraplex.model_config import ModelConfig

    path = resolve_model(DEFAULT_MODEL)
    runs, dtype = run_throughput(spec, threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = ModelConfig.from_hf_config(load_config(path))
    compiles = compile_times(tokenizer, cfg.vocab_size, sorted(set(cfg.eos_token_ids) | {tokenizer.eos_token_id}))
    return runs, compiles, dtype
