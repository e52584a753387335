"""moelora serve | generate | bench | demo.

Environment variables are read here, once, at startup: MOELORA_CACHE (where the demo lives).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import typing
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

RANDOM_LORA_RANK = 16  # --random-lora's rank when none is given: the benchmarks' rank
DEMO_PROMPTS = [
    ("sql", "SELECT name FROM users WHERE"),
    ("chat", "Tell me a story about a cat."),
    (None, "The capital of France is"),
    ("sql", "What is a mixture of experts?"),
]


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    cache = os.environ.get("MOELORA_CACHE")
    args.cache_dir = Path(cache) / "demo" if cache else None
    from moelora.errors import MoeloraError

    try:
        args.func(args)
    except KeyboardInterrupt:  # Ctrl-C is how a server is meant to stop
        pass
    except MoeloraError as e:  # the user's doing: the message says what to change
        sys.exit(f"moelora: {e}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", help="a Hugging Face model folder, or 'demo'")
    _engine_args(serve)
    _server_args(serve)
    serve.set_defaults(func=cmd_serve)

    generate = commands.add_parser("generate", help="generate offline, print the text")
    generate.add_argument("model", help="a Hugging Face model folder, or 'demo'")
    generate.add_argument("--prompt", action="append", required=True, help="repeatable")
    generate.add_argument("--lora", default=None, help="the adapter to use (a registered name)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    _engine_args(generate)
    generate.set_defaults(func=cmd_generate)

    bench = commands.add_parser(
        "bench", help="offline throughput on random prompts (vLLM's `bench throughput`)"
    )
    bench.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face model folder, or 'demo'; none with --shape or --hf-config",
    )
    _bench_args(bench)
    _engine_args(bench)
    bench.set_defaults(func=cmd_bench)

    demo = commands.add_parser("demo", help="the built-in demo model and its two adapters")
    demo.add_argument("--serve", action="store_true", help="serve it and query it over HTTP")
    demo.add_argument("--once", action="store_true", help="with --serve: exit after the queries")
    _engine_args(demo)
    _server_args(demo)
    demo.set_defaults(func=cmd_demo, model="demo")
    return parser


def _bench_args(p: argparse.ArgumentParser) -> None:
    from moelora.models.shapes import SHAPES

    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument(
        "--lora",
        action="append",
        default=None,
        help="repeatable; requests cycle through these adapters ('base' for none; default: the "
        "--random-lora adapters, else base)",
    )
    p.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="with --load-format dummy: a named model shape instead of a model folder",
    )
    p.add_argument(
        "--hf-config",
        metavar="PATH",
        help="with --load-format dummy: a config.json (or a folder holding one) to build the "
        "model from, instead of a model folder",
    )
    p.add_argument(
        "--random-lora",
        action="append",
        default=[],
        metavar="NAME[:RANK]",
        help="repeatable: register an adapter of random weights on every projection the model "
        f"can adapt (LLM.add_random_lora), of rank RANK (default {RANDOM_LORA_RANK})",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    """A flag for each EngineConfig field with a help text: --max-loras sets max_loras."""
    for f, hint in _engine_flags():
        p.add_argument(f"--{f.name.replace('_', '-')}", **_flag_options(f, hint))


def _engine_flags() -> list[tuple[dataclasses.Field, object]]:
    """EngineConfig's fields that the command line sets, each with its resolved type hint."""
    from moelora.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    return [(f, hints[f.name]) for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def _flag_options(f: dataclasses.Field, hint: object) -> dict:
    """argparse's options for a field's flag, its default the field's: a bool is a switch (with
    a --no- form when it is on by default), a mapping is given as NAME=PATH items, anything
    else is one value of its type (None allowed where the type is optional)."""
    options = dict(f.metadata)  # help, and choices where the field has them
    if hint is bool:  # --flag turns it on, and --no-flag off where it is on by default
        if f.default:
            return {**options, "action": argparse.BooleanOptionalAction, "default": True}
        return {**options, "action": "store_true"}
    if typing.get_origin(hint) is Mapping:
        return {**options, "nargs": "+", "default": [], "metavar": "NAME=PATH"}
    value_type = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    return {**options, "type": value_type, "default": f.default}


def _server_args(p: argparse.ArgumentParser) -> None:
    from moelora.server.ingress import DEFAULT_MAX_REQUEST_BYTES
    from moelora.server.serve import DEFAULT_SHUTDOWN_TIMEOUT

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse a larger request body with 413 (default: %(default)s, 8 MiB)",
    )
    p.add_argument(
        "--lora-root",
        action="append",
        default=[],
        metavar="DIR",
        help="repeatable: /v1/load_lora_adapter loads only adapters inside these folders "
        "(without one, loading needs --api-key)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long running requests may go on before they are aborted "
        "(new ones are refused at once; 0: abort at once; default: %(default)s)",
    )


def _server_options(args: argparse.Namespace, log_level: str):
    from moelora.server.serve import ServerOptions

    return ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=log_level,
        max_request_bytes=args.max_request_bytes,
        lora_roots=tuple(Path(root).resolve() for root in args.lora_root),
        shutdown_timeout=args.shutdown_timeout,
    )


def _lora_modules(items: list[str]) -> dict[str, str]:
    modules = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            sys.exit(f"--lora-modules {item!r}: expected NAME=PATH")
        modules[name] = path
    return modules


def _engine_config(args: argparse.Namespace, model: str | None = None):
    """EngineConfig from the flags; 'demo' means the demo folder and its adapters. `model`, where
    given, is the folder to use instead of the model argument (bench's --shape)."""
    from moelora.config import EngineConfig

    options = {f.name: getattr(args, f.name) for f, _ in _engine_flags()}
    options["lora_modules"] = _lora_modules(args.lora_modules)
    model = model or args.model
    if model == "demo":
        from moelora.demo import ensure_demo

        assets = ensure_demo(args.cache_dir)
        model = str(assets.model)
        options["served_model_name"] = args.served_model_name or "demo"
        demo_modules = {n: str(p) for n, p in assets.adapters.items()}
        options["lora_modules"] = {**demo_modules, **options["lora_modules"]}
    if not Path(model).is_dir():
        sys.exit(f"moelora: model {model!r} is not a folder: expected a Hugging Face model folder")
    # An invalid value raises ConfigError, which main turns into a one-line message.
    return EngineConfig(model=model, **options)


def cmd_serve(args: argparse.Namespace) -> None:
    from moelora.server.serve import run_server

    options = _server_options(args, args.log_level)
    run_server(_engine_config(args), options)


def _llm(config):
    """The offline engine with every option the config holds."""
    from moelora import LLM

    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return LLM(options.pop("model"), **options)


def cmd_generate(args: argparse.Namespace) -> None:
    from moelora import SamplingParams

    llm = _llm(_engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for out in llm.generate(args.prompt, params, lora=args.lora):
        print(out.text)


def cmd_bench(args: argparse.Namespace) -> None:
    """Random token prompts, ignore_eos, greedy: every request runs input + output tokens, so
    the figure depends on the engine, not on the text."""
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            sys.exit(f"moelora: --{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    random_loras = [_random_lora(item) for item in args.random_lora]
    with _bench_model(args) as model:
        llm = _llm(_engine_config(args, model))
        for i, (name, rank) in enumerate(random_loras):
            llm.add_random_lora(name, rank=rank, seed=args.seed + i)
        cycle = args.lora or [name for name, _ in random_loras] or ["base"]
        _run_bench(llm, args, [None if name == "base" else name for name in cycle])


@contextlib.contextmanager
def _bench_model(args: argparse.Namespace) -> Iterator[str]:
    """The model folder to build from: the model argument, or a temporary folder that holds
    only the config.json of --shape or --hf-config (for --load-format dummy)."""
    from moelora.models.shapes import write_config_folder

    given = [flag for flag, v in (("--shape", args.shape), ("--hf-config", args.hf_config)) if v]
    if len(given) > 1 or (given and args.model):
        sys.exit(f"moelora: give one of the model argument, --shape and --hf-config, not {given}")
    if not given:
        if args.model is None:
            sys.exit("moelora: expected a model folder, 'demo', --shape NAME or --hf-config PATH")
        yield args.model
        return
    if args.load_format != "dummy":
        sys.exit(f"moelora: {given[0]} gives a model without weights: add --load-format dummy")
    with tempfile.TemporaryDirectory(prefix="moelora-shape-") as folder:
        yield str(write_config_folder(_bench_config(args), folder))


def _bench_config(args: argparse.Namespace) -> dict:
    """The config.json that --shape names or --hf-config holds."""
    from moelora.models.shapes import shape_config

    if args.shape:
        return shape_config(args.shape)
    path = Path(args.hf_config)
    path = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"moelora: --hf-config {args.hf_config!r}: expected a config.json: {e}")


def _random_lora(item: str) -> tuple[str, int]:
    """NAME[:RANK] -> (name, rank)."""
    name, sep, rank = item.partition(":")
    if name and not sep:
        return name, RANDOM_LORA_RANK
    if name and rank.isdigit() and int(rank) >= 1:
        return name, int(rank)
    sys.exit(f"moelora: --random-lora {item!r}: expected NAME or NAME:RANK, RANK an integer >= 1")


def _run_bench(llm, args: argparse.Namespace, cycle: list[str | None]) -> None:
    import time

    import torch

    from moelora import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (args.num_prompts, args.input_len), generator=gen).tolist()
    loras = [cycle[i % len(cycle)] for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), lora=loras[:1])  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    total = generated + args.num_prompts * args.input_len
    names = [n or "base" for n in cycle]
    config = llm.engine.config
    weights = " (dummy weights)" if config.load_format == "dummy" else ""
    print(
        f"model: {args.shape or args.hf_config or config.model}{weights} on {config.torch_device}"
    )
    print(
        f"requests: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), "
        f"adapters cycled: {names}"
    )
    print(
        f"throughput: {args.num_prompts / seconds:.2f} requests/s, {total / seconds:.1f} total "
        f"tokens/s, {generated / seconds:.1f} output tokens/s ({seconds:.2f} s)"
    )


def cmd_demo(args: argparse.Namespace) -> None:
    if args.serve:
        _demo_serve(args)
        return
    from moelora import SamplingParams

    config = _engine_config(args)
    llm = _llm(config)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    loras = [lora for lora, _ in DEMO_PROMPTS]
    outs = llm.generate([prompt for _, prompt in DEMO_PROMPTS], params, lora=loras)
    print(f"demo model: {config.model}")
    for (lora, prompt), out in zip(DEMO_PROMPTS, outs):
        print(f"[{lora or 'base':>5}] {prompt!r} -> {out.text!r}")


def _demo_serve(args: argparse.Namespace) -> None:
    from moelora.server.serve import run_server

    config = _engine_config(args)
    options = _server_options(args, "warning")
    url = f"http://{args.host}:{args.port}"

    def query_then_hint(stop) -> None:
        try:
            _demo_queries(url, args.api_key)
        except Exception as e:  # the server goes on serving; say what went wrong
            print(f"demo request failed: {e!r}", flush=True)
        _print_hints(url, args.api_key, forever=not args.once)
        if args.once:
            stop()

    run_server(config, options, on_started=query_then_hint)


def _post(url: str, body: dict, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _demo_queries(url: str, api_key: str | None) -> None:
    print(f"moelora is serving the demo model on {url}", flush=True)
    for lora, prompt in DEMO_PROMPTS[:3]:
        body = {"model": lora or "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        text = _post(f"{url}/v1/completions", body, api_key)["choices"][0]["text"]
        print(f"[{lora or 'base':>5}] {prompt!r} -> {text!r}", flush=True)


def _print_hints(url: str, api_key: str | None, *, forever: bool) -> None:
    lines = ["", "Try it (the model field picks the adapter: demo, sql or chat):"]
    print("\n".join([*lines, *(f"  {c}" for c in _hint_commands(url, api_key))]), flush=True)
    if forever:
        print("Serving until Ctrl-C.", flush=True)


def _hint_commands(url: str, api_key: str | None) -> list[str]:
    """Shell commands that work pasted as they are: the Python line runs this process's
    interpreter (the one that has openai), and every generation is bounded by max_tokens."""
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""

    def post(flags: str, path: str, body: dict) -> str:
        headers = f"{auth} -H 'Content-Type: application/json'"
        return f"curl{flags} {url}{path}{headers} \\\n      -d {shlex.quote(json.dumps(body))}"

    completion = {"model": "sql", "prompt": "SELECT", "max_tokens": 16, "temperature": 0}
    chat = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 32,
        "stream": True,
    }
    python = (  # inside double quotes: no ", $, ` or \ in it
        f"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{api_key or 'none'}'"
        "); \\\nprint(c.completions.create(model='chat', prompt='Hello', max_tokens=16)"
        ".choices[0].text)"
    )
    return [
        f"curl {url}/v1/models{auth}",
        post("", "/v1/completions", completion),
        post(" -N", "/v1/chat/completions", chat),
        f"curl {url}/metrics",
        f'{shlex.quote(sys.executable)} -c "{python}"',
    ]


if __name__ == "__main__":
    main()
