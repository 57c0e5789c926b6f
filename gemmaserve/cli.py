"""Command line: `gemmaserve generate|serve|download|bench ...`. Engine and sampling options come from the
`EngineConfig` and `SamplingParams` dataclasses, so every command shares them.

Nothing here imports torch until a command runs (the benchmarks' own options are declared only when
`bench` is the command): `--help` and argument errors answer in a fraction of a second."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import sys

from .config.engine import EngineConfig
from .config.options import add_options, from_namespace
from .engine.sampling_params import SamplingParams
from .errors import UserInputError


class _Parser(argparse.ArgumentParser):
    """Errors as one line (no usage dump), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# bench name -> (help, whether it takes the engine options); their modules import torch.
BENCHMARKS = {
    "decode": ("CPU/GPU decode tokens/s against Hugging Face generate (and llama.cpp on the CPU)", True),
    "throughput": ("offline throughput of mixed prompts against Hugging Face generate (and llama.cpp)", True),
    "memory": ("KV bytes per sequence, prefill peaks and concurrency (V1 vs V2)", False),
    "load": ("HTTP server under concurrent streamed requests: TTFT, ITL, tokens/s vs offline", True),
    "soak": ("HTTP server under faults (disconnects, deadlines, overload, bad input): leaks and accounting", True),
    "quality": ("quantised CPU weights against fp32 (and llama.cpp): perplexity, greedy agreement", False),
    "grammar": ("structured output: per-step mask cost of xgrammar vs llguidance, and engine tokens/s", True),
    "kv-transfer": ("disaggregated serving: KV bytes per request (V2 vs V1), latency against one engine", False),
    "startup": ("cold and warm starts: serve to /health 200 and to compiled steps; generate vs llama.cpp", False),
    "spec": ("speculative decoding (prompt lookup) on input-grounded tasks vs ours and llama.cpp's lookup", True),
    "spec-drafters": ("draft_model and MTP drafting steps against plain ones on tiny random checkpoints", False),
    "preprocess": ("host time to prepare an image or 30 s of audio, against transformers' processors", False),
    "lora": ("a batch's tokens/s with 1-16 LoRA adapters of rank 8 and 64, against the base alone", True),
    "sessions": ("multi-turn sessions returning after eviction: host KV tier against recomputation", True),
    "batches": ("the 270M's tokens and logprobs alone vs in batches of 1-16 on every CPU step path", False),
}


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """`with_bench=False` declares the benchmarks without their options (no torch import)."""
    parser = _Parser(prog="gemmaserve", description="Gemma 3 / Gemma 4 inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image file for multimodal models (repeatable); every prompt gets all of them, "
                          "at its <start_of_image> placeholders or before its text")
    gen.add_argument("--video", action="append", default=[], metavar="PATH",
                     help="a video file (MP4, WebM, MKV, ...) for Gemma 4 models with a vision encoder (repeatable); "
                          "every prompt gets all of them, at its <|video|> placeholders or before its text")
    gen.add_argument("--audio", action="append", default=[], metavar="PATH",
                     help="an audio file (WAV, FLAC, OGG, MP3; any rate or channels) for models with an audio "
                          "encoder (repeatable); every prompt gets all of them, at its <|audio|> placeholders or "
                          "before its text")
    gen.add_argument("--lora", default=None, metavar="NAME",
                     help="run every prompt with this LoRA adapter (one of --lora-modules)")
    add_options(gen, EngineConfig, "engine")
    add_options(gen, SamplingParams, "sampling")
    gen.set_defaults(handler=_generate)

    srv = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    from .server.config import ServerConfig

    from .config.kv_transfer import KVTransferConfig

    add_options(srv, ServerConfig, "server")
    add_options(srv, EngineConfig, "engine")
    add_options(srv, KVTransferConfig, "disaggregated serving")
    srv.set_defaults(handler=_serve)

    dl = commands.add_parser("download", help="fetch a Hugging Face Hub model into its cache and print the local path")
    dl.add_argument("name", metavar="NAME", help="ORG/NAME, or ORG/NAME:FILE.gguf for one file of a GGUF repository")
    add_options(dl, EngineConfig, "hub", only=("revision", "gguf_file", "hf_token", "download_dir"))
    dl.set_defaults(handler=_download)

    cache = commands.add_parser("cache", help="list or prune the cached quantised weights, compiled steps, models")
    cache.add_argument("action", choices=("list", "prune"), help="list the entries, or remove them")
    cache.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                       help="prune: only entries unused for DAYS days (default: every entry)")
    cache.add_argument("--dry-run", action="store_true", help="prune: say what would go, remove nothing")
    cache.set_defaults(handler=_cache)

    rtr = commands.add_parser("router", help="one OpenAI endpoint over prefill and decode engines (serve --role)")
    from .server.router_config import add_arguments as add_router_arguments

    add_router_arguments(rtr)
    rtr.set_defaults(handler=_router)

    bench = commands.add_parser("bench", help="run a benchmark and write JSON")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (text, engine_options) in BENCHMARKS.items():
        sub = kinds.add_parser(name, help=text)
        if with_bench:
            module = importlib.import_module(f".bench.{name.replace('-', '_')}", __package__)
            module.add_arguments(sub)
            if engine_options:
                add_options(sub, EngineConfig, "engine")
            sub.set_defaults(handler=module.run)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from .engine.llm import LLM

    for i, prompt in enumerate(args.prompts):  # cheap checks before the model loads
        if not prompt.strip():
            raise UserInputError(f"prompt {i}: empty prompt")
    engine_config = from_namespace(EngineConfig, args)
    params = from_namespace(SamplingParams, args)
    llm = LLM.from_config(engine_config)
    build = llm.engine.info.cpu_compile_build
    if build is not None and not args.verbose:   # (-v logs it): say what keeps running after this command
        who = f"pid {build.pid}" if build.pid is not None else "another process"
        print(f"gemmaserve: compiled CPU decode steps are being built in the background for later runs ({who}, "
              f"a few minutes the first time; log: {build.log_path}); --cpu-compile off skips it", file=sys.stderr)
    images = [list(args.image) for _ in args.prompts] if args.image else None
    audio = [list(args.audio) for _ in args.prompts] if args.audio else None
    videos = [list(args.video) for _ in args.prompts] if args.video else None
    if len(args.prompts) == 1 and params.n == 1 and not args.json:
        # One prompt: stream the continuation to the terminal as it is generated.
        deltas = llm.stream(args.prompts, params, images=images, audio=audio, videos=videos, lora=args.lora)
        first = next(deltas, None)   # the request is checked before anything is printed
        print(args.prompts[0], end="", flush=True)
        logprobs = []
        for delta in itertools.chain([first] if first is not None else [], deltas):
            print(delta.outputs[0].delta_text, end="", flush=True)
            logprobs += delta.outputs[0].delta_logprobs or []
        print(flush=True)
        if params.logprobs is not None:
            _print_logprobs(llm.tokenizer, logprobs, params.logprobs)
    else:
        outputs = llm.generate(args.prompts, params, images=images, audio=audio, videos=videos, lora=args.lora)  # a progress bar on a terminal
        for i, out in enumerate(outputs):
            if args.json:
                print(json.dumps(out.to_dict(), ensure_ascii=False), flush=True)
                continue
            for c in out.outputs:
                if i or c.index:
                    print()
                print(out.prompt + c.text, flush=True)
                if c.logprobs is not None:
                    _print_logprobs(llm.tokenizer, c.logprobs, params.logprobs)
    if args.verbose:
        st = llm.engine.snapshot()
        info = llm.engine.info
        print(f"kv: {info.kv_cache_dtype}, manager {info.kv_manager}, "
              f"scratch {'on' if info.swa_scratch_reuse else 'off'}, "
              f"prefix caching {'on' if info.prefix_caching else 'off'}; pages {st.pages_used} used / {st.pages_cached} cached / "
              f"{st.pages_free} free of {st.pages_total}; prefix hit rate {st.prefix_hit_rate:.1%}; "
              f"preemptions {st.preemptions}", file=sys.stderr)
        if st.spec.drafted:
            print(f"speculative ({info.speculative}): {st.spec.accepted} of {st.spec.drafted} drafted "
                  f"tokens accepted ({st.spec.acceptance_rate:.1%}), {st.spec.mean_accepted_length:.2f} tokens per step",
                  file=sys.stderr)
    return 0


def _print_logprobs(tokenizer, logprobs: list, k: int) -> None:
    """One completion's --logprobs as a table under its text: each generated token (quoted, so spaces
    and newlines show), its natural-log probability, and its `k` most likely alternatives."""
    def show(token_id: int) -> str:
        return json.dumps(tokenizer.decode([token_id], skip_special_tokens=False), ensure_ascii=False)

    width = max([len("token")] + [len(show(lp.token_id)) for lp in logprobs])
    header = f"{'token':<{width}}  logprob"
    print(header + (f"  top {k}" if k else ""))
    for lp in logprobs:
        top = "  ".join(f"{show(t)} {p:.3f}" for t, p in lp.top)
        print(f"{show(lp.token_id):<{width}}  {lp.logprob:7.3f}  {top}".rstrip(), flush=True)


def _serve(args: argparse.Namespace) -> int:
    from .config.kv_transfer import KVTransferConfig
    from .engine.llm_engine import LLMEngine
    from .server.config import ServerConfig
    from .server.runner import serve

    server_config = from_namespace(ServerConfig, args)
    engine_config = from_namespace(EngineConfig, args).replace(serving=True)
    transfer = from_namespace(KVTransferConfig, args)
    if transfer.disaggregated:
        from .server.disagg import serve_role

        engine_config = engine_config.replace(kv_transfer=transfer)
        serve_role(lambda: LLMEngine(engine_config), server_config, transfer)
        return 0
    serve(lambda: LLMEngine(engine_config), server_config)   # listens (503 "loading") while the model loads
    return 0


def _download(args: argparse.Namespace) -> int:
    from .models.hub import HubSpec, fetch

    spec = HubSpec.parse(args.name, from_namespace(EngineConfig, args).hub_options())
    if spec is None:
        raise UserInputError(f"{args.name!r} is not a Hugging Face Hub name (ORG/NAME or ORG/NAME:FILE.gguf)")
    print(fetch(spec).path)
    return 0


def _cache(args: argparse.Namespace) -> int:
    from .models import cache_admin
    from .models.embedded import cache_dir

    if args.older_than is not None and not args.older_than >= 0:
        raise UserInputError(f"--older-than must be a number of days >= 0, got {args.older_than}")
    if args.action == "list" and (args.older_than is not None or args.dry_run):
        raise UserInputError("--older-than and --dry-run go with `gemmaserve cache prune`")
    root = cache_dir()
    found = cache_admin.entries(root)
    if args.action == "list":
        print(f"{root}\n{cache_admin.table(found)}")
        return 0
    gone = cache_admin.stale(found, args.older_than)
    for entry in gone if not args.dry_run else ():
        entry.remove()
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(gone)} of {len(found)} entries, {cache_admin.human(sum(e.nbytes for e in gone))}, from {root}")
    return 0


def _router(args: argparse.Namespace) -> int:
    from .server.router import serve_router
    from .server.router_config import config_from

    serve_router(config_from(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(with_bench="bench" in argv)
    args = parser.parse_args(argv)
    server = args.command in ("serve", "router")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format=("%(asctime)s " if server else "") + "%(levelname)s %(name)s: %(message)s")
    if server:   # a server's log says what it loads, builds and serves, and when
        logging.getLogger("gemmaserve").setLevel(logging.INFO)
    try:
        return args.handler(args)
    except UserInputError as exc:
        print(f"gemmaserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
