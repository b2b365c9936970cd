"""The ``pagedkv`` command: serve | generate | chat | bench | simulate | size | kv-cache."""

from __future__ import annotations

import argparse
import os
import sys


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="print top-k logprobs per token")


def add_generate_parser(subparsers) -> None:
    from pagedkv.engine.flags import add_engine_arguments

    p = subparsers.add_parser("generate", help="generate a completion for a prompt",
                              description="Print the model's completion of --prompt.")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled model)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stats", action="store_true", help="print KV-cache stats afterwards")
    add_sampling_arguments(p)
    add_engine_arguments(p.add_argument_group("engine"), exclude=("seed",))
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedkv.engine import RequestRejectedError
    from pagedkv.engine.flags import engine_options
    from pagedkv.engine.stats import cache_report
    from pagedkv.llm import LLM
    from pagedkv.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.sampling_seed, stop=tuple(args.stop),
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        llm = LLM(args.model, **engine_options(args))
        if args.chat:
            convs = [([{"role": "system", "content": args.system}] if args.system else [])
                     + [{"role": "user", "content": text}] for text in args.prompt]
            outputs = llm.chat(convs, params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (ValueError, RequestRejectedError, FileNotFoundError) as exc:
        print(f"pagedkv generate: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        for comp in out.outputs:
            if len(outputs) > 1 or len(out.outputs) > 1:
                print(f"--- prompt {outputs.index(out)} completion {comp.index} "
                      f"({comp.finish_reason}, {len(comp.token_ids)} tokens)")
            print(comp.text)
            if args.logprobs is not None and comp.logprobs:
                tok = llm.get_tokenizer()
                for t, lp in zip(comp.token_ids, comp.logprobs):
                    alts = ", ".join(f"{tok.decode([k])!r}:{v.logprob:.3f}" for k, v in lp.items())
                    print(f"  {tok.decode([t])!r} {lp[t].logprob:.3f}  [{alts}]")
    if args.stats:
        s = llm.stats()
        print(f"KV: {s.kv.used_blocks}/{s.kv.num_blocks} blocks used, "
              f"prefix hits {s.kv.prefix_hit_tokens}/{s.kv.prefix_query_tokens} tokens, "
              f"preemptions {s.preemptions_recompute + s.preemptions_swap}; "
              f"KV dtype {s.kv_cache_dtype}, {s.kv_bytes_per_block:,} bytes per block"
              + (f", quantization error (relative RMS, worst layer) {s.kv_quant_error_max:.4f}"
                 if s.kv_quant_error_max is not None else ""), file=sys.stderr)
        print(cache_report(s), file=sys.stderr)
    return 0


def add_kv_cache_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kv-cache", help="manage a KV disk tier directory (--kv-offload-dir)",
        description="The disk tier holds KV blocks computed from users' prompts (see docs/kv_tiers.md).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    clear = actions.add_parser("clear", help="delete every block file and the fingerprint in DIR",
                               description="Delete every KV block file, the fingerprint and the lock pagedkv "
                                           "wrote in DIR: only files whose header pagedkv recognizes go, "
                                           "others stay, and no link is followed. Refused, removing nothing, "
                                           "for a DIR without pagedkv's fingerprint.json, with a link at "
                                           "DIR/blocks, or while an engine uses DIR.")
    clear.add_argument("directory", metavar="DIR")
    clear.set_defaults(func=run_kv_cache_clear)
    info = actions.add_parser("info", help="what DIR holds: blocks, bytes, fingerprint")
    info.add_argument("directory", metavar="DIR")
    info.set_defaults(func=run_kv_cache_info)


def run_kv_cache_clear(args: argparse.Namespace) -> int:
    from pagedkv.memory.tiers.disk_store import clear_directory

    if not os.path.isdir(args.directory):
        raise FileNotFoundError(f"{args.directory} is not a directory")
    removed = clear_directory(args.directory)
    print(f"removed {removed} KV block file(s) from {args.directory}")
    return 0


def run_kv_cache_info(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pagedkv.memory.tiers.disk_files import BLOCK_SUFFIX, BLOCKS_DIR, FINGERPRINT_FILE, real_directory
    from pagedkv.units import format_bytes

    root = Path(args.directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    sizes = []  # block files, no link followed (as the tier and the wipe)
    if real_directory(root / BLOCKS_DIR):
        for fan in os.scandir(root / BLOCKS_DIR):
            if fan.is_dir(follow_symlinks=False):
                sizes += [e.stat(follow_symlinks=False).st_size for e in os.scandir(fan.path)
                          if e.name.endswith(BLOCK_SUFFIX) and e.is_file(follow_symlinks=False)]
    print(f"{root}: {len(sizes)} KV block file(s), {format_bytes(sum(sizes))}")
    fingerprint = root / FINGERPRINT_FILE
    if fingerprint.is_file() and not fingerprint.is_symlink():
        print(fingerprint.read_text().strip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pagedkv import __version__
    from pagedkv.server.cli import add_serve_parser
    from pagedkv.sim.cli import add_simulate_parser, add_size_parser

    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = add_serve_parser(sub)
    serve.add_argument("--version", action="version", version=f"pagedkv {__version__}")  # as `vllm serve --version`
    from pagedkv.server.cli import run_serve
    serve.set_defaults(func=run_serve)
    add_generate_parser(sub)
    from pagedkv.chat_cli import add_chat_parser
    add_chat_parser(sub)
    try:
        from pagedkv.bench_cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    add_simulate_parser(sub)
    add_size_parser(sub)
    add_kv_cache_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (a bad flag value, a missing or unreadable model, a request
    the engine refuses) is one line on stderr and exit status 2, never a traceback."""
    from pagedkv.errors import PagedKVError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # with the usage of the command they were given to (serve's: its vLLM flags, docs/serving.md)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except (PagedKVError, ValueError, OSError) as exc:
        print(f"pagedkv {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
