"""Soak: the real HTTP server under mixed traffic for a bounded time, then a pass/fail verdict on
what it must have given back once idle.

The server is `python -m moelora.cli serve ...`, started here as a subprocess and stopped at the
end, or one already running (--url, with its --api-key; adapters must be loadable at runtime).
Two setups:
- demo (the default): the demo model on the CPU with its adapters sql and chat, --max-loras 2
  (so slots are evicted and refilled);
- qwen3-30b-a3b (needs CUDA): the Qwen3-30B-A3B shape with dummy weights (--load-format
  dummy), a random tokenizer of its vocabulary with a ChatML template, and 4 random rank-16
  PEFT adapters on attention and every expert (--lora-modules), --max-loras 4;
- tiny-qwen3-moe: the same on the CPU at the demo's tiny shape, with the demo's traffic: the
  30B setup's path (dummy weights, the written tokenizer and adapters) at a size the CPU runs.
Both run with prefix caching on and --api-key, which allows loading adapters at runtime.

Traffic (bench/soak_traffic.py): concurrent async clients (6 on the demo, 32 on the 30B
shape: PROFILES), each drawing kinds from its own seeded random: completions and chats,
streamed or not, base or an adapter; aborts (a stream closed after a few chunks) and
disconnects (a non-streamed request closed before its answer); structured outputs (a JSON
schema, a regex, a choice), each finished answer checked against its constraint; prompts that
begin with long shared documents (prefix-cache hits); ~10% bad inputs, each of which must get
its own 4xx. Beside them one client loads, unloads and reloads an adapter (soak-hot, from a
served adapter's folder): an unload while its requests run answers 409 by design, and a
request that races the unload 404; both are expected 4xx. A warm-up of the same traffic comes
first; the baseline is read once the server is idle after it, and the end state once it is
idle after the timed load.

Verdict: exit 1, saying why, on any 5xx, error event mid-stream, request without an HTTP
answer (within the profile's request_timeout), or unexpected 4xx (also a bad input answered
otherwise than expected); a finished structured answer off its constraint; the server not idle
within idle_timeout (requests running or waiting, KV pages held by requests, adapter slot
references: 0 when idle; cached pages nobody holds are free, so they do not count); memory
grown past its bound (below); the server gone or /health not 200; a kind of traffic that never
happened, no server-side abort, or no prefix-cache hit.

The memory bounds, the end against the baseline (both idle):
- GPU: torch's allocated bytes within 64 MiB. The KV cache (the prefix cache's pages among
  them) and the adapter slots are allocated at start, and a step frees what it allocates, so a
  growth is a leak; 64 MiB leaves room for the allocator's rounding and the temporaries of a
  batch size the warm-up did not reach.
- host: RSS within max(200 MiB, 10% of the baseline). Python's and glibc's arenas and the
  tokenizer's and grammars' caches move it by tens of MiB; the 10% scales with the 30B setup's
  host copies of its adapters (~1.2 GiB each), so one leaked copy still fails. The growth per
  request served is printed beside it.

    PYTHONPATH=. python bench/soak.py [--duration S] [--shape demo|qwen3-30b-a3b] [--seed N]
        [--url URL --api-key KEY] [--hot-adapter PATH] [--out PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import soak_traffic
from common import result_header, served_model_folder, write_random_peft_adapter, write_result
from soak_traffic import KINDS, Hot, Profile, Tally, Traffic, scrape

from moelora.models.shapes import shape_config

API_KEY = "soak-key"
HOT = "soak-hot"
GPU_GROWTH = 64 << 20
RSS_GROWTH, RSS_SHARE = 200 << 20, 0.10
SHAPE_ADAPTERS, SHAPE_RANK = 4, 16  # the adapters a named shape's server starts with
DEVICE = {"demo": "cpu", "tiny-qwen3-moe": "cpu", "qwen3-30b-a3b": "cuda"}
IDLE = {  # gauges that must read 0 when nothing runs
    "moelora_num_requests_running": "requests running",
    "moelora_num_requests_waiting": "requests waiting",
    "moelora_kv_pages_used": "KV pages held by requests",
    "moelora_lora_slot_refs": "adapter slot references",
}
SHOWN = {  # gauges reported at baseline and end, beside IDLE's
    "moelora_kv_pages_cached": "KV pages in the prefix cache",
    "moelora_lora_slots_used": "adapter slots used",
    "moelora_loras_registered": "adapters registered",
    "process_resident_memory_bytes": "host RSS (MiB)",
    "moelora_gpu_memory_allocated_bytes": "GPU allocated (MiB)",
}
MUST_HAPPEN = ("abort", "disconnect", "adapter requests", "structured answers checked")
MUST_HAPPEN += ("load", "unload", "reload")  # a reload: a load of the folder after its unload

CPU_PROFILE = Profile(
    concurrency=6,
    max_tokens=(4, 40),
    long_tokens=200,
    disconnect_after=0.4,
    prefix_words=120,
    warmup=10.0,
    hot_hold=4.0,
    hot_gap=1.0,
    scrape_every=5.0,
    idle_timeout=30.0,
    request_timeout=120.0,
)
PROFILES = {
    "demo": CPU_PROFILE,
    "tiny-qwen3-moe": CPU_PROFILE,
    "qwen3-30b-a3b": Profile(
        concurrency=32,
        max_tokens=(16, 256),
        long_tokens=1024,
        disconnect_after=1.5,
        prefix_words=400,
        warmup=60.0,
        hot_hold=20.0,
        hot_gap=5.0,
        scrape_every=10.0,
        idle_timeout=120.0,
        request_timeout=300.0,  # a runtime load of a 30B-shape adapter holds every step meanwhile
    ),
}


# ---- the server ---------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    api_key: str
    command: list[str] = field(default_factory=list)  # empty: started elsewhere (--url)
    process: subprocess.Popen | None = None
    log: Path | None = None
    hot_path: str | None = None  # the hot adapter's folder (default: a served adapter's)
    setup_seconds: float = 0.0  # writing its model folder and adapters
    start_seconds: float = 0.0  # from its start to /health answering 200

    def log_tail(self, lines: int = 40) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def server_command(
    shape: str, port: int, work: Path, gpu_memory_utilization: float | None = None
) -> list[str]:
    """`moelora serve` of the setup; for a named shape it writes the model folder (config.json,
    tokenizer, chat template) and the adapters (into `work`) first."""
    flags = ["--enable-prefix-caching", "--api-key", API_KEY, "--port", str(port)]
    flags += ["--log-level", "warning"]
    serve = [sys.executable, "-m", "moelora.cli", "serve"]
    if shape == "demo":
        return [*serve, "demo", "--device", "cpu", "--max-loras", "2", *flags]
    folder, config = served_model_folder(shape), shape_config(shape)
    adapters = []
    for i in range(SHAPE_ADAPTERS):
        path = write_random_peft_adapter(work / f"a{i}", config, rank=SHAPE_RANK, seed=i)
        adapters.append(f"a{i}={path}")
    max_len = min(4096, int(config["max_position_embeddings"]))
    engine = ["--load-format", "dummy", "--served-model-name", shape, "--device", DEVICE[shape]]
    engine += ["--max-loras", "4", "--max-lora-rank", str(SHAPE_RANK)]
    engine += ["--max-model-len", str(max_len), "--max-num-seqs", "64", "--max-graph-bs", "64"]
    if gpu_memory_utilization is not None:  # a share of the GPU, for work run beside it
        engine += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return [*serve, folder, *engine, "--lora-modules", *adapters, *flags]


def start_server(
    shape: str, work: Path, timeout: float, gpu_memory_utilization: float | None = None
) -> Server:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    command = server_command(shape, port, work, gpu_memory_utilization)
    server = Server(f"http://127.0.0.1:{port}", API_KEY, command, log=work / "server.log")
    server.setup_seconds, start = time.monotonic() - start, time.monotonic()
    with open(server.log, "wb") as out:
        server.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    while time.monotonic() - start < timeout:
        if server.process.poll() is not None:
            code = server.process.returncode
            sys.exit(f"soak: the server exited with {code}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                server.start_seconds = time.monotonic() - start
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    sys.exit(f"soak: the server did not answer /health in {timeout:.0f} s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    if server.process is None or server.process.poll() is not None:
        return
    server.process.send_signal(signal.SIGINT)  # how a server is meant to stop
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


# ---- the run ------------------------------------------------------------------------------


@dataclass
class Run:
    """What the verdict and the report read."""

    tally: Tally  # the timed load
    warm: Tally  # the warm-up
    samples: list[tuple[float, dict[str, float]]]
    before: dict[str, float]  # /metrics at idle after the warm-up
    after: dict[str, float]  # /metrics at idle after the load
    idle_seconds: float  # from the load's end until idle (or the timeout)
    idle: bool
    load_seconds: float


def shared_docs(seed: int, words: int) -> list[str]:
    """Three long documents that prompts begin with: the same ones every run of a seed."""
    rng = random.Random(seed)
    return [soak_traffic.words(rng, words, words) for _ in range(3)]


async def soak(server: Server, profile: Profile, seed: int, duration: float) -> Run:
    limits = httpx.Limits(max_connections=profile.concurrency + 8)
    headers = {"Authorization": f"Bearer {server.api_key}"}
    async with httpx.AsyncClient(
        base_url=server.url, headers=headers, timeout=profile.request_timeout, limits=limits
    ) as client:
        cards = (await client.get("/v1/models")).raise_for_status().json()["data"]
        base = cards[0]["id"]
        roots = {c["id"]: c["root"] for c in cards[1:]}
        adapters = [name for name in roots if name != HOT]
        if not adapters:
            sys.exit("soak: the server serves no adapter: start it with --lora-modules")
        hot = Hot(HOT, server.hot_path or roots[adapters[0]], loaded=HOT in roots)

        def traffic(seconds: float, tally: Tally) -> Traffic:
            docs = shared_docs(seed, profile.prefix_words)
            deadline = time.monotonic() + seconds
            return Traffic(client, profile, base, adapters, hot, docs, deadline, tally)

        warm = traffic(profile.warmup, Tally())
        await soak_traffic.run(warm, seed + 1)
        before, _, idle = await wait_idle(client, warm.tally, profile.idle_timeout)
        if not idle:
            warm.tally.problem("not idle after the warm-up", json.dumps(idle_values(before)))
        load = traffic(duration, Tally())
        start = time.monotonic()
        await soak_traffic.run(load, seed)
        load_seconds = time.monotonic() - start
        after, idle_seconds, idle = await wait_idle(client, load.tally, profile.idle_timeout)
        await soak_traffic.get(client, "/health", load.tally)  # not a 200: a problem
    return Run(
        tally=load.tally,
        warm=warm.tally,
        samples=load.samples,
        before=before,
        after=after,
        idle_seconds=idle_seconds,
        idle=idle,
        load_seconds=load_seconds,
    )


def idle_values(m: dict[str, float]) -> dict[str, float]:
    return {name: m.get(name, float("nan")) for name in IDLE}


async def wait_idle(
    client: httpx.AsyncClient, tally: Tally, timeout: float
) -> tuple[dict[str, float], float, bool]:
    """(/metrics, seconds waited, whether every IDLE gauge read 0 before the timeout)."""
    start = time.monotonic()
    while True:
        m = await scrape(client, tally)
        if m and all(m.get(name) == 0 for name in IDLE):
            return m, time.monotonic() - start, True
        if time.monotonic() - start > timeout:
            return m, time.monotonic() - start, False
        await asyncio.sleep(0.25)


# ---- verdict and report --------------------------------------------------------------------


def rss_bound(before: dict[str, float]) -> float:
    return max(RSS_GROWTH, RSS_SHARE * before.get("process_resident_memory_bytes", 0))


def delta(run: Run, name: str) -> float:
    return run.after.get(name, 0) - run.before.get(name, 0)


def verdict(run: Run, server: Server) -> list[str]:
    """Why the soak fails; empty: it passes."""
    reasons = [f"warm-up: {what} (x{n})" for what, n in run.warm.problems.items()]
    reasons += [f"{what} (x{n})" for what, n in run.tally.problems.items()]
    if not run.idle:
        busy = {IDLE[k]: v for k, v in idle_values(run.after).items() if v != 0}
        reasons.append(f"not idle {run.idle_seconds:.0f} s after the load: {busy}")
    gpu = delta(run, "moelora_gpu_memory_allocated_bytes")
    if gpu > GPU_GROWTH:
        reasons.append(f"GPU allocated grew by {mib(gpu)} (bound {mib(GPU_GROWTH)})")
    rss = delta(run, "process_resident_memory_bytes")
    if rss > rss_bound(run.before):
        bound = mib(rss_bound(run.before))
        reasons.append(f"host RSS grew by {mib(rss)} (bound {bound})")
    if "process_resident_memory_bytes" not in run.after:
        reasons.append("/metrics has no process_resident_memory_bytes")
    if server.process is not None and server.process.poll() is not None:
        reasons.append(f"the server exited with {server.process.returncode}")
    reasons += [f"no {kind} request was sent" for kind in KINDS if not run.tally.sent(kind)]
    reasons += [f"no {event} happened" for event in MUST_HAPPEN if not run.tally.events[event]]
    if delta(run, "moelora_prefix_cache_hits_total") <= 0:
        reasons.append("no prefix-cache hit during the load")
    if aborted(run.after) - aborted(run.before) <= 0:
        reasons.append("the server counted no aborted request during the load")
    return reasons


def aborted(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("moelora_requests_total") and "abort" in k)


def mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def ms(values: list[float], q: float) -> str:
    """The q-th percentile of `values` (s) in ms, by nearest rank ("-": none)."""
    if not values:
        return "-"
    ranked = sorted(values)
    return f"{ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)] * 1e3:.0f}"


CLASSES = ("2xx", "4xx expected", "4xx unexpected", "5xx", "cancelled", "error")


def traffic_table(tally: Tally) -> list[str]:
    lines = ["| kind | sent | " + " | ".join(CLASSES) + " | p50 ms | p99 ms |"]
    lines.append("|---|" + "---:|" * (len(CLASSES) + 3))
    for kind in (*KINDS, "adapter ops"):
        counts = [tally.outcomes[kind, c] for c in CLASSES]
        lat = tally.latency[kind]
        row = [kind, str(sum(counts)), *map(str, counts), ms(lat, 50), ms(lat, 99)]
        lines.append("| " + " | ".join(row) + " |")
    every = [x for lat in tally.latency.values() for x in lat]
    totals = [sum(tally.outcomes[k, c] for k in (*KINDS, "adapter ops")) for c in CLASSES]
    lines.append(
        f"| all | {sum(totals)} | "
        + " | ".join(map(str, totals))
        + f" | {ms(every, 50)} | {ms(every, 99)} |"
    )
    return lines


def state_table(run: Run) -> list[str]:
    lines = ["| figure | baseline (idle, after warm-up) | end (idle, after load) | bound |"]
    lines.append("|---|---:|---:|---|")
    requests = max(1, sum(run.tally.sent(kind) for kind in KINDS))
    for name, label in {**IDLE, **SHOWN}.items():
        b, a = run.before.get(name, float("nan")), run.after.get(name, float("nan"))
        bound = "0" if name in IDLE else ""
        if name == "process_resident_memory_bytes":
            per_request = (a - b) / requests / 1024
            bound = f"+{mib(rss_bound(run.before))} ({per_request:+.1f} KiB a request sent)"
        elif name == "moelora_gpu_memory_allocated_bytes":
            bound = f"+{mib(GPU_GROWTH)}"
        if name.endswith("bytes"):
            lines.append(f"| {label} | {b / 2**20:.1f} | {a / 2**20:.1f} | {bound} |")
        else:
            lines.append(f"| {label} | {b:g} | {a:g} | {bound} |")
    return lines


def report(args, run: Run, server: Server, reasons: list[str]) -> list[str]:
    device = DEVICE[args.shape]
    lines = result_header(
        f"Soak, {args.shape} on {device}, {args.duration:g} s", None, device=device
    )
    p = PROFILES[args.shape]
    lines.append(f"- server: `{' '.join(server.command) or server.url}`")
    if server.setup_seconds >= 0.1:  # a named shape's
        lines.append(f"- model folder and adapters written in {server.setup_seconds:.1f} s")
    if server.start_seconds:
        lines.append(f"- server start to /health: {server.start_seconds:.1f} s")
    warm = sum(n for (kind, _), n in run.warm.outcomes.items() if kind in KINDS)
    lines.append(
        f"- {p.concurrency} clients, seed {args.seed}; warm-up {p.warmup:g} s ({warm} requests); "
        f"load {run.load_seconds:.1f} s; idle {run.idle_seconds:.1f} s after it"
    )
    lines += ["", "## Traffic", "", *traffic_table(run.tally), ""]
    ttft = run.tally.ttft
    lines.append(
        f"Streams read to [DONE]: {len(ttft)}, time to first token p50 {ms(ttft, 50)} ms, "
        f"p99 {ms(ttft, 99)} ms."
    )
    events = ", ".join(f"{k} {v}" for k, v in sorted(run.tally.events.items()))
    lines.append(f"Events: {events}.")
    hits = delta(run, "moelora_prefix_cache_hits_total")
    queries = delta(run, "moelora_prefix_cache_queries_total")
    lines.append(
        f"Prefix cache: {hits:g} of {queries:g} prompt tokens looked up were hits; server-side "
        f"aborts {aborted(run.after) - aborted(run.before):g}."
    )
    lines += ["", "## Server state", "", *state_table(run), ""]
    lines += ["## Samples during the load", "", samples_table(run.samples), ""]
    lines += ["## Verdict", "", "PASS" if not reasons else "FAIL:"]
    lines += [f"- {r}: {example(run, r)}" for r in reasons]
    return lines


def samples_table(samples: list[tuple[float, dict[str, float]]]) -> str:
    gauges = [*IDLE, "moelora_kv_pages_cached"]
    memory = ["process_resident_memory_bytes", "moelora_gpu_memory_allocated_bytes"]
    head = [IDLE[g] for g in IDLE] + ["KV pages cached", "RSS MiB", "GPU MiB"]
    rows = ["| s | " + " | ".join(head) + " |", "|" + "---:|" * (len(head) + 1)]
    for t, m in samples:
        cells = [f"{t:.0f}", *(f"{m.get(g, 0):g}" for g in gauges)]
        cells += [f"{m.get(g, 0) / 2**20:.0f}" for g in memory]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def example(run: Run, reason: str) -> str:
    for tally, prefix in ((run.tally, ""), (run.warm, "warm-up: ")):
        for what, detail in tally.examples.items():
            if reason.startswith(prefix + what):
                return detail
    return ""


def summary(run: Run, reasons: list[str]) -> dict:
    """What --json writes (tests/test_soak.py reads it)."""
    outcomes: dict[str, dict[str, int]] = {}
    for (kind, cls), n in run.tally.outcomes.items():
        outcomes.setdefault(kind, {})[cls] = n
    return {
        "pass": not reasons,
        "reasons": reasons,
        "sent": {kind: run.tally.sent(kind) for kind in KINDS},
        "outcomes": outcomes,
        "events": dict(run.tally.events),
        "prefix_cache_hits": delta(run, "moelora_prefix_cache_hits_total"),
        "server_aborts": aborted(run.after) - aborted(run.before),
        "before": run.before,
        "after": run.after,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="s of timed load")
    parser.add_argument("--shape", choices=list(PROFILES), default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server's URL (default: start one)")
    parser.add_argument("--api-key", default=API_KEY, help="with --url: the server's key")
    parser.add_argument(
        "--hot-adapter", help="the folder loaded and unloaded (default: a served adapter's)"
    )
    parser.add_argument("--start-timeout", type=float, default=1200.0, help="s for /health")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, help="the CUDA server's (default: its own)"
    )
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    parser.add_argument("--json", help="also write the figures as JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="moelora-soak-") as work:
        if args.url:
            server = Server(args.url.rstrip("/"), args.api_key, hot_path=args.hot_adapter)
        else:
            print(f"starting the {args.shape} server ...", flush=True)
            server = start_server(
                args.shape, Path(work), args.start_timeout, args.gpu_memory_utilization
            )
            server.hot_path = args.hot_adapter
            took = (
                f"{server.setup_seconds:.1f} s to write it, {server.start_seconds:.1f} s to start"
            )
            print(f"serving ({took}): {' '.join(server.command)}", flush=True)
        try:
            run = asyncio.run(soak(server, PROFILES[args.shape], args.seed, args.duration))
            reasons = verdict(run, server)
        finally:
            stop_server(server)
        if reasons and server.log is not None:
            print(f"the server's log, last lines:\n{server.log_tail()}")
    lines = report(args, run, server, reasons)
    print("\n".join(lines), flush=True)
    write_result(f"soak-{args.shape}", lines, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(summary(run, reasons), indent=1) + "\n")
    sys.exit(1 if reasons else 0)


if __name__ == "__main__":
    main()
