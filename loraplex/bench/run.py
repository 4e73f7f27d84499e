"""`loraplex bench`: run a preset of S-LoRA-style experiments side by side and write one report.

    loraplex bench --preset small                 # under 10 minutes on 2 CPU cores -> docs/benchmarks/small.md
    loraplex bench --preset full --out docs/benchmarks/full.md
    loraplex bench --preset gpu-s1                # Llama-2-7B shapes, dummy weights, on a GPU
    loraplex bench --preset small --trace my.jsonl  # replay a trace instead of the main workload
    loraplex bench --preset engine-throughput --threads 1   # offline: ours vs PEFT vs static batching, fp32
    loraplex bench --preset adapter-paging        # 1 to 1,024 Zipf adapters in 8 slots against base-only
    loraplex bench --preset adapter-paging-all    # the same with adapters on all seven projections
    loraplex bench --preset vllm --threads 1      # ours vs vLLM's CPU build (scripts/peer-vllm installs it)
    loraplex bench --preset fairness              # a noisy tenant beside a quiet one: fcfs vs fair scheduling
    loraplex bench --preset prefix-cache          # shared system prompts and multi-turn chats, cache on vs off
    loraplex bench --preset structured            # 0/50/100% JSON Schema constrained rows, compile time per schema
    loraplex bench --preset scale-out             # Zipf adapters on 1 and 2 Ray Serve replicas, affinity vs pow2

A preset is one main workload (setting S1, n adapters, Zipf alpha, rate R) that every system runs
with the same prompts, then three sweeps of our engine: R (with static batching and base-only beside
it), n, and alpha x {S1, S2}. Adapters are random PEFT LoRA adapters on q/k/v/o (the same compute as
trained ones); names are distinct adapters to the engine, their files cycle over at most
`num_files` directories to bound disk use.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from loraplex.bench import report
from loraplex.bench.metrics import SLO, RequestRecord, RunStats, Summary, matmul_peak_flops, summarize
from loraplex.bench.workload import Workload, WorkloadSpec, generate, read_trace
from loraplex.threads import usable_cpus

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # S-LoRA's evaluation setting
ALL_LINEAR = (*TARGETS, "gate_proj", "up_proj", "down_proj")  # PEFT's "all-linear"


@dataclass
class Preset:
    """What one `loraplex bench` run measures. Lengths in tokens, rates in requests/s, times in seconds."""

    model: str = "smollm2-135m-instruct"
    load_format: str = "auto"
    dtype: str = "auto"
    main: WorkloadSpec = field(default_factory=WorkloadSpec)
    systems: tuple[str, ...] = ("engine", "static", "peft", "base", "http")
    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)
    num_adapters: tuple[int, ...] = (1, 8, 64, 512)
    alphas: tuple[float, ...] = (0.1, 1.0)
    alpha_num_adapters: int = 64  # n of the alpha x {S1, S2} sweep
    max_loras: int = 8
    max_cpu_loras: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # the prefill chunk budget of every engine; None: ours (512)
    peft_batch_size: int = 16
    num_files: int = 64
    slo: SLO = field(default_factory=SLO)
    targets: tuple[str, ...] = TARGETS  # the projections every adapter of the run holds
    cold_load_ranks: tuple[int, ...] = ()  # ranks whose cold-load times are measured after the sweeps
    # Pairs of runs of the main workload, in-process engine and HTTP back to back (every other pair HTTP
    # first), for the gateway's cost: the median of their ratios (a shared VM drifted 10-15% between runs)
    http_pairs: int = 0
    # Pairs of base-only runs, ours and vLLM's (every other pair vLLM first: an even count puts each first
    # equally often), for the base-only ratio: the side-by-side runs are minutes apart (vLLM's LoRA run
    # between them) and land anywhere in a drifting VM's band, the median of back-to-back pairs less so
    peer_pairs: int = 0

    @property
    def in_process_tenants(self) -> bool:
        """Whether in-process runs queue each request under its tenant (`systems.run_engine`): where the
        preset runs the HTTP system, so that the engine's fair share sees what the server's sees; else all
        under one tenant (first come, first served), as the peers it is compared with (PEFT, vLLM) schedule."""
        return "http" in self.systems


def _small() -> Preset:
    # On 2 cores no system keeps up with R = 16 (each finishes fewer than 16 req/s), so the main table
    # compares capacities; the rate sweep goes to 32 to show the plateau
    main = WorkloadSpec(num_adapters=8, alpha=1.0, rate=16.0, duration_s=6.0, prompt_len=(8, 64),
                        output_len=(8, 64), num_tenants=4)
    return Preset(main=main, rates=(2.0, 4.0, 8.0, 16.0, 32.0), http_pairs=5)


def _full() -> Preset:
    main = WorkloadSpec(num_adapters=64, alpha=1.0, rate=2.0, duration_s=60.0, prompt_len=(8, 512),
                        output_len=(8, 512), num_tenants=16)
    return Preset(main=main, rates=(0.5, 1.0, 2.0, 4.0), peft_batch_size=16, slo=SLO(ttft_s=10.0, tpot_s=0.2))


def _gpu_s1() -> Preset:
    main = WorkloadSpec(num_adapters=64, alpha=1.0, rate=8.0, duration_s=60.0, prompt_len=(8, 512),
                        output_len=(8, 512), num_tenants=16)
    return Preset(model="llama-2-7b", load_format="dummy", dtype="bfloat16", main=main,
                  systems=("engine", "static", "base"), rates=(2.0, 4.0, 8.0, 16.0, 32.0),
                  max_loras=32, max_cpu_loras=256, max_num_seqs=256, slo=SLO(ttft_s=1.0, tpot_s=0.1))


def _engine_throughput() -> Preset:
    # Offline throughput (all requests at time 0): continuous batching against transformers + PEFT's
    # mixed-adapter generate and against our static batching, 128 requests uniform over 16 adapters of
    # ranks 8/16/32/64 (S2), fp32 so that greedy tokens must equal PEFT's on every row.
    main = WorkloadSpec(num_adapters=16, alpha=0.0, rate=float("inf"), num_requests=128, prompt_len=(16, 257),
                        output_len=(16, 129), setting="S2", num_tenants=16)
    return Preset(dtype="float32", main=main, systems=("engine", "peft", "static"), rates=(), num_adapters=(),
                  alphas=(), max_loras=16, max_cpu_loras=16, max_num_seqs=64, peft_batch_size=16)


def _adapter_paging(targets: tuple[str, ...] = TARGETS) -> Preset:
    # Many distinct adapters against the base model alone: 256 requests at once, Zipf (alpha 1) over n
    # adapters of rank 8, 8 slots of rank 64 (64 rank-8 pages) and 64 in host memory, so adapters page
    # disk -> CPU -> slot during the run (S-LoRA's evaluation shape, scaled to a CPU).
    main = WorkloadSpec(num_adapters=256, alpha=1.0, rate=float("inf"), num_requests=256, prompt_len=(8, 65),
                        output_len=(8, 65), num_tenants=16)
    return Preset(main=main, systems=("engine", "base"), rates=(), num_adapters=(1, 16, 256, 1024), alphas=(),
                  max_loras=8, max_cpu_loras=64, max_num_seqs=64, targets=targets, cold_load_ranks=(8, 16, 32, 64))


def _vllm() -> Preset:
    # Side by side with vLLM (its CPU build on a CPU): 64 requests at once, prompts 32-256 tokens, 64
    # greedy output tokens each, over 16 distinct rank-8 adapters on q/k/v/o, fp32; both engines also on
    # the base model alone (vLLM with LoRA off: its fastest, compiled base-only engine). vLLM has no tenants,
    # so ours serves these first come, first served too (no HTTP system: Preset.in_process_tenants). Both
    # engines take 4096-token steps, vLLM-CPU's default for its offline LLM (4096 x world size,
    # vllm/engine/arg_utils.py), so that vLLM runs as its users get it; at our own 512, base-only, vLLM ran
    # about 1.3% slower and ours the same, while both LoRA engines ran faster (vLLM's by a third, ours by
    # about 4%; docs/performance.md, the thirteenth AMD EPYC Zen 4 section).
    main = WorkloadSpec(num_adapters=16, alpha=0.0, rate=float("inf"), num_requests=64, prompt_len=(32, 257),
                        output_len=(64, 65), num_tenants=16)
    return Preset(dtype="float32", main=main, systems=("engine", "base", "vllm", "vllm-base"), rates=(),
                  num_adapters=(), alphas=(), max_loras=16, max_cpu_loras=16, max_num_seqs=64, peer_pairs=4,
                  max_num_batched_tokens=4096)


PRESETS = {"small": _small, "full": _full, "gpu-s1": _gpu_s1, "engine-throughput": _engine_throughput,
           "adapter-paging": _adapter_paging, "adapter-paging-all": lambda: _adapter_paging(ALL_LINEAR),
           "vllm": _vllm}


@dataclass
class Experiment:
    """One (workload, system) pair measured, and where in the report it belongs."""

    group: str
    spec: WorkloadSpec | None
    system: str
    summary: Summary
    records: list[RequestRecord]


class Bench:
    """Holds the engine, the adapters on disk and the results of one `loraplex bench` run."""

    def __init__(self, preset: Preset, workdir: Path, *, peer_python: Path | None = None, threads: int = 1):
        from loraplex import LLM

        self.preset, self.workdir = preset, workdir
        self.peer_python, self.threads = peer_python, threads
        self.peer_version: str | None = None
        self.skipped: list[str] = []  # systems not run, each with why
        self.llm = LLM(preset.model, load_format=preset.load_format, dtype=preset.dtype, max_loras=preset.max_loras,
                       max_cpu_loras=preset.max_cpu_loras, max_lora_rank=64, max_num_seqs=preset.max_num_seqs,
                       num_threads=threads, enable_prefix_caching=False,  # raw prefill, as the peers run
                       **({} if preset.max_num_batched_tokens is None else
                          {"max_num_batched_tokens": preset.max_num_batched_tokens}))
        model = self.llm.engine.model
        # Prompts are random token ids below the model's vocabulary (a dummy model has no tokenizer).
        preset.main = replace(preset.main, vocab_size=self.llm.engine.model_config.vocab_size)
        head = model.lm_head.weight.numel()
        # embed_tokens is a lookup, not a matmul; with tied weights it is the lm_head tensor counted once
        self.flops_per_token = 2 * (sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
                                    - (0 if model.lm_head.weight is model.embed_tokens.weight else head))
        self.flops_per_output_token = 2 * head
        self.dtype = self.llm.engine.dtype
        device = self.llm.engine.device.type
        self.peaks = {dt: matmul_peak_flops(dt, device=device) for dt in (torch.float32, torch.bfloat16)}
        self.peak = self.peaks[self.dtype] if self.dtype in self.peaks else matmul_peak_flops(self.dtype, device=device)
        self.results: list[Experiment] = []
        self.adapter_dirs: dict[str, Path] = {}
        self._peft = None
        self._done: dict[tuple[str, str], tuple[Summary, list[RequestRecord]]] = {}
        self.main_workload: Workload | None = None
        self.cold_loads: list[tuple[int, float, float, float]] = []  # (rank, seconds: every check, by plan, slot)

    # adapters -----------------------------------------------------------------------------------
    def ensure_adapters(self, spec: WorkloadSpec | None, names: list[str]) -> None:
        """Write (once per file) and register the adapters `names` (those a workload draws): of the rank the
        spec gives each, or `preset.main.rank` for a name the spec does not know (a trace's). Only drawn
        ones: registering validates a file, which on 7B shapes reads tens of MB each."""
        from loraplex.adapters.synthetic import write_random_adapter

        cfg = self.llm.engine.model_config
        known = {name: (i, spec.adapter_rank(i), spec.setting) for i, name in enumerate(spec.adapter_names())} if spec else {}
        for j, name in enumerate(names):
            if name in self.adapter_dirs:
                continue
            i, rank, setting = known.get(name, (len(known) + j, self.preset.main.rank, "S1"))
            file_index = i % self.preset.num_files
            path = self.workdir / f"{setting}-r{rank}-t{len(self.preset.targets)}-f{file_index}"
            if not path.exists():
                write_random_adapter(path, cfg, r=rank, alpha=2 * rank, targets=self.preset.targets, seed=file_index)
            self.llm.load_adapter(name, path)
            self.adapter_dirs[name] = path

    # systems ------------------------------------------------------------------------------------
    def measure(self, group: str, spec: WorkloadSpec | None, system: str, workload: Workload, *,
                reuse: bool = True) -> Summary | None:
        """Run `system` on `workload` and record it under `group`. A (system, spec) measured before is
        reused in another table; reuse=False runs it again (a repeat), and the first run stays the one
        later tables reuse."""
        from loraplex.bench import systems

        key = (system, repr(spec))
        if reuse and spec is not None and key in self._done:  # the same measurement in another table: run it once
            summary, records = self._done[key]
            self.results.append(Experiment(group, spec, system, summary, records))
            return summary
        if workload.adapters:
            self.ensure_adapters(spec, workload.adapters)
        t0 = time.perf_counter()
        if system in ("engine", "static", "base"):
            work = workload.without_adapters() if system == "base" else workload
            systems.warm_up_engine(self.llm, work)
            records, stats = systems.run_engine(self.llm, work, static=system == "static", tenants=self.preset.in_process_tenants)
        elif system == "peft":
            records, stats = systems.run_peft(self._peft_model(workload), workload,
                                              batch_size=self.preset.peft_batch_size)
        elif system in ("vllm", "vllm-base"):
            from loraplex.engine.loader import resolve_model

            if self.peer_python is None:
                why = "vLLM is not installed (run `scripts/peer-vllm`, or pass --peer-python / set LORAPLEX_PEER_PYTHON)"
                self.skipped.append(f"{system}: {why}")
                print(f"  {group:<8} {system:<7} skipped: {why}", flush=True)
                return None
            work = workload.without_adapters() if system == "vllm-base" else workload
            dirs = {name: self.adapter_dirs[name] for name in workload.adapters}
            records, stats, self.peer_version = systems.run_vllm(
                self.peer_python, work, dirs, model_dir=resolve_model(self.preset.model),
                dtype=str(self.dtype).removeprefix("torch."), threads=self.threads,
                max_num_seqs=self.preset.max_num_seqs, max_loras=self.preset.max_loras, max_lora_rank=64,
                workdir=self.workdir, lora=system == "vllm",
                max_num_batched_tokens=self.llm.engine.config.max_num_batched_tokens)
        elif system == "http":
            from loraplex.bench.http_client import run_http

            env = {"LORAPLEX_MAX_LORAS": str(self.preset.max_loras), "LORAPLEX_MAX_LORA_RANK": "64",
                   "LORAPLEX_MAX_NUM_SEQS": str(self.preset.max_num_seqs), "LORAPLEX_DTYPE": self.preset.dtype,
                   "LORAPLEX_MAX_NUM_BATCHED_TOKENS": str(self.llm.engine.config.max_num_batched_tokens),
                   "LORAPLEX_MAX_CPU_LORAS": str(self.preset.max_cpu_loras),  # the in-process engine's bound
                   "LORAPLEX_MODEL": self.preset.model, "LORAPLEX_NUM_THREADS": str(self.threads),
                   "LORAPLEX_ENABLE_PREFIX_CACHING": "false",
                   # room to queue the whole workload (serve_subprocess lifts the queue-wait bound)
                   "LORAPLEX_MAX_NUM_WAITING_SEQS": str(max(1, len(workload.requests)))}
            dirs = {name: self.adapter_dirs[name] for name in workload.adapters}
            records, stats = run_http(workload, dirs, engine_env=env, log_path=self.workdir / "server.log")
        else:
            raise ValueError(f"unknown system {system!r}")
        summary = summarize(system, records, stats, self.preset.slo, self.flops_per_token, self.peak,
                            self.flops_per_output_token)
        self.results.append(Experiment(group, spec, system, summary, records))
        if reuse or key not in self._done:  # a repeat never stands in for the run other tables reuse
            self._done[key] = summary, records
        print(f"  {group:<8} {system:<7} {_label(spec):<34} {summary.output_tokens_per_s:8.1f} tok/s  "
              f"p99 TTFT {_fmt(summary.ttft[99])} s  ({time.perf_counter() - t0:.0f} s)", flush=True)
        return summary

    def _peft_model(self, workload: Workload):
        from loraplex.bench.systems import load_peft_model
        from loraplex.engine.loader import resolve_model

        if self._peft is None:
            dirs = {name: self.adapter_dirs[name] for name in workload.adapters}
            self._peft = load_peft_model(resolve_model(self.preset.model), dirs, self.dtype)
        return self._peft

    # experiments --------------------------------------------------------------------------------
    def run(self, trace: Workload | None = None) -> None:
        p = self.preset
        main = self.main_workload = trace or generate(p.main)
        spec = None if trace else p.main
        print(f"main workload: {len(main.requests)} requests, {main.num_output_tokens} output tokens")
        for system in p.systems:
            if system in ("peft", "http", "vllm", "vllm-base") and p.load_format == "dummy":  # no model files
                continue
            self.measure("main", spec, system, main)
        if p.http_pairs:
            if {"engine", "http"} <= set(p.systems) and p.load_format != "dummy":
                self.measure_pairs("pairs", spec, ("engine", "http"), p.http_pairs, main)
            else:
                self.skipped.append("the in-process/HTTP pairs: they need the engine and http systems and the "
                                    "model's files (not --load-format dummy)")
        if p.peer_pairs:
            why = ("they need the base and vllm-base systems" if not {"base", "vllm-base"} <= set(p.systems) else
                   "they need the model's files (not --load-format dummy)" if p.load_format == "dummy" else
                   "vLLM is not installed" if self.peer_python is None else None)
            if why is None:
                self.measure_pairs("peer-pairs", spec, ("base", "vllm-base"), p.peer_pairs, main)
            else:
                self.skipped.append(f"the base-only pairs with vLLM: {why}")
        for rate in p.rates:
            for system in ("engine", "static", "base"):
                self.measure("rate", replace(p.main, rate=rate), system, generate(replace(p.main, rate=rate)))
        for n in p.num_adapters:
            s = replace(p.main, num_adapters=n)
            self.measure("adapters", s, "engine", generate(s))
        for setting in ("S1", "S2"):
            for alpha in p.alphas:
                s = replace(p.main, num_adapters=p.alpha_num_adapters, alpha=alpha, setting=setting)
                self.measure("alpha", s, "engine", generate(s))
        for rank in p.cold_load_ranks:
            self.measure_cold_load(rank)

    def measure_pairs(self, group: str, spec: WorkloadSpec | None, systems: tuple[str, str], n: int,
                      workload: Workload) -> None:
        """Run `systems` (a, b) on `workload` `n` more times each, back to back in pairs, a first in even
        pairs and b first in odd ones, so that a machine drifting during the run favours neither; recorded
        under `group` in run order (`report.pairs_of` reads them back two by two)."""
        a, b = systems
        for i in range(n):
            for system in (a, b) if i % 2 == 0 else (b, a):
                self.measure(group, spec, system, workload, reuse=False)

    def measure_cold_load(self, rank: int, repeats: int = 3) -> None:
        """Seconds to bring one adapter of `rank` from disk into host memory, through every check (as after
        its file changed) and by its read plan (what a load of the registered, unchanged file does), and
        from host memory into a slot (`AdapterManager.acquire`, evicting unpinned adapters if needed);
        medians of `repeats`. The first read of a larger file grows the reused read buffer: not counted."""
        from statistics import median

        from loraplex.adapters.synthetic import write_random_adapter

        mgr, name, path = self.llm.engine.adapters, f"cold-r{rank}", self.workdir / f"cold-r{rank}"
        write_random_adapter(path, self.llm.engine.model_config, r=rank, alpha=rank, targets=self.preset.targets,
                             seed=rank)
        self.llm.load_adapter(name, path)
        read_plan = mgr.registry[name].read_plan

        def timed(*args) -> float:
            t0 = time.perf_counter()
            mgr.read(*args)
            return time.perf_counter() - t0

        full = median(timed(name, path) for _ in range(repeats))
        mgr.read(name, path, read_plan)
        planned = median(timed(name, path, read_plan) for _ in range(repeats))
        mgr.host.entries[name], _ = mgr.read(name, path, read_plan)
        t0 = time.perf_counter()
        mgr.acquire(name)
        slot = time.perf_counter() - t0
        mgr.release(name)
        self.llm.unload_adapter(name)
        self.cold_loads.append((rank, full, planned, slot))
        print(f"  cold load rank {rank}: {full * 1e3:.1f} / {planned * 1e3:.1f} / {slot * 1e3:.1f} ms", flush=True)


def _label(spec: WorkloadSpec | None) -> str:
    if spec is None:
        return "trace"
    return f"{spec.setting} n={spec.num_adapters} alpha={spec.alpha:g} R={spec.rate:g}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loraplex bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted([*PRESETS, "fairness", "prefix-cache", "structured", "scale-out"]), default="small")
    ap.add_argument("--out", type=Path, help="report path (default docs/benchmarks/<preset>.md)")
    ap.add_argument("--trace", type=Path, help="JSONL trace to replay as the main workload")
    ap.add_argument("--systems", help="comma-separated subset of engine,static,peft,base,http for the main workload")
    ap.add_argument("--main-only", action="store_true",
                    help="run the main workload only (with its pairs of runs; --http-pairs 0 and --peer-pairs 0 "
                         "for none), not the rate, adapter-count and alpha sweeps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="torch CPU threads (default: the CPUs this process may use)")
    ap.add_argument("--model", help="the preset's model instead (e.g. smollm2-135m-shapes with --load-format dummy)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), help="dummy: random weights, no model file")
    ap.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory, instead of the preset's")
    ap.add_argument("--http-pairs", type=int,
                    help="in-process/HTTP pairs of runs for the gateway's cost, instead of the preset's (0: none)")
    ap.add_argument("--peer-pairs", type=int,
                    help="pairs of base-only runs, ours and vLLM's, for the base-only ratio, instead of the "
                         "preset's (0: none)")
    ap.add_argument("--peer-python", help="the Python of a vLLM virtualenv for the vllm systems (default "
                                          "$LORAPLEX_PEER_PYTHON, else .peer/vllm/bin/python from scripts/peer-vllm)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = report.command_line(argv if argv is not None else sys.argv[1:])
    if args.preset == "fairness":  # its own runs: one engine per scheduling policy (bench/fairness.py)
        from loraplex.bench import fairness

        spec = dataclasses.replace(fairness.FairnessSpec(), seed=args.seed)
        out = args.out or Path("docs/benchmarks/fairness.md")
        runs = fairness.run_all(spec, args.threads, "auto")
        fairness.write_report(out, runs, spec, command=command, threads=args.threads, dtype="auto")
        print(f"report written to {out}")
        return 0
    if args.preset == "prefix-cache":  # its own servers: one per setting (bench/prefix_cache.py)
        from loraplex.bench import prefix_cache

        spec = dataclasses.replace(prefix_cache.PrefixSpec(), seed=args.seed)
        out = args.out or Path("docs/benchmarks/prefix-cache.md")
        with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
            runs = prefix_cache.run_all(spec, args.threads, Path(tmp))
        prefix_cache.write_report(out, runs, spec, command=command, threads=args.threads)
        print(f"report written to {out}")
        return 0
    if args.preset == "structured":  # in process, one engine (bench/structured.py)
        from loraplex.bench import structured

        spec = structured.StructuredSpec()
        out = args.out or Path("docs/benchmarks/structured.md")
        runs, compiles, dtype = structured.run_all(spec, args.threads)
        structured.write_report(out, runs, compiles, spec, command=command, threads=args.threads, dtype=dtype)
        print(f"report written to {out}")
        return 0
    if args.preset == "scale-out":  # its own Ray instances: one per configuration (bench/scaleout.py)
        from loraplex.bench import scaleout

        spec = dataclasses.replace(scaleout.ScaleOutSpec(), seed=args.seed, num_cpus=args.threads)
        out = args.out or Path("docs/benchmarks/scale-out.md")
        with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
            runs = scaleout.run_all(spec, Path(tmp))
        scaleout.write_report(out, runs, spec, command=command)
        print(f"report written to {out}")
        return 0
    preset = PRESETS[args.preset]()
    for flag, value in (("--http-pairs", args.http_pairs), ("--peer-pairs", args.peer_pairs)):
        if value is not None and value < 0:
            ap.error(f"{flag} must be >= 0, got {value}")
    overrides = {"model": args.model, "load_format": args.load_format, "max_cpu_loras": args.max_cpu_loras,
                 "http_pairs": args.http_pairs, "peer_pairs": args.peer_pairs}
    preset = dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    preset.main = replace(preset.main, seed=args.seed)
    if args.systems:
        systems = tuple(args.systems.split(","))
        unknown = sorted(set(systems) - set(report.NAMES))
        if unknown:
            ap.error(f"unknown systems {unknown}; choose from {sorted(report.NAMES)}")
        preset = dataclasses.replace(preset, systems=systems)
    if args.main_only:
        preset = dataclasses.replace(preset, rates=(), num_adapters=(), alphas=(), cold_load_ranks=())
    out = args.out or Path("docs/benchmarks") / f"{args.preset}.md"
    started = time.perf_counter()
    if args.trace:
        try:  # before the model loads, so that a bad trace costs seconds, not minutes
            read_trace(args.trace, vocab_size=2**31)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
        from loraplex.bench.systems import peer_python

        bench = Bench(preset, Path(tmp), peer_python=peer_python(args.peer_python), threads=args.threads)
        trace = None
        if args.trace:  # again, now that the model's vocabulary is known
            try:
                trace = read_trace(args.trace, vocab_size=preset.main.vocab_size, seed=args.seed)
            except ValueError as exc:
                ap.error(str(exc))
        bench.run(trace)
        report.write(out, bench, command=command, elapsed_s=time.perf_counter() - started)
    print(f"report written to {out}")
    return 0


__all__ = ["PRESETS", "Bench", "Experiment", "Preset", "RunStats", "main"]
