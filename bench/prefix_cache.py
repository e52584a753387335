"""Prefix caching end to end: a multi-turn chat workload through `Engine.step()`, caching on and
off, on a Qwen3-30B-A3B shape with random weights.

- The workload: 64 conversations x 4 turns, closed loop: every conversation's turn 1 arrives
  at once, and each next turn arrives as soon as the answer to the one before it is complete.
  Conversation c uses adapter a(c % 9) of 8 random rank-16 adapters on attention and every
  expert, or base for c % 9 == 8. Each namespace (8 adapters, base) has its own 1024-token
  system prompt; a turn's prompt is the system prompt, the turns before it (user message and
  answer), and a new 64-token user message; each answer is 200 tokens (max_tokens, greedy,
  ignore_eos). TTFT = the wall time from add_request to the step() that returns the turn's
  first token; throughput = every token of the workload over its wall time.
- The no-shared-prefix workload: 128 requests of 1088 distinct random tokens (no two share a
  page), 200 tokens out, through the same loop, 64 at a time: what caching costs when it never
  hits (hashing every page, registering it, an eviction list).
- Beside them, measured in the same run on the caching-off engine: a decode step of 64
  requests with 1024-token contexts, CUDA-graph replay + lm_head (bench/decode.py's timing),
  times the workload's 800 decode steps, a reference for what the workload would take if no
  prompt cost anything (a reference, not a floor: the chat's own steps run base and adapter
  requests at contexts of 1088 to 2000 tokens, and their mean came out below it); and the
  prompt tokens each engine computed (prefix-cache queries - hits).
Both engines are built in this one process (LoRA enabled, async scheduling on), caching on
first, then off, and warmed on other prompts before the clock starts.

    PYTHONPATH=.:bench python bench/prefix_cache.py [--smoke] [--layers N] [--out PATH]

--smoke: the tiny demo shape on the CPU, 6 conversations x 2 turns: shows that the script
runs end to end; its figures mean nothing (written to a temporary file unless --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import dataclass, field

import torch
from common import model_folder, plan_step, result_header, sync, time_step, write_result

from moelora import LLM, SamplingParams
from moelora.engine.engine import Engine
from moelora.step.batch import pages_for

PAGE_SIZE = 16


@dataclass(frozen=True)
class Setup:
    shape: str
    layers: int | None
    device: str
    dtype: str
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    adapters: int  # conversation c on adapter c % (adapters + 1); the last one is base
    rank: int
    unshared_requests: int
    max_num_batched_tokens: int

    @property
    def max_model_len(self) -> int:
        return self.system_tokens + self.turns * (self.user_tokens + self.answer_tokens) + PAGE_SIZE

    @property
    def num_pages(self) -> int:
        # twice what the live conversations need: room for the cached pages nobody holds
        return 2 * self.conversations * pages_for(self.max_model_len, PAGE_SIZE) + 16


FULL = Setup(
    shape="qwen3-30b-a3b",
    layers=48,
    device="cuda",
    dtype="bfloat16",
    conversations=64,
    turns=4,
    system_tokens=1024,
    user_tokens=64,
    answer_tokens=200,
    adapters=8,
    rank=16,
    unshared_requests=128,
    max_num_batched_tokens=16384,
)
SMOKE = Setup(
    shape="tiny-qwen3-moe",
    layers=None,
    device="cpu",
    dtype="float32",
    conversations=6,
    turns=2,
    system_tokens=40,
    user_tokens=8,
    answer_tokens=6,
    adapters=2,
    rank=4,
    unshared_requests=6,
    max_num_batched_tokens=128,
)


@dataclass
class Turn:
    conversation: int
    number: int  # 1-based
    prompt: list[int]
    lora: str | None
    submitted: float
    first_token: float | None = None


@dataclass
class Run:
    """One workload on one engine: each turn's TTFT, the wall time, the tokens."""

    caching: bool
    workload: str
    seconds: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    computed_prompt_tokens: int = 0  # prefix-cache queries - hits (all of them when off)
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn number -> seconds

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    def ttft_ms(self, turns: range, q: float) -> float:
        values = sorted(t for n in turns for t in self.ttft.get(n, []))
        return 1e3 * values[min(len(values) - 1, int(q * len(values)))]


def random_tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def build(setup: Setup, folder: str, *, caching: bool) -> tuple[LLM, list[str | None]]:
    llm = LLM(
        model=folder,
        load_format="dummy",
        device=setup.device,
        dtype=setup.dtype,
        enable_lora=True,
        max_loras=setup.adapters,
        max_lora_rank=setup.rank,
        max_num_seqs=setup.conversations,
        max_graph_bs=setup.conversations,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        page_size=PAGE_SIZE,
        num_pages=setup.num_pages,
        enable_prefix_caching=caching,
    )
    names: list[str | None] = [f"a{i}" for i in range(setup.adapters)]
    for seed, name in enumerate(names):
        llm.add_random_lora(name, rank=setup.rank, seed=seed)
    return llm, [*names, None]


# ---- the workloads ----------------------------------------------------------------------


def chat(engine: Engine, setup: Setup, loras: list[str | None], *, seed: int, caching: bool) -> Run:
    """The multi-turn workload, closed loop, through Engine.step()."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    systems = [random_tokens(gen, vocab, setup.system_tokens) for _ in loras]
    params = SamplingParams(max_tokens=setup.answer_tokens, temperature=0, ignore_eos=True)
    run = Run(caching, "chat")
    live: dict[str, Turn] = {}

    def submit(conversation: int, number: int, history: list[int]) -> None:
        lora = loras[conversation % len(loras)]
        prompt = history + random_tokens(gen, vocab, setup.user_tokens)
        rid = f"c{seed}-{conversation}-{number}"
        live[rid] = Turn(conversation, number, prompt, lora, time.perf_counter())
        engine.add_request(rid, prompt, params, lora)
        run.prompt_tokens += len(prompt)

    before = engine.stats()
    sync(setup.device)
    start = time.perf_counter()
    for c in range(setup.conversations):
        submit(c, 1, systems[c % len(loras)])
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            turn = live[out.request_id]
            if turn.first_token is None and out.token_ids:
                turn.first_token = now
                run.ttft.setdefault(turn.number, []).append(now - turn.submitted)
            if out.finished:
                del live[out.request_id]
                run.output_tokens += len(out.token_ids)
                if turn.number < setup.turns:
                    submit(turn.conversation, turn.number + 1, turn.prompt + list(out.token_ids))
    sync(setup.device)
    run.seconds = time.perf_counter() - start
    run.computed_prompt_tokens = computed(engine, before, run)
    return run


def unshared(engine: Engine, setup: Setup, *, seed: int, caching: bool) -> Run:
    """Distinct random prompts, conversations-many at a time (each finished one replaced)."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    length = setup.system_tokens + setup.user_tokens
    params = SamplingParams(max_tokens=setup.answer_tokens, temperature=0, ignore_eos=True)
    run = Run(caching, "no shared prefix")
    waiting = [random_tokens(gen, vocab, length) for _ in range(setup.unshared_requests)]
    submitted: dict[str, float] = {}

    def submit() -> None:
        rid = f"u{seed}-{len(waiting)}"
        prompt = waiting.pop()
        submitted[rid] = time.perf_counter()
        engine.add_request(rid, prompt, params, None)
        run.prompt_tokens += len(prompt)

    before = engine.stats()
    sync(setup.device)
    start = time.perf_counter()
    for _ in range(min(setup.conversations, len(waiting))):
        submit()
    while submitted:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if len(out.token_ids) == 1:
                run.ttft.setdefault(1, []).append(now - submitted[out.request_id])
            if out.finished:
                del submitted[out.request_id]
                run.output_tokens += len(out.token_ids)
                if waiting:
                    submit()
    sync(setup.device)
    run.seconds = time.perf_counter() - start
    run.computed_prompt_tokens = computed(engine, before, run)
    return run


def computed(engine: Engine, before, run: Run) -> int:
    """Prompt tokens this run computed: every one without caching, else the misses."""
    if not engine.config.enable_prefix_caching:
        return run.prompt_tokens
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return run.prompt_tokens - hits if queries else run.prompt_tokens


def decode_reference_ms(engine: Engine, setup: Setup) -> float:
    """Graph replay + lm_head of one decode step of `conversations` requests with
    system-prompt-long contexts (eager forward on the CPU)."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(99)
    params = SamplingParams(max_tokens=setup.answer_tokens, temperature=0, ignore_eos=True)
    ids = [f"reference-{i}" for i in range(setup.conversations)]
    for rid in ids:
        engine.add_request(rid, random_tokens(gen, vocab, setup.system_tokens), params, None)
    try:
        pending = set(ids)
        while pending:
            pending -= {out.request_id for out in engine.step()}
        planned = plan_step(engine)
        assert planned.inputs.num_tokens == len(ids), "not a decode step of every request"
        return time_step(planned, eager=setup.device == "cpu", device=setup.device)
    finally:
        for rid in ids:
            engine.abort_request(rid)


def warm_up(llm: LLM, setup: Setup, loras: list[str | None]) -> None:
    """Compile what the workloads run (a full prefill chunk, decode steps, cached extends) on
    other prompts; then the cache is emptied so that nothing of it helps the timed runs."""
    small = dataclasses.replace(setup, conversations=min(setup.conversations, 9), turns=2)
    small = dataclasses.replace(small, answer_tokens=4, unshared_requests=4)
    chat(llm.engine, small, loras, seed=1000, caching=False)
    unshared(llm.engine, small, seed=1001, caching=False)
    llm.engine.reset_prefix_cache()


def measure(setup: Setup, folder: str) -> tuple[list[Run], float, dict[bool, float]]:
    runs, reference, built = [], 0.0, {}
    for caching in (True, False):
        start = time.perf_counter()
        llm, loras = build(setup, folder, caching=caching)
        built[caching] = time.perf_counter() - start
        print(f"engine caching={caching}: built in {built[caching]:.1f} s", flush=True)
        warm_up(llm, setup, loras)
        for run in (
            chat(llm.engine, setup, loras, seed=1, caching=caching),
            unshared(llm.engine, setup, seed=2, caching=caching),
        ):
            runs.append(run)
            print_run(run, setup)
        if not caching:
            reference = decode_reference_ms(llm.engine, setup)
            print(f"decode step of {setup.conversations}: replay+lm_head {reference:.3f} ms")
        del llm
        gc.collect()
        if setup.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return runs, reference, built


def print_run(run: Run, setup: Setup) -> None:
    later = range(2, setup.turns + 1)
    ttft = f"TTFT p50 turn 1 {run.ttft_ms(range(1, 2), 0.5):8.1f} ms"
    if run.workload == "chat":
        ttft += f"  turns 2-{setup.turns} p50 {run.ttft_ms(later, 0.5):8.1f} ms"
    print(
        f"caching={'on ' if run.caching else 'off'} {run.workload:>16}: {run.seconds:7.2f} s "
        f"{run.tokens_per_s:9.0f} tok/s  computed prompt tokens {run.computed_prompt_tokens}  "
        f"{ttft}",
        flush=True,
    )


# ---- the result file --------------------------------------------------------------------


def report(setup: Setup, runs: list[Run], reference_ms: float, built, seconds: float) -> list[str]:
    by = {(r.workload, r.caching): r for r in runs}
    title = f"Prefix caching: multi-turn chat, caching on and off, {setup.shape} shape"
    lines = result_header(f"{title} (random weights)", None, device=setup.device)
    decode_steps = setup.turns * setup.answer_tokens
    lines += [
        f"- shape: {setup.shape}, {setup.layers or 'all its'} layers, {setup.dtype}; LLM("
        f"load_format='dummy', enable_lora, max_loras {setup.adapters}, rank {setup.rank}, "
        f"max_num_seqs = max_graph_bs = {setup.conversations}, max_num_batched_tokens "
        f"{setup.max_num_batched_tokens}, max_model_len {setup.max_model_len}, "
        f"{setup.num_pages} pages of {PAGE_SIZE}, async scheduling on)",
        f"- chat: {setup.conversations} conversations x {setup.turns} turns, closed loop; "
        f"conversation c on adapter a(c % {setup.adapters + 1}), the last of them base; a "
        f"{setup.system_tokens}-token system prompt per adapter and one for base; each turn "
        f"adds a {setup.user_tokens}-token user message; answers of {setup.answer_tokens} "
        "tokens, greedy, ignore_eos",
        f"- no shared prefix: {setup.unshared_requests} requests of "
        f"{setup.system_tokens + setup.user_tokens} distinct random tokens, base, "
        f"{setup.answer_tokens} out, {setup.conversations} at a time",
        "- TTFT: add_request to the Engine.step() that returns the turn's first token; tok/s: "
        "prompt + output tokens over the run's wall time; computed prompt tokens: the prompt "
        "tokens whose KV was computed (prefix-cache queries - hits)",
        f"- decode reference: {decode_steps} decode steps (the chat's, turn after turn) x the "
        f"replay + lm_head of one decode step of {setup.conversations} requests at "
        f"{setup.system_tokens}-token contexts, {reference_ms:.3f} ms (caching-off engine, "
        f"{'eager on the CPU' if setup.device == 'cpu' else 'CUDA graph, do_bench median'}): "
        f"{decode_steps * reference_ms / 1e3:.2f} s, the chat's time if no prompt cost anything",
        f"- engines built in {built[True]:.1f} s (caching on) and {built[False]:.1f} s (off); "
        f"whole run {seconds:.0f} s",
        "",
        "| workload | caching | s | tok/s | computed prompt tokens | TTFT p50 turn 1 ms "
        "| TTFT p90 turn 1 ms | TTFT p50 turns 2+ ms | TTFT p90 turns 2+ ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    later = range(2, setup.turns + 1)
    for (workload, caching), r in by.items():
        cells = [f"{r.seconds:.2f}", f"{r.tokens_per_s:.0f}", str(r.computed_prompt_tokens)]
        cells += [f"{r.ttft_ms(range(1, 2), q):.1f}" for q in (0.5, 0.9)]
        cells += [f"{r.ttft_ms(later, q):.1f}" if r.ttft.get(2) else "" for q in (0.5, 0.9)]
        lines.append(f"| {workload} | {'on' if caching else 'off'} | {' | '.join(cells)} |")
    on, off = by[("chat", True)], by[("chat", False)]
    u_on, u_off = by[("no shared prefix", True)], by[("no shared prefix", False)]
    lines += [
        "",
        "| figure | measured | target |",
        "|---|---:|---|",
        f"| chat TTFT p50 of turns 2-{setup.turns}, on / off | "
        f"{on.ttft_ms(later, 0.5) / off.ttft_ms(later, 0.5):.3f} | <= 0.25 |",
        f"| chat throughput, on / off | {off.seconds / on.seconds:.3f} | >= 2 |",
        f"| no shared prefix, time on / off | {u_on.seconds / u_off.seconds:.3f} | <= 1.02 |",
        f"| chat with caching, time / decode reference | "
        f"{on.seconds / (decode_steps * reference_ms / 1e3):.3f} | |",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    parser.add_argument("--layers", type=int, help="layers of the shape (default: all)")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    setup = SMOKE if args.smoke else FULL
    if args.layers:
        setup = dataclasses.replace(setup, layers=args.layers)
    start = time.perf_counter()
    runs, reference, built = measure(setup, model_folder(setup.layers, setup.shape))
    lines = report(setup, runs, reference, built, time.perf_counter() - start)
    write_result("prefix-cache", lines, args.out, smoke=args.smoke)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
