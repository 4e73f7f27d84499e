"""Write a `loraplex bench` run as Markdown tables and PNG plots (matplotlib), with the machine and command."""

from __future__ import annotations

import collections
import datetime
import os
import platform
import shlex
import subprocess
from pathlib import Path

import torch

from loraplex import isa
from loraplex.bench.metrics import Summary

NAMES = {
    "engine": "loraplex, continuous batching",
    "static": "loraplex, static batching (admits a new batch when the last is done)",
    "peft": "transformers + PEFT generate(adapter_names)",
    "base": "loraplex, base model only",
    "http": "loraplex over HTTP (aiohttp client, streaming)",
    "vllm": "vLLM (enable_lora, one LoRARequest per adapter)",
    "vllm-base": "vLLM, base model only (LoRA off)",
}
COMPARISONS = (  # (a, b, what the ratio a/b says)
    ("engine", "static", "continuous vs static batching"),
    ("engine", "peft", "engine vs transformers + PEFT"),
    ("engine", "base", "multi-adapter vs base-only"),
    ("http", "engine", "HTTP gateway vs in-process"),
    ("engine", "vllm", "multi-adapter: loraplex vs vLLM"),
    ("base", "vllm-base", "base-only: loraplex vs vLLM (LoRA off)"),
    ("vllm", "vllm-base", "vLLM multi-adapter vs its base-only"),
)
AGREEMENT = (("engine", "peft", "PEFT's"), ("engine", "vllm", "vLLM's (multi-adapter)"),
             ("base", "vllm-base", "vLLM's (base-only)"))


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _x(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}x"


def _ratio(a: float | None, b: float | None) -> str:
    return _x(_div(a, b))


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB{gpu}; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); Python {platform.python_version()}")


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the ones that decide our CPU kernels and dtype


def cpu_flags() -> str:
    """Which of CPU_FLAGS this CPU has, e.g. "avx2 avx512f avx512_bf16" (every benchmark table says it)."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "unknown"
    return (" ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)) + isa.describe()


def command_line(argv: list[str]) -> str:
    """The command a report names for `loraplex bench argv`, with `LORAPLEX_CPU_ISA=avx2 ` before it when
    the run was held to AVX2 (`loraplex.isa`), so that it reruns the same paths."""
    return (f"{isa.ENV}=avx2 " if isa.cap() else "") + "loraplex bench " + shlex.join(argv)


def commit() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent)
    except OSError:  # no git on this machine
        return "unknown"
    return out.stdout.strip() or "unknown"


def summary_table(rows: list[tuple[str, Summary]]) -> list[str]:
    lines = ["| system | done | req/s | output tok/s | goodput req/s | TTFT p50 / p90 / p99 s | "
             "TPOT p50 / p90 / p99 ms | E2E p50 / p90 / p99 s | mean batch | adapter hit rate | MFU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in rows:
        lines.append(
            f"| {label} | {s.num_ok}/{s.num_requests} | {s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} | "
            f"{s.goodput:.2f} | {_f(s.ttft[50])} / {_f(s.ttft[90])} / {_f(s.ttft[99])} | "
            f"{_ms(s.tpot[50])} / {_ms(s.tpot[90])} / {_ms(s.tpot[99])} | "
            f"{_f(s.e2e[50])} / {_f(s.e2e[90])} / {_f(s.e2e[99])} | "
            f"{_f(s.stats.mean_batch_size, 1)} | {_f(s.stats.adapter_hit_rate)} | "
            f"{'–' if s.mfu is None else f'{s.mfu:.1%}'} |")
    return lines


def ratio_table(main: dict[str, Summary]) -> list[str]:
    lines = ["| comparison (a / b) | req/s (higher: a better) | output tok/s | TTFT p50 (lower: a better) | "
             "TTFT p99 | TPOT p50 | TPOT p99 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a, b, what in COMPARISONS:
        if a in main and b in main:
            x, y = main[a], main[b]
            lines.append(f"| {what} | {_ratio(x.requests_per_s, y.requests_per_s)} | "
                         f"{_ratio(x.output_tokens_per_s, y.output_tokens_per_s)} | "
                         f"{_ratio(x.ttft[50], y.ttft[50])} | {_ratio(x.ttft[99], y.ttft[99])} | "
                         f"{_ratio(x.tpot[50], y.tpot[50])} | {_ratio(x.tpot[99], y.tpot[99])} |")
    return lines


def pairs_of(runs: list) -> list[tuple[str, dict]]:
    """Experiments of one pairs group (`Bench.measure_pairs`), in run order, two by two: for each pair the
    system that ran first and {system: Experiment}. A last run without its pair is left out."""
    return [(runs[i].system, {runs[i].system: runs[i], runs[i + 1].system: runs[i + 1]})
            for i in range(0, len(runs) - 1, 2)]


def _median_x(xs: list[float | None]) -> str:
    """The median of the ratios that exist, bold, or a dash when none does."""
    from statistics import median

    xs = [x for x in xs if x is not None]
    return f"**{median(xs):.2f}x**" if xs else "–"


def http_pairs_table(pairs: list) -> list[str]:
    """The in-process/HTTP pairs of runs (`Preset.http_pairs`: Experiments of group "pairs", two by two in
    run order, each two an "engine" and an "http" run in either order) as a table with each pair's ratios
    and their medians (over the pairs where both runs made tokens)."""
    lines = ["| pair | in-process tok/s | its CPU s | HTTP tok/s | server CPU s | client CPU s | "
             "HTTP / in-process tok/s | TTFT p50 (lower: HTTP better) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tput, ttft = [], []
    for i, (first, runs) in enumerate(pairs_of(pairs)):
        e, h = runs["engine"].summary, runs["http"].summary
        tput.append(_div(h.output_tokens_per_s, e.output_tokens_per_s))
        ttft.append(_div(h.ttft[50], e.ttft[50]))
        order = "HTTP first" if first == "http" else "in-process first"
        lines.append(f"| {i + 1} ({order}) | {e.output_tokens_per_s:.1f} | {_f(e.stats.server_cpu_s)} | "
                     f"{h.output_tokens_per_s:.1f} | {_f(h.stats.server_cpu_s)} | {_f(h.stats.client_cpu_s)} | "
                     f"{_x(tput[-1])} | {_x(ttft[-1])} |")
    if tput:
        lines.append(f"| median | | | | | | {_median_x(tput)} | {_median_x(ttft)} |")
    return lines


def peer_pairs_table(pairs: list) -> list[str]:
    """The base-only pairs of runs with vLLM (`Preset.peer_pairs`: Experiments of group "peer-pairs", two by
    two in run order, each a "base" and a "vllm-base" run in either order): each pair's output tokens/s,
    ours / vLLM's throughput, TTFT p50 and TPOT p50, and the greedy agreement of the two runs' tokens; then
    the medians over the pairs where both runs made tokens."""
    lines = ["| pair | loraplex tok/s | vLLM tok/s | loraplex / vLLM tok/s | TTFT p50 (lower: loraplex better) | "
             "TPOT p50 | greedy agreement |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    tput, ttft, tpot = [], [], []
    for i, (first, runs) in enumerate(pairs_of(pairs)):
        ours, theirs = runs["base"], runs["vllm-base"]
        a, b = ours.summary, theirs.summary
        tput.append(_div(a.output_tokens_per_s, b.output_tokens_per_s))
        ttft.append(_div(a.ttft[50], b.ttft[50]))
        tpot.append(_div(a.tpot[50], b.tpot[50]))
        same = sum(x.token_ids == y.token_ids for x, y in zip(ours.records, theirs.records, strict=True))
        order = "vLLM first" if first == "vllm-base" else "loraplex first"
        lines.append(f"| {i + 1} ({order}) | {a.output_tokens_per_s:.1f} | {b.output_tokens_per_s:.1f} | "
                     f"{_x(tput[-1])} | {_x(ttft[-1])} | {_x(tpot[-1])} | {same} of {len(ours.records)} |")
    if tput:
        lines.append(f"| median | | | {_median_x(tput)} | {_median_x(ttft)} | {_median_x(tpot)} | |")
    return lines


def _plot(path: Path, series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str,
          logx: bool = False) -> None:
    try:
        import matplotlib
    except ImportError:  # a machine with torch and Triton only (the lent GPU's): tables without plots
        print(f"matplotlib is not installed: {path.name} not drawn")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def failures(runs: dict) -> list[str]:
    """Report lines naming, per system of the main workload, how many requests failed and why (each distinct
    error once, with its count, most frequent first); none when every request finished."""
    lines = []
    for system, run in runs.items():
        errors = collections.Counter(r.error for r in run.records if not r.ok)
        if errors:
            why = "; ".join(f"{n} x `{e[:300]}`" for e, n in errors.most_common())
            lines += [f"Failed in `{system}`: {sum(errors.values())} of {len(run.records)} requests: {why}.", ""]
    return lines


def write(out: Path, bench, *, command: str, elapsed_s: float) -> None:
    """Write the report of `bench` (a finished `loraplex.bench.run.Bench`) to `out`, plots beside it."""
    out = Path(out)
    plots = out.with_suffix("")  # the plots' folder, made when there is one to draw
    p, results = bench.preset, bench.results
    main = {e.system: e.summary for e in results if e.group == "main"}
    spec = next((e.spec for e in results if e.group == "main"), None)
    lines = [f"# Serving benchmark: {out.stem}", "",
             f"- date {datetime.datetime.now().isoformat(timespec='seconds')}, commit `{commit()}`, "
             f"whole run {elapsed_s / 60:.1f} min",
             f"- machine: {machine()}; CPU flags: {cpu_flags()}",
             "- matmul peak measured in this run (2048-cubed products, smaller where one takes over 1/8 s): "
             + ", ".join(f"{str(dt).removeprefix('torch.')} {f / 1e9:.0f} GFLOP/s" for dt, f in bench.peaks.items())
             + f"; MFU = (2 x {bench.flops_per_token / 2e6:.0f}M decoder params x (prompt + output tokens) + "
             f"2 x {bench.flops_per_output_token / 2e6:.0f}M lm_head params x output tokens) / s / the "
             f"{str(bench.dtype).removeprefix('torch.')} peak, over the whole run",
             f"- model `{p.model}` ({p.load_format} weights, {bench.dtype}); max_loras {p.max_loras}, "
             f"max_cpu_loras {p.max_cpu_loras}, max_num_seqs {p.max_num_seqs}, max_num_batched_tokens "
             f"{bench.llm.engine.config.max_num_batched_tokens} (every engine's); PEFT batches of {p.peft_batch_size}",
             f"- SLO for goodput: {p.slo}", f"- command: `{command}`", ""]
    if spec is not None:
        arrivals = (f"{spec.num_requests} requests all at time 0" if spec.rate == float("inf") else
                    f"gamma arrivals R = {spec.rate:g} req/s cv {spec.cv:g} for {spec.duration_s:g} s")
        ranks = f"rank {spec.rank}" if spec.setting == "S1" else "ranks 8, 16, 32, 64 in turn"
        lines += [f"Main workload ({spec.setting}): n = {spec.num_adapters} adapters ({ranks}, on "
                  f"{'/'.join(m.removesuffix('_proj') for m in p.targets)}) over {spec.num_tenants} tenants, Zipf "
                  f"alpha {spec.alpha:g}, {arrivals}, prompts U[{spec.prompt_len[0]}, {spec.prompt_len[1]}) and "
                  f"outputs U[{spec.output_len[0]}, {spec.output_len[1]}) tokens, seed {spec.seed}. Every system gets "
                  "the same requests at the same times, decodes greedily and ignores EOS.", ""]
    if p.in_process_tenants:
        scheduling = ("In-process, our engine queues each request under its tenant, as the HTTP server does (fair "
                      "share across tenants).")
    else:
        scheduling = ("In-process, our engine queues every request under one tenant (first come, first served)"
                      + (", as vLLM does." if any(s.startswith("vllm") for s in p.systems) else "."))
    lines += [scheduling, ""]
    lines += ["## Side by side", ""]
    lines += summary_table([(NAMES[k], v) for k, v in main.items()])
    lines += ["", *ratio_table(main), "",
              "Throughput counts from the first arrival to the last finish; when a system keeps up with R it "
              "equals R, so the ratios compare capacity only where R saturates both systems"
              + (" (see the rate sweep)" if any(e.group == "rate" for e in results) else "")
              + ". Static batching here admits a new batch only when the previous one is done, but a "
              "finished row leaves its batch at once; PEFT's static batches run every row to the batch's "
              "longest output. Mean batch: rows that made a token per step (PEFT: rows in its batch, finished "
              "ones included; HTTP: rows scheduled per engine step). The HTTP client and the server share this "
              "machine's cores.", ""]
    runs = {e.system: e for e in results if e.group == "main"}
    lines += failures(runs)
    for ours, theirs, whose in AGREEMENT:
        if ours in runs and theirs in runs:
            a, b = runs[ours].records, runs[theirs].records
            same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
            lines += [f"Greedy outputs of `{ours}` equal to {whose}, token for token: {same} of {len(a)} requests "
                      f"({bench.dtype}: rounding differs between implementations and flips near-ties on random "
                      "prompts).", ""]
    if getattr(bench, "peer_version", None):
        lines += [f"vLLM {bench.peer_version} ran in its own virtualenv (`scripts/peer-vllm`), in a subprocess "
                  f"of this run, with the same threads, dtype, requests and arrival times.", ""]
    for note in getattr(bench, "skipped", []):
        lines += [f"Skipped: {note}.", ""]

    pairs = [e for e in results if e.group == "pairs"]
    if pairs:
        lines += ["## HTTP gateway against in-process, pair by pair", "",
                  f"The main workload {len(pairs) // 2} more times through the in-process engine and through the "
                  "HTTP server, back to back (every other pair HTTP first), so that each ratio compares runs "
                  "seconds apart. A shared VM's speed can drift between single runs (10-15% on the 2-core VMs "
                  "of docs/performance.md), so one pair, as in the side-by-side table, can land anywhere in that "
                  "band; the medians are the figures to read. CPU: user + system seconds of all threads over the "
                  "replay; the server's holds the engine's threads, its event loop, the database and usage "
                  "threads; the client is this process (aiohttp).", ""]
        lines += [*http_pairs_table(pairs), ""]

    peer = [e for e in results if e.group == "peer-pairs"]
    if peer:
        lines += ["## Base-only against vLLM, pair by pair", "",
                  f"Both base-only engines on the main workload {len(peer) // 2} more times, back to back (every "
                  "other pair vLLM first), so that each ratio compares runs a minute or two apart. The side-by-side "
                  "table's two base-only runs are minutes apart, with vLLM's LoRA run between them, and a shared "
                  "VM's speed drifts by up to 10% within minutes (docs/performance.md), more than most code "
                  "changes move the ratio: the median of the pairs is the base-only figure to read.", ""]
        lines += [*peer_pairs_table(peer), ""]

    rate = [e for e in results if e.group == "rate"]
    if rate:
        lines += ["## Rate sweep", "", "![throughput vs R](" + f"{plots.name}/throughput_vs_rate.png)",
                  "![p99 TTFT vs R](" + f"{plots.name}/ttft_p99_vs_rate.png)", ""]
        lines += summary_table([(f"R = {e.spec.rate:g}: {e.system}", e.summary) for e in rate])
        by_system: dict[str, tuple[list[float], list[float], list[float]]] = {}
        for e in rate:
            xs, tput, ttft = by_system.setdefault(e.system, ([], [], []))
            xs.append(e.spec.rate)
            tput.append(e.summary.requests_per_s)
            ttft.append(e.summary.ttft[99] or float("nan"))
        _plot(plots / "throughput_vs_rate.png", {NAMES[k]: (v[0], v[1]) for k, v in by_system.items()},
              "arrival rate R (req/s)", "throughput (req/s)")
        _plot(plots / "ttft_p99_vs_rate.png", {NAMES[k]: (v[0], v[2]) for k, v in by_system.items()},
              "arrival rate R (req/s)", "p99 TTFT (s)")
        lines.append("")

    sweep = [e for e in results if e.group == "adapters"]
    if sweep:
        lines += ["## Number of adapters", "", "![throughput vs n](" + f"{plots.name}/throughput_vs_adapters.png)", ""]
        lines += summary_table([(f"n = {e.spec.num_adapters}", e.summary) for e in sweep])
        series = {NAMES["engine"]: ([e.spec.num_adapters for e in sweep], [e.summary.output_tokens_per_s for e in sweep])}
        if "base" in main:
            series[NAMES["base"]] = (series[NAMES["engine"]][0], [main["base"].output_tokens_per_s] * len(sweep))
        _plot(plots / "throughput_vs_adapters.png", series, "distinct adapters n", "output tokens/s", logx=True)
        lines.append("")

    alpha = [e for e in results if e.group == "alpha"]
    if alpha:
        lines += ["## Popularity and ranks (S1: one rank; S2: ranks 8, 16, 32, 64)", ""]
        lines += summary_table([(f"{e.spec.setting}, n = {e.spec.num_adapters}, alpha = {e.spec.alpha:g}", e.summary)
                                for e in alpha])
        lines.append("")
    if bench.cold_loads:
        lines += ["## Cold loads of one adapter", "",
                  f"Adapters on {'/'.join(m.removesuffix('_proj') for m in p.targets)}, fp32 files, medians of 3 "
                  "(`Bench.measure_cold_load`).", "",
                  "| rank | disk -> host, every check (ms) | disk -> host, by read plan (ms) | host -> slot (ms) |",
                  "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {r} | {a * 1e3:.1f} | {b * 1e3:.1f} | {c * 1e3:.1f} |" for r, a, b, c in bench.cold_loads]
        lines.append("")
    out.write_text("\n".join(lines) + "\n")
