"""`loraplex` command line: `loraplex generate ...` (one prompt), `loraplex serve` (the gateway) and
`loraplex bench` (the serving benchmark, `loraplex.bench.run`)."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from loraplex import LLM, SamplingParams
    from loraplex.adapters.peft import AdapterError

    llm = LLM(args.model, dtype=args.dtype, max_loras=max(1, len(args.adapter)))
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            print(f"error: --adapter takes NAME=PATH, got {spec!r}", file=sys.stderr)
            return 2
        try:
            llm.load_adapter(name, path)
        except (AdapterError, OSError) as exc:
            print(f"error: adapter {name!r}: {exc}", file=sys.stderr)
            return 2
    if args.use is not None and args.use not in llm.list_adapters():
        print(f"error: --use {args.use!r} names no adapter given with --adapter", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.raw or llm.tokenizer.chat_template is None:
        out = llm.generate(args.prompt, params, adapters=args.use)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, adapters=args.use)[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "adapter": out.adapter, "ttft_s": out.ttft_s, "latency_s": out.latency_s}))
    else:
        print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.replicas is None:
        if args.ray_address or args.ingresses is not None:
            print("error: --ray-address and --ingresses need --replicas N (scale-out on Ray Serve)", file=sys.stderr)
            return 2
        from loraplex.platform.serve import serve

        return serve(host=args.host, port=args.port, model=args.model, log_level=args.log_level)
    import logging
    import os

    from loraplex.platform.config import Settings
    from loraplex.platform.scaleout.app import serve_on_ray

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("model", args.model)) if v is not None}
    return serve_on_ray(Settings(**overrides), args.replicas, args.ingresses or 1, args.router,
                        args.ray_address or os.environ.get("RAY_ADDRESS"), args.replica_cpus)


def _build_kernels(args: argparse.Namespace) -> int:
    import logging

    from loraplex.kernels import cpu_ext

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cpu_ext.enabled:
        print("the CPU LoRA kernel is turned off (LORAPLEX_CPU_KERNEL=0)", file=sys.stderr)
        return 1
    return 0 if cpu_ext.load() is not None else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own argument parser, so `loraplex bench --help` shows its options
        from loraplex.bench.run import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving on one base model.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt with the base model or an adapter")
    gen.add_argument("--prompt", required=True, help="user message (sent through the chat template)")
    gen.add_argument("--model", default="smollm2-135m-instruct", help="model name or local HF directory")
    gen.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                     help="load a PEFT adapter directory under NAME (repeatable)")
    gen.add_argument("--use", metavar="NAME", help="answer with this adapter (default: the base model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without chat template")
    gen.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    sub.add_parser("bench", help="run the serving benchmark and write a report (loraplex bench --help)")
    srv = sub.add_parser("serve", help="run the multi-tenant OpenAI-compatible gateway (settings: LORAPLEX_*)")
    srv.add_argument("--host", help="default LORAPLEX_HOST or 127.0.0.1")
    srv.add_argument("--port", type=int, help="default LORAPLEX_PORT or 8000")
    srv.add_argument("--model", help="default LORAPLEX_MODEL or smollm2-135m-instruct")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    scale = srv.add_argument_group("scale-out on Ray Serve (its extra: pip install -e '.[ray]' in the checkout; docs/scale-out.md)")
    scale.add_argument("--replicas", type=int, metavar="N", help="run N engine replicas on Ray Serve")
    scale.add_argument("--ingresses", type=int, metavar="M", help="gateway processes in front of them (default 1)")
    scale.add_argument("--ray-address", help="an existing Ray cluster (default RAY_ADDRESS, else a local instance)")
    scale.add_argument("--router", default="affinity", choices=["affinity", "pow2"],
                       help="adapter-affinity routing, or Ray Serve's default power-of-two choices")
    scale.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per engine replica (its threads)")
    sub.add_parser("build-kernels", help="build the compiled CPU LoRA kernel now (otherwise at the first start)")
    args = parser.parse_args(argv)
    commands = {"serve": _serve, "generate": _generate, "build-kernels": _build_kernels}
    try:
        return commands[args.command](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
