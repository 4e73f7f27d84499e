"""Adapter paging benchmark: throughput with many distinct adapters against the base model alone.

Workload (S-LoRA's evaluation shape, scaled to a CPU): N requests, prompt and output lengths drawn
uniformly with a fixed seed, every request's adapter drawn with Zipf popularity (alpha 1) over n
adapters, all requests queued at once; the engine runs with `max_loras` slots and a host-memory cache
of `max_cpu_loras` adapters, so adapters page disk -> CPU -> slot during the run. The same prompts and
lengths run with no adapter at all (the upper bound). Each row is `--repeats` pairs of runs, base-only
and adapters back to back (in turn first), each pair's adapters under names the engine has not seen
(so they page in cold again, into tiers the previous pair left full); the ratio is the median of the
pairs' ratios, and its spread is printed: on a shared VM throughput drifts by 5-15% over minutes, more
than a pair's own two runs do. Second table: cold-load time of one adapter
from disk to host memory (parsing and checking everything, as registration does, and by the read plan
that later loads of the unchanged file use; median of 3) and from host memory into a slot, for ranks 8
to 64.

    python bench/adapter_paging.py                     # the table committed in docs/benchmarks/
    python bench/adapter_paging.py --quick             # a smoke run in about a minute
    python bench/adapter_paging.py --max-loras 8,64    # the same with 8 and with 64 adapter slots
    python bench/adapter_paging.py --model smollm2-135m-shapes --load-format dummy   # no model file
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.adapters.synthetic import write_random_adapter  # noqa: E402
from loraplex.bench.report import commit as report_commit  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# "qkvo" is S-LoRA's evaluation setting (its adapters hold q/k/v/o, slora/models/peft/layer_weights);
# "all" adds the MLP (PEFT's "all-linear"), 2.65x the adapter weights per token.
TARGETS = {"qkvo": ALL[:4], "all": ALL}


def workload(num_requests: int, num_adapters: int, seed: int, prompt_len, output_len, vocab_size: int):
    """(prompts, output lengths, adapter names): token ids below the vocabulary (and 40,000)."""
    rng = random.Random(seed)
    top = min(40000, vocab_size)
    prompts = [[rng.randrange(100, top) for _ in range(rng.randint(*prompt_len))] for _ in range(num_requests)]
    outputs = [rng.randint(*output_len) for _ in range(num_requests)]
    weights = [1 / (i + 1) for i in range(num_adapters)]
    names = rng.choices([f"a{i}" for i in range(num_adapters)], weights=weights, k=num_requests)
    return prompts, outputs, names


def timed(fn, *args) -> float:
    """Seconds one call of fn(*args) takes."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(llm: LLM, prompts, outputs, names) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, adapters=names)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights (e.g. --model smollm2-135m-shapes on a machine without the model file)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--adapters", default="1,16,256,1024", help="distinct adapter counts to sweep")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="qkvo,all", help="adapter target sets to sweep: qkvo, all")
    ap.add_argument("--max-loras", default="8", help="adapter slots; a comma list runs the sweep once per value")
    ap.add_argument("--max-cpu-loras", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-files", type=int, default=64, help="distinct adapter files behind the names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None,
                    help="pairs of runs (base-only, adapters) per row (default 3, 1 with --quick)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    counts = [int(c) for c in args.adapters.split(",")]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    target_sets = args.targets.split(",")
    if any(t not in TARGETS for t in target_sets):
        ap.error(f"--targets takes a comma list of {sorted(TARGETS)}")
    prompt_len, output_len = (8, 64), (8, 64)
    if args.quick:
        args.num_requests, counts, prompt_len, output_len = 32, [1, 16], (4, 16), (4, 8)

    tmp = Path(tempfile.mkdtemp(prefix="loraplex-paging-"))
    commit = report_commit()
    runs = [(t, int(m)) for t in target_sets for m in args.max_loras.split(",")]
    for k, (targets, max_loras) in enumerate(runs):
        llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                  max_loras=max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=64,
                  max_num_seqs=args.max_num_seqs)
        cfg = llm.engine.model_config
        # Names are distinct adapters to the engine (each pages through the tiers on its own); their
        # files cycle over --num-files directories so 1,024 adapters do not take gigabytes of disk.
        for i in range(min(max(counts), args.num_files)):
            path = tmp / targets / f"f{i}"
            if not path.exists():
                write_random_adapter(path, cfg, r=args.rank, alpha=2 * args.rank, targets=TARGETS[targets], seed=i)
        # Untimed warm-up on the real workload: the first large batch pays for first-touch allocations.
        run(llm, *workload(args.num_requests, 1, args.seed, prompt_len, output_len, cfg.vocab_size)[:2],
            [None] * args.num_requests)
        print(f"# adapter paging, {args.num_requests} requests, rank {args.rank} on {'/'.join(TARGETS[targets])}, "
              f"max_loras {max_loras} (max_lora_rank 64), max_cpu_loras {args.max_cpu_loras}, "
              f"dtype {llm.engine.dtype}, {args.repeats} pair(s) of runs a row: tok/s, ratio, mean batch and disk loads are "
              f"medians over them, the slot hit rate is over all of them, commit {commit}\n")
        print("| max_loras | distinct adapters | output tok/s | base-only tok/s | ratio | ratio spread "
              "| mean batch (requests) | slot hit rate | disk loads |")
        print("| ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: |")
        pair_ids = itertools.count()
        for n in counts:
            prompts, outputs, names = workload(args.num_requests, n, args.seed, prompt_len, output_len,
                                               cfg.vocab_size)
            base_tps, lora_tps, ratios, batches, hits, misses, loads = [], [], [], [], 0, 0, []
            for rep in range(args.repeats):
                # this pair's names ("p3a17": a17 in the 4th pair) for the adapters its requests draw from
                # the n, on the files cycled above (registering all n would read 1,024 files for nothing)
                pair_id = next(pair_ids)
                for i in sorted({int(name[1:]) for name in names}):
                    llm.load_adapter(f"p{pair_id}a{i}", tmp / targets / f"f{i % args.num_files}")
                fresh = [f"p{pair_id}{name}" for name in names]
                before = llm.adapter_stats()["tiers"]
                pair = {}
                for kind in (("base", "lora") if rep % 2 == 0 else ("lora", "base")):
                    steps, rows = llm.engine.num_steps, llm.engine.num_batched_rows
                    seconds, tokens = run(llm, prompts, outputs, fresh if kind == "lora" else [None] * len(prompts))
                    pair[kind] = tokens / seconds
                    if kind == "lora":
                        batches.append((llm.engine.num_batched_rows - rows) / max(1, llm.engine.num_steps - steps))
                after = llm.adapter_stats()["tiers"]
                hits += after["slots"]["hits"] - before["slots"]["hits"]
                misses += after["slots"]["misses"] - before["slots"]["misses"]
                loads.append(after["cpu"]["misses"] - before["cpu"]["misses"])
                base_tps.append(pair["base"])
                lora_tps.append(pair["lora"])
                ratios.append(pair["lora"] / pair["base"])
            print(f"| {max_loras} | {n} | {median(lora_tps):.0f} | {median(base_tps):.0f} | {median(ratios):.3f} | "
                  f"{min(ratios):.3f}-{max(ratios):.3f} | {median(batches):.1f} | {hits / max(1, hits + misses):.2f} | "
                  f"{median(loads):.0f} |", flush=True)
        print()
        if k < len(runs) - 1:
            llm.engine.adapters.close()
            del llm

    print("| rank | disk -> CPU, every check (ms) | disk -> CPU, by read plan (ms) | CPU -> slot (ms) |")
    print("| ---: | ---: | ---: | ---: |")
    mgr = llm.engine.adapters
    for r in (8, 16, 32, 64):
        write_random_adapter(tmp / f"cold{r}", cfg, r=r, alpha=r, targets=ALL, seed=r)
        llm.load_adapter(f"cold{r}", tmp / f"cold{r}")
        name, path, plan = f"cold{r}", tmp / f"cold{r}", mgr.registry[f"cold{r}"].read_plan
        full = median(timed(mgr.read, name, path) for _ in range(3))  # as after the file changed: every check
        mgr.read(name, path, plan)  # grows the reused read buffer, once
        planned = median(timed(mgr.read, name, path, plan) for _ in range(3))  # what a load does
        adapter, _ = mgr.read(name, path, plan)
        mgr.host.entries[f"cold{r}"] = adapter
        t0 = time.perf_counter()
        mgr._place(f"cold{r}")  # pages for rank r (evicting unpinned adapters if needed) and the copy in
        slot = time.perf_counter() - t0
        print(f"| {r} | {full * 1e3:.1f} | {planned * 1e3:.1f} | {slot * 1e3:.1f} |")


if __name__ == "__main__":
    main()
