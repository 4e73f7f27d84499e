"""End-to-end throughput of a multi-adapter workload: our engine against transformers + PEFT.

Workload: --num-requests requests spread uniformly at random over --num-adapters random PEFT LoRA
adapters made on the default model (ranks 8, 16, 32, 64 in turn; q/k/v/o, or every linear layer with
--all-linear). Prompt and output lengths are drawn uniformly from --prompt-len and --output-len with
--seed; prompts are random token ids (no special tokens). Every request arrives at time 0.

Systems:
    a  ours         `LLM.generate` on all requests at once: continuous batching (--max-num-seqs)
    b  peft         transformers + PEFT mixed-adapter `generate(adapter_names=...)`, requests in arrival
                    order in static batches of --peft-batch-size rows, left-padded
    c  ours-static  our engine, admitting a new batch only when the previous one is done

Fairness rules: one dtype for all three (--dtype); the same prompts, adapters and per-row output
lengths; greedy decoding; EOS never stops a row (ignore_eos in ours; no eos_token_id in PEFT's
generation config), so every row makes exactly its drawn number of tokens. A PEFT batch runs to its
longest row (max_new_tokens = the batch's largest output length), but only each row's requested
tokens count as output. Each system is warmed up by one tiny generate (a row per adapter, so our
adapters sit in their slots) before the timed run, timed with time.perf_counter, on the same
--threads. TTFT and latency count from the start of the run, so they include queueing; PEFT's
latency is when the row's batch finishes (its TTFT is not measured). "CPU s" is this process's CPU
time: about threads x wall on an idle machine, less when other processes take the cores.

    python bench/engine_throughput.py --quick        # smoke test, under a minute
    python bench/engine_throughput.py                # 128 requests, 16 adapters, fp32
    python bench/engine_throughput.py --dtype bfloat16 --markdown docs/benchmarks/engine_throughput.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from loraplex import LLM, SamplingParams
from loraplex.adapters.synthetic import randomize_lora_weights
from loraplex.bench.report import commit as report_commit
from loraplex.engine.loader import DEFAULT_MODEL, resolve_model

RANKS = (8, 16, 32, 64)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FIRST_TOKEN_ID = 100  # below are special and chat tokens


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    adapters: list[str]


@dataclass
class Result:
    name: str
    seconds: float
    num_output_tokens: int
    cpu_seconds: float = 0.0  # this process's CPU time: ~ threads x wall on an idle machine
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds


def make_workload(args, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    n = args.num_requests
    prompt_lens = [rng.randint(*args.prompt_len) for _ in range(n)]
    return Workload(
        prompts=[[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(p)] for p in prompt_lens],
        output_lens=[rng.randint(*args.output_len) for _ in range(n)],
        adapters=[f"lora{rng.randrange(args.num_adapters)}" for _ in range(n)],
    )


def make_peft_model(model_path, args, root: str):
    """A PeftModel holding every adapter (random A and B), saved under root/<name>; cast to --dtype."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    for i in range(args.num_adapters):
        r = RANKS[i % len(RANKS)]
        cfg = LoraConfig(
            r=r,
            lora_alpha=2 * r,
            init_lora_weights=False,
            target_modules="all-linear" if args.all_linear else ATTN,
        )
        if i == 0:
            model = get_peft_model(model, cfg, adapter_name="lora0")
        else:
            model.add_adapter(f"lora{i}", cfg)
    randomize_lora_weights(model, gen, b_std=0.05)
    model.save_pretrained(root)  # peft writes each named adapter to root/<name>
    model.get_base_model().generation_config.eos_token_id = None  # EOS never stops a row (ignore_eos)
    return model.to(DTYPES[args.dtype]).eval()


def peft_generate(model, prompts, output_lens, adapters) -> list[list[int]]:
    """One left-padded mixed-adapter batch, greedy, run to the longest requested output."""
    pad = 2
    width, max_new = max(map(len, prompts)), max(output_lens)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            adapter_names=adapters,
        )
    assert out.shape[1] == width + max_new, "a PEFT row stopped early"
    return [out[i, width : width + n].tolist() for i, n in enumerate(output_lens)]


def run_peft(model, work: Workload, batch_size: int) -> Result:
    names = sorted(set(work.adapters))
    peft_generate(model, [work.prompts[0][:8]] * len(names), [2] * len(names), names)  # warm-up
    res = Result("b  transformers + PEFT", 0.0, sum(work.output_lens))
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(work.prompts), batch_size):
        rows = slice(i, i + batch_size)
        res.token_ids += peft_generate(model, work.prompts[rows], work.output_lens[rows], work.adapters[rows])
        res.latency_s += [time.perf_counter() - start] * len(work.prompts[rows])
    res.seconds, res.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return res


def run_engine(model_path, work: Workload, adapter_dirs: dict, args, static: bool) -> Result:
    llm = LLM(
        str(model_path),
        dtype=args.dtype,
        max_loras=args.num_adapters,
        max_lora_rank=max(RANKS),
        max_num_seqs=args.max_num_seqs,
        static_batching=static,
    )
    for name, path in adapter_dirs.items():
        llm.load_adapter(name, path)
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens]
    names = sorted(set(work.adapters))  # warm-up also brings every adapter into a slot
    llm.generate([work.prompts[0][:8]] * len(names), SamplingParams(max_tokens=2, temperature=0), names)
    engine = llm.engine
    steps, preemptions = engine.num_steps, engine.scheduler.num_preemptions
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(work.prompts, greedy, adapters=work.adapters)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    assert [len(o.token_ids) for o in outs] == work.output_lens
    name = "c  ours, static batching" if static else "a  ours, continuous batching"
    print(
        f"{name}: {engine.num_steps - steps} steps, {engine.scheduler.num_preemptions - preemptions} preemptions"
    )
    return Result(
        name,
        seconds,
        sum(work.output_lens),
        cpu_seconds,
        [o.ttft_s for o in outs],
        [o.latency_s for o in outs],
        [o.token_ids for o in outs],
    )


def mean(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.2f}" if xs else "–"


def table(results: dict[str, Result]) -> str:
    a, b, c = results["a"], results["b"], results["c"]
    lines = [
        "| system | output tok/s | wall s | CPU s | mean TTFT s | mean latency s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.name} | {r.tokens_per_s:.1f} | {r.seconds:.1f} | {r.cpu_seconds:.1f} | {mean(r.ttft_s)} | "
        f"{mean(r.latency_s)} |"
        for r in (a, b, c)
    ]
    same = sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))
    lines += [
        "",
        f"a/b = {a.tokens_per_s / b.tokens_per_s:.2f}x, a/c = {a.tokens_per_s / c.tokens_per_s:.2f}x; "
        f"rows whose tokens equal PEFT's: {same}/{len(a.token_ids)}",
    ]
    return "\n".join(lines)


def machine_info(args, work: Workload) -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    commit = report_commit()
    return "\n".join(
        [
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; commit {commit}",
            f"- CPU: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"load average at start {os.getloadavg()[0]:.1f}",
            f"- dtype {args.dtype}; {len(work.prompts)} requests over {args.num_adapters} adapters "
            f"({'all-linear' if args.all_linear else 'q/k/v/o'}); prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
            f"tokens ({sum(map(len, work.prompts))} in all), outputs {args.output_len[0]}-{args.output_len[1]} "
            f"({sum(work.output_lens)} in all); PEFT batch {args.peft_batch_size}, our max_num_seqs {args.max_num_seqs}",
            f"- command: `python {shlex.join(sys.argv)}`",
        ]
    )


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--peft-batch-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--all-linear", action="store_true", help="adapters on every linear layer, not only q/k/v/o"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for all three")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 requests, 4 adapters, short prompts and outputs")
    p.add_argument("--markdown", metavar="PATH", help="append the table and machine info to this file")
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.num_adapters, args.prompt_len, args.output_len = 16, 4, [8, 32], [4, 16]
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_path = resolve_model(DEFAULT_MODEL)
    results = {}
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as root:
        peft_model = make_peft_model(model_path, args, root)
        work = make_workload(args, peft_model.config.vocab_size)
        adapter_dirs = {f"lora{i}": os.path.join(root, f"lora{i}") for i in range(args.num_adapters)}
        info = machine_info(args, work)  # before the runs: date and load average at the start
        print(info, flush=True)
        results["b"] = run_peft(peft_model, work, args.peft_batch_size)
        print(f"{results['b'].name}: {results['b'].seconds:.1f} s", flush=True)
        del peft_model
        for key, static in (("a", False), ("c", True)):
            results[key] = run_engine(model_path, work, adapter_dirs, args, static)
            print(f"{results[key].name}: {results[key].seconds:.1f} s", flush=True)
    text = table(results) + f"\n\nload average at the end: {os.getloadavg()[0]:.1f}"
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{info}\n\n{text}\n")


if __name__ == "__main__":
    main()
