"""Many adapters over few slots: throughput, time to first token, step times and adapter fills
through the engine's own step loop, on a Qwen3-30B-A3B shape with random weights (issue 41).

- Workloads: N requests x (256 random prompt tokens in, 64 out), greedy, ignore_eos, added to
  an `Engine` and run by calling `Engine.step()` until every one has finished, as a user's loop
  does; request i on an adapter by the workload's rule ("cycle": i % adapters; "zipf": drawn
  with P(j) ~ 1 / (j + 1)^s, seeded). The reference ("all16") is 16 adapters cycling with all
  16 resident (max_loras 16); then the same 16 over the memory of 4, 64 and 256 adapters of
  Zipf(1.0) popularity over the memory of 8, and a mix of ranks 8, 16 and 64 (max_lora_rank 64).
  "The memory of M adapters" is max_loras = M slots today (Workload.max_loras).
- Adapters in host memory: one rank-16 adapter of this shape is 1.57 GiB, so 64 or 256
  distinct ones cannot exist on the device's host. A few distinct random adapters per rank
  (Setup.distinct) are drawn and page-locked once; each workload registers its N names as
  LoraAdapter objects over those same tensors. A fill copies an adapter's full bytes whatever
  tensors it shares, so fill and scheduling figures are real; only the host memory 256
  distinct adapters would take is not.
- Figures per workload: output tokens/s over the wall time of the whole loop, and over the
  reference's; TTFT p50/p99 (wall time from add_request to the end of the step() call that
  returned the request's first token); the longest and p99 step() call, of all calls and of
  decode steps (calls with no first token returned in the call before, itself or the two
  after: the batch a call launches or waits for holds no prefill chunk, told apart from the
  public outputs); fills, their bytes and the engine thread's seconds in them (engine.stats()).
  A warm-up of other prompts on the workload's adapters runs first (the reference's 16
  adapters are then all in their slots); the figures leave it out. The run's first workload
  also runs once whole before its timed pass: its steps' sizes compile the kernel variants
  that every workload meets, seconds each on a cold Triton cache, which the reference would
  otherwise carry.
- One fill against its floor, in the same run, on the first engine with more adapters than
  slots: floor = one host-to-device copy of the adapter's bytes from a page-locked buffer
  (copy_ non_blocking, CUDA events, median); fill = the synchronised Engine.step() that runs a
  lone 16-token request whose adapter is not in a slot, minus the same step once it is (the
  median of each), beside the engine thread's time a fill (stats).
- GPU bytes of an adapter (its region in the arena, at its modules' own ranks; a whole slot
  where the engine keeps the old layout): a rank-8 adapter with max_lora_rank 64 against 8,
  and a rank-16 shared-outer adapter against the per-expert one (engines of one slot, eager,
  few pages, adapters drawn over their targets).

All requests arrive at t=0 by default, as the issue's figures of today were taken. A batch
holds only the requests of the adapters in slots, so under a burst at most max_loras adapters'
requests run at once (a quarter of them for 16 cycling over 4 slots), whatever fills cost;
--request-rate R adds them as a Poisson process of R requests/s instead.

    PYTHONPATH=. python bench/adapters.py [--workloads KEY ...] [--layers N] [--out PATH]
        [--request-rate R] [--smoke]

--smoke: the tiny demo shape on the CPU, a few requests: shows that the script runs end to end;
its figures mean nothing (written to a temporary file unless --out).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass

import torch
from common import model_folder, result_header, sync, write_result

from moelora.config import EngineConfig
from moelora.engine.engine import Engine, EngineStats
from moelora.lora.adapter import LoraAdapter, random_adapter
from moelora.sampling_params import SamplingParams
from moelora.step.batch import pages_for

PAGE_SIZE = 16
GIB = 1 << 30


@dataclass(frozen=True)
class Workload:
    key: str
    adapters: int  # names registered, each a LoraAdapter over a drawn adapter's tensors
    popularity: str  # "cycle" or "zipf"
    ranks: tuple[int, ...]  # adapter j's rank: ranks[j % len(ranks)]
    # adapters one batch may hold, and today also how many stay resident: where a GPU memory
    # budget for adapters comes, it becomes a field beside this one, passed in engine_options
    max_loras: int
    max_lora_rank: int
    target: str = ""  # the target for its output tok/s over the reference's

    def __post_init__(self) -> None:
        assert self.popularity in ("cycle", "zipf"), self.popularity
        assert self.adapters >= 1 and max(self.ranks) <= self.max_lora_rank, self

    def engine_options(self) -> dict[str, int]:
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank}

    def describe(self) -> str:
        ranks = "/".join(map(str, self.ranks))
        return f"{self.adapters} {self.popularity}, rank {ranks}"


WORKLOADS = (
    Workload("all16", 16, "cycle", (16,), 16, 16),
    Workload("16of4", 16, "cycle", (16,), 4, 16, ">= 0.80"),
    Workload("zipf64", 64, "zipf", (16,), 8, 16, ">= 0.70"),
    Workload("zipf256", 256, "zipf", (16,), 8, 16, ">= 0.70"),
    # 6 slots at max_lora_rank 64 take 6.3 GiB each today: 12 would not fit beside the model
    Workload("ranks", 6, "cycle", (8, 16, 64), 6, 64),
)


@dataclass(frozen=True)
class Setup:
    shape: str  # moelora.models.shapes
    layers: int | None  # None: the shape's
    device: str
    dtype: str
    requests: int
    input_len: int
    output_len: int
    workloads: tuple[Workload, ...]
    reference: str  # the workload every throughput is divided by
    distinct: int  # random adapters drawn per rank; a workload's names share their tensors
    max_num_seqs: int  # and max_graph_bs: every decode batch replays a graph
    max_num_batched_tokens: int
    zipf_s: float = 1.0
    request_rate: float | None = None  # Poisson arrivals a second; None: all at t=0
    bytes_ranks: tuple[int, int] = (8, 64)  # a rank-[0] adapter, max_lora_rank [1] against [0]
    probe_reps: int = 5  # fills timed against resident steps, and floor copies
    probe_prompt_len: int = 16
    beside_batch: int = 64  # base requests decoding while fills run beside them
    beside_steps: int = 120  # step() calls timed, a lone request on a new adapter every 6th
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.input_len + self.output_len

    @property
    def num_pages(self) -> int:
        return self.max_num_seqs * pages_for(self.max_model_len, PAGE_SIZE) + 16

    @property
    def warm_requests(self) -> int:
        """A full prefill step's worth and one more: every kernel the run needs compiles."""
        return min(self.requests, self.max_num_batched_tokens // self.input_len + 1)


FULL = Setup(
    shape="qwen3-30b-a3b",
    layers=48,
    device="cuda",
    dtype="bfloat16",
    requests=256,
    input_len=256,
    output_len=64,
    workloads=WORKLOADS,
    reference="all16",
    distinct=8,
    max_num_seqs=256,
    max_num_batched_tokens=16384,
)
SMOKE = dataclasses.replace(
    FULL,
    shape="tiny-qwen3-moe",
    layers=None,
    device="cpu",
    dtype="float32",
    requests=6,
    input_len=8,
    output_len=3,
    distinct=2,
    max_num_seqs=8,
    max_num_batched_tokens=48,  # the warm-up then takes every request's adapter
    probe_reps=2,
    probe_prompt_len=8,
    beside_batch=4,
    beside_steps=18,
)


# ---- adapters ---------------------------------------------------------------------------


class HostAdapters:
    """The distinct random adapters of a run, by (rank, index): drawn on the device once, kept
    in host memory, page-locked on CUDA (a slot fill copies from there asynchronously, and
    LoraAdapter.pinned() then shares them: every name over them costs no host memory)."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.drawn: dict[tuple[int, int], LoraAdapter] = {}

    def get(self, engine: Engine, rank: int, index: int) -> LoraAdapter:
        if (rank, index) not in self.drawn:
            adapter = random_adapter(
                f"r{rank}-{index}",
                engine.lora_targets,  # the same keys and shapes in every engine of the run
                rank=rank,
                seed=1000 * rank + index,
                dtype=engine.config.torch_dtype,
                device=engine.config.torch_device,
                store="cpu",
            )
            pin = engine.config.torch_device.type == "cuda"
            self.drawn[rank, index] = adapter.pinned() if pin else adapter
        return self.drawn[rank, index]


def register(engine: Engine, w: Workload, host: HostAdapters) -> dict[str, LoraAdapter]:
    """The workload's adapter names, registered: name j over drawn adapter (its rank, j's
    index among that rank's names modulo Setup.distinct)."""
    names = {}
    for j in range(w.adapters):
        rank = w.ranks[j % len(w.ranks)]
        base = host.get(engine, rank, (j // len(w.ranks)) % host.setup.distinct)
        adapter = dataclasses.replace(base, name=f"{w.key}-{j}")
        engine.add_adapter(adapter)
        names[adapter.name] = adapter
    return names


def adapter_of_requests(w: Workload, n: int, *, s: float, seed: int) -> list[int]:
    if w.popularity == "cycle":
        return [i % w.adapters for i in range(n)]
    weights = torch.arange(1, w.adapters + 1, dtype=torch.float64) ** -s
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(weights, n, replacement=True, generator=gen).tolist()


# ---- one workload through Engine.step() -------------------------------------------------


@dataclass(frozen=True)
class Trace:
    """What one workload's loop of Engine.step() calls gave."""

    seconds: float
    tokens: int  # output tokens of the finished requests
    ttft_s: tuple[float, ...]
    step_s: tuple[float, ...]  # each step() call
    firsts: tuple[int, ...]  # first tokens each call returned

    @property
    def decode_s(self) -> tuple[float, ...]:
        """The calls with no first token returned in the call before, itself or the two after:
        with async scheduling a call launches one batch and waits for the one before, and a
        prompt split over two steps returns its token a step after its first chunk."""
        return tuple(
            s for k, s in enumerate(self.step_s) if not any(self.firsts[max(0, k - 1) : k + 3])
        )


@dataclass(frozen=True)
class Result:
    workload: Workload
    used: int  # distinct adapters the requests named
    trace: Trace
    fills: EngineStats  # the engine's stats after the workload, less those before

    @property
    def tok_s(self) -> float:
        return self.trace.tokens / self.trace.seconds


def random_prompts(vocab: int, count: int, length: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def arrivals(setup: Setup, n: int) -> list[float]:
    """Seconds after the start at which each request is added: 0, or a Poisson process."""
    if setup.request_rate is None:
        return [0.0] * n
    gen = torch.Generator().manual_seed(setup.seed + 1)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(setup.request_rate, generator=gen)
    return torch.cumsum(gaps, 0).tolist()


def drive(
    engine: Engine, setup: Setup, requests: list[tuple[str, list[int], str]], params: SamplingParams
) -> Trace:
    """requests: (id, prompt, adapter name), added at their arrival times; step() is called
    until every request has finished."""
    pending = collections.deque(zip(arrivals(setup, len(requests)), requests))
    added, first, done = {}, {}, {}
    steps, firsts = [], []
    sync(setup.device)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and start + pending[0][0] <= time.perf_counter():
            rid, prompt, lora = pending.popleft()[1]
            added[rid] = time.perf_counter()
            engine.add_request(rid, prompt, params, lora)
        if not engine.has_unfinished_requests():  # idle until the next arrival
            time.sleep(max(0.0, start + pending[0][0] - time.perf_counter()))
            continue
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - before)
        new = [o.request_id for o in outputs if o.token_ids and o.request_id not in first]
        first |= dict.fromkeys(new, now)
        firsts.append(len(new))
        done |= {o.request_id: len(o.token_ids) for o in outputs if o.finished}
    sync(setup.device)
    seconds = time.perf_counter() - start
    ttft = tuple(first[rid] - added[rid] for rid in first)
    return Trace(seconds, sum(done.values()), ttft, tuple(steps), tuple(firsts))


def run_workload(
    engine: Engine, setup: Setup, w: Workload, names: list[str], *, tag: str = ""
) -> Result:
    """A warm-up on other prompts, then the workload, each request on its adapter (tag: in
    the request ids, for a pass of a workload that ran before)."""
    n, vocab = setup.requests, engine.model_config.vocab_size
    which = adapter_of_requests(w, n, s=setup.zipf_s, seed=setup.seed)
    loras = [names[j] for j in which]
    # a tagged pass draws other prompts: the same ones would hit the pages the untagged pass's
    # prefix cache keeps, and the two passes would no longer be the same workload
    seed = setup.seed + (100 if tag else 0)
    warm = random_prompts(vocab, setup.warm_requests, setup.input_len, seed=seed + 2)
    warm_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    warm_requests = [(f"{w.key}{tag}-warm-{i}", p, loras[i]) for i, p in enumerate(warm)]
    drive(engine, dataclasses.replace(setup, request_rate=None), warm_requests, warm_params)
    prompts = random_prompts(vocab, n, setup.input_len, seed=seed + 3)
    params = SamplingParams(max_tokens=setup.output_len, temperature=0, ignore_eos=True)
    requests = [(f"{w.key}{tag}-{i}", p, loras[i]) for i, p in enumerate(prompts)]
    before = engine.stats()
    trace = drive(engine, setup, requests, params)
    return Result(w, len(set(which)), trace, stats_delta(before, engine.stats()))


def stats_delta(before: EngineStats, after: EngineStats) -> EngineStats:
    """after's stats with the fill counters counted from `before` on."""
    return dataclasses.replace(
        after,
        lora_fills=after.lora_fills - before.lora_fills,
        lora_fill_bytes=after.lora_fill_bytes - before.lora_fill_bytes,
        lora_fill_seconds=after.lora_fill_seconds - before.lora_fill_seconds,
    )


# ---- one fill against its floor ---------------------------------------------------------


@dataclass(frozen=True)
class FillProbe:
    workload: str
    adapter_bytes: int
    floor_ms: float  # one pinned host-to-device copy of adapter_bytes
    with_fill_ms: float  # the synchronised step of a lone request whose adapter is not resident
    resident_ms: float  # the same request's step once its adapter is resident
    fills: int  # fills the timed steps started: one each when the probe works as meant
    reps: int
    thread_ms: float  # the engine thread's time a fill (engine.stats())

    @property
    def fill_ms(self) -> float:
        return self.with_fill_ms - self.resident_ms


def probe_fill(engine: Engine, setup: Setup, key: str, names: dict[str, LoraAdapter]) -> FillProbe:
    """Each rep: a lone request on an adapter of the workload that is not in a slot (its step
    fills one), then one on the same adapter, resident now. The first pair is not timed (the
    kernels of the short prompt compile)."""
    with_fill, resident, fills, thread = [], [], 0, 0.0
    for rep in range(setup.probe_reps + 1):
        levels = {a.name: a.level for a in engine.stats().adapters}
        name = next(n for n in names if levels[n] == "cpu")
        before = engine.stats()
        ms = lone_step_ms(engine, setup, name, seed=2 * rep)
        filled = stats_delta(before, engine.stats())
        again = lone_step_ms(engine, setup, name, seed=2 * rep + 1)
        if rep:
            with_fill.append(ms)
            resident.append(again)
            fills += filled.lora_fills
            thread += filled.lora_fill_seconds
    nbytes = names[name].nbytes  # the workload's adapters have one rank: one size
    return FillProbe(
        key,
        nbytes,
        pinned_copy_ms(nbytes, setup.device, setup.probe_reps),
        statistics.median(with_fill),
        statistics.median(resident),
        fills,
        setup.probe_reps,
        thread * 1e3 / max(fills, 1),
    )


def lone_step_ms(engine: Engine, setup: Setup, lora: str, *, seed: int) -> float:
    """ms of the step() that runs a lone request of a short prompt on `lora` (its prefill and
    first token), the device synchronised on both sides; the request then runs to its end."""
    vocab = engine.model_config.vocab_size
    prompt = random_prompts(vocab, 1, setup.probe_prompt_len, seed=100 + seed)[0]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(f"probe-{seed}", prompt, params, lora)
    sync(setup.device)
    start = time.perf_counter()
    engine.step()
    sync(setup.device)
    ms = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return ms


@dataclass(frozen=True)
class BesideProbe:
    batch: int
    with_fill: tuple[float, ...]  # s of the decode calls that started a fill
    without: tuple[float, ...]  # s of those that started none, nor did the call before
    fills: int


BESIDE_EVERY = 6  # step() calls between the lone requests that start fills


def probe_decode_beside_fills(
    engine: Engine, setup: Setup, names: dict[str, LoraAdapter]
) -> BesideProbe:
    """beside_batch base requests decode; every BESIDE_EVERY-th step() call a lone request
    arrives on an adapter in no slot, whose fill then runs beside the decode (the request
    waits for it, then joins for one token). The decode calls that started a fill against
    those that did not, interleaved: the same batch, contexts a few tokens apart."""
    vocab, n = engine.model_config.vocab_size, setup.beside_batch
    tokens = setup.max_model_len - setup.probe_prompt_len  # past beside_steps on the GPU shape
    steady = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(vocab, n, setup.probe_prompt_len, seed=7)):
        engine.add_request(f"steady-{i}", prompt, steady, None)
    for _ in range(4):  # their prefill, then decodes
        engine.step()
    lone = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = random_prompts(vocab, setup.beside_steps, setup.probe_prompt_len, seed=8)
    steps, started, admitted, asked = [], [], [], set()
    for k in range(setup.beside_steps):
        if k % BESIDE_EVERY == 0:
            levels = {a.name: a.level for a in engine.stats().adapters}
            name = next(m for m in names if levels[m] == "cpu" and m not in asked)
            asked = {name}  # the one asked last may still wait for its slot
            engine.add_request(f"lone-{k}", prompts[k], lone, name)
        before = engine.stats()  # only lone requests ever wait
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        after = engine.stats()
        started.append(after.lora_fills > before.lora_fills)
        admitted.append(after.num_waiting < before.num_waiting)
    for i in range(n):
        engine.abort_request(f"steady-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    # a call that launched a lone request's prefill, and the two after (with async scheduling
    # the next waits for it, and its placeholder decode may follow), are no decode calls
    decode = [k for k in range(len(steps)) if not any(admitted[max(0, k - 2) : k + 1])]
    return BesideProbe(
        n,
        tuple(steps[k] for k in decode if started[k]),
        tuple(steps[k] for k in decode if not started[k] and not (k and started[k - 1])),
        sum(started),
    )


def pinned_copy_ms(nbytes: int, device: str, reps: int) -> float:
    """Median ms of one copy of nbytes to the device from page-locked host memory (copy_
    non_blocking, CUDA events), after one untimed; on the CPU, of a host copy by the wall
    clock."""
    cuda = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times[1:])


# ---- GPU bytes of an adapter ------------------------------------------------------------


def slot_bytes(engine: Engine, adapter: LoraAdapter | None = None) -> int:
    """GPU bytes `adapter` takes: its region in the compact arena (its modules' own ranks, a
    shared expert factor once); in the old layout (the engine's kernels not all converted to
    the arena's tables), or without an adapter, a whole slot: every module at max_lora_rank."""
    pool = engine.slot_pool
    elem = pool.arena.element_size()
    if adapter is None or not pool.compact:
        return pool.slot_elements * elem
    return pool.region_size(adapter) * elem


def engine_config(setup: Setup, folder: str, **options: object) -> EngineConfig:
    sizes = {
        "max_num_seqs": setup.max_num_seqs,
        "max_graph_bs": setup.max_num_seqs,
        "max_num_batched_tokens": setup.max_num_batched_tokens,
        "max_model_len": setup.max_model_len,
        "num_pages": setup.num_pages,
    }
    return EngineConfig(
        model=folder,
        load_format="dummy",
        dtype=setup.dtype,
        device=setup.device,
        page_size=PAGE_SIZE,
        **(sizes | options),
    )


@dataclass(frozen=True)
class AdapterBytes:
    """GPU bytes of adapters (slot_bytes), each engine eager with one slot."""

    low_at_low: int  # a rank-bytes_ranks[0] adapter, max_lora_rank bytes_ranks[0]
    low_at_high: int  # the same adapter at max_lora_rank bytes_ranks[1]
    per_expert: int  # a rank-16 adapter at max_lora_rank bytes_ranks[1]
    shared_outer: int  # the same with gate_up's A and down's B shared by every expert
    compact: bool  # regions at the modules' own ranks (else whole slots)


def shared_outer(adapter: LoraAdapter) -> LoraAdapter:
    """The adapter with gate_up's A and down's B of expert 0 for every expert, marked shared
    (the shared-outer layout Megatron-Bridge and SGLang use)."""
    modules, shared = dict(adapter.modules), set()
    for key, m in adapter.modules.items():
        if key.endswith("experts13"):
            modules[key] = dataclasses.replace(m, a=m.a[:1].expand(m.a.shape))
            shared.add((key, "a"))
        elif key.endswith("experts2"):
            modules[key] = dataclasses.replace(m, b=m.b[:1].expand(m.b.shape))
            shared.add((key, "b"))
    return dataclasses.replace(adapter, modules=modules, shared=frozenset(shared))


def adapter_bytes(setup: Setup, folder: str) -> AdapterBytes:
    """A rank-low adapter's bytes at max_lora_rank low and high; a rank-16 per-expert adapter's
    and its shared-outer twin's at high (adapters drawn over each engine's own targets)."""
    low, high = setup.bytes_ranks
    pages = pages_for(setup.max_model_len, PAGE_SIZE) + 1
    found: dict[str, int] = {}
    for max_rank in (low, high):
        options = {"max_loras": 1, "max_lora_rank": max_rank, "enforce_eager": True}
        engine = Engine(engine_config(setup, folder, max_num_seqs=1, num_pages=pages, **options))
        try:
            cfg = engine.config
            draw = functools.partial(
                random_adapter,
                targets=engine.lora_targets,
                dtype=cfg.torch_dtype,
                device=cfg.torch_device,
                store="cpu",
            )
            found[f"low{max_rank}"] = slot_bytes(engine, draw("bytes-low", rank=low, seed=1))
            if max_rank == high:
                full = draw("bytes-16", rank=16, seed=2)
                found["per_expert"] = slot_bytes(engine, full)
                found["shared_outer"] = slot_bytes(engine, shared_outer(full))
                compact = engine.slot_pool.compact
        finally:
            engine.close()
    return AdapterBytes(
        found[f"low{low}"], found[f"low{high}"], found["per_expert"], found["shared_outer"], compact
    )


# ---- the run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    results: list[Result]
    probe: FillProbe | None  # None: no workload had more adapters than slots
    beside: BesideProbe | None  # on the same engine, after the probe
    bytes: AdapterBytes
    builds: list[tuple[str, float]]  # (workload that built an engine, seconds)


def run(setup: Setup, folder: str) -> Run:
    """The workloads in order, each on an engine of its options (consecutive workloads of the
    same options share one); one fill probed on the first with more adapters than slots."""
    host = HostAdapters(setup)
    results, probe, beside, builds = [], None, None, []
    engine, options = None, None
    try:
        for w in setup.workloads:
            if engine is None or options != w.engine_options():
                if engine is not None:
                    engine.close()
                options, start = w.engine_options(), time.perf_counter()
                engine = Engine(engine_config(setup, folder, **options))
                builds.append((w.key, time.perf_counter() - start))
                print(f"engine {options}: built in {builds[-1][1]:.1f} s", flush=True)
            names = register(engine, w, host)
            if not results:
                # the run's first pass compiles the kernel variants of every step size the
                # workloads meet (seconds each, the first time): untimed, or the reference
                # would carry them and every ratio to it would flatter the others
                cold = run_workload(engine, setup, w, list(names), tag="-cold")
                print(f"cold pass: {cold.tok_s:.1f} output tok/s (not counted)", flush=True)
            results.append(run_workload(engine, setup, w, list(names)))
            print(result_line(results[-1]), flush=True)
            if probe is None and w.adapters > w.max_loras and len(w.ranks) == 1:
                probe = probe_fill(engine, setup, w.key, names)
                print(f"fill {probe.fill_ms:.2f} ms, floor {probe.floor_ms:.2f} ms", flush=True)
                beside = probe_decode_beside_fills(engine, setup, names)
    finally:
        if engine is not None:
            engine.close()
    return Run(results, probe, beside, adapter_bytes(setup, folder), builds)


def result_line(r: Result) -> str:
    return (
        f"{r.workload.key:>8}: {r.tok_s:9.1f} output tok/s, TTFT p99 "
        f"{ms(percentile(r.trace.ttft_s, 99))} ms, longest step {ms(max(r.trace.step_s))} ms, "
        f"{r.fills.lora_fills} fills; longest steps (index: ms) {longest_steps(r.trace.step_s)}"
    )


def longest_steps(step_s: tuple[float, ...], k: int = 3) -> str:
    """The k longest step() calls by index, so a lone slow step can be told from slow steps."""
    order = sorted(range(len(step_s)), key=lambda i: -step_s[i])[:k]
    return ", ".join(f"{i}: {ms(step_s[i])}" for i in sorted(order))


def percentile(values: tuple[float, ...], q: float) -> float | None:
    """The q-th percentile by nearest rank; None of no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


# ---- the result file --------------------------------------------------------------------


def report(setup: Setup, run: Run, seconds: float) -> list[str]:
    title = f"Many adapters over few slots, {setup.shape} shape (random weights)"
    lines = result_header(title, None, device=setup.device)
    arrival = (
        "all added at t=0"
        if setup.request_rate is None
        else f"added as a Poisson process of {setup.request_rate:g} requests/s"
    )
    lines += [
        f"- engines: `Engine(EngineConfig(load_format='dummy'))`, {setup.layers or 'all its'} "
        f"layers, {setup.dtype}, max_num_seqs = max_graph_bs = {setup.max_num_seqs}, "
        f"max_num_batched_tokens {setup.max_num_batched_tokens}, max_model_len "
        f"{setup.max_model_len}, {setup.num_pages} KV pages of {PAGE_SIZE}, async scheduling "
        "and prefix caching as by default; the memory of M adapters = max_loras M (slots)",
        f"- requests: {setup.requests} x ({setup.input_len} random tokens in, "
        f"{setup.output_len} out), greedy, ignore_eos, {arrival}, run by Engine.step() until "
        f"all finish, after a warm-up of {setup.warm_requests} other prompts (2 tokens each) on "
        f"the same adapters (and, for {setup.workloads[0].key}, an untimed pass of the whole "
        "workload first on other prompts: kernels compile); cycle: request i on adapter i % N; "
        "zipf: adapter drawn with "
        f"P(j) ~ 1 / (j + 1)^{setup.zipf_s:g} (seed {setup.seed})",
        f"- adapters: random weights on attention and every expert, {setup.distinct} distinct "
        "ones per rank drawn into host memory and page-locked once; a workload's N names are "
        "LoraAdapter objects over those tensors. A fill copies an adapter's full bytes whatever "
        "tensors it shares: fill and scheduling figures are real, only the host memory of N "
        "distinct adapters is not",
        "- TTFT: add_request to the end of the step() call that returned the first token; "
        "step: each step() call, wall clock; decode: calls with no first token returned in the "
        "call before, itself or the two after (no prefill chunk launched or waited for); "
        "fills, GiB, fill s: engine.stats() over the workload, fill s being the engine "
        "thread's time in them, not the GPU's",
        f"- whole run: {seconds:.0f} s; engines built: "
        + ", ".join(f"{key} {s:.1f} s" for key, s in run.builds),
    ]
    return (
        lines
        + workload_table(setup, run.results)
        + fill_table(run.probe)
        + beside_table(run.beside)
        + bytes_table(setup, run.bytes)
    )


def workload_table(setup: Setup, results: list[Result]) -> list[str]:
    expected = setup.requests * setup.output_len
    ref = next((r.tok_s for r in results if r.workload.key == setup.reference), None)
    lines = [
        "",
        f"| workload | adapters | max_loras | max_lora_rank | used | output tokens | s "
        f"| output tok/s | / {setup.reference} | target | TTFT p50 ms | TTFT p99 ms "
        "| step max ms | step p99 ms | decode steps | decode max ms | decode p99 ms | fills "
        "| fill GiB | fill s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|",
    ]
    for r in results:
        t, w, f = r.trace, r.workload, r.fills
        ratio = f"{r.tok_s / ref:.3f}" if ref else "-"
        cells = [
            w.key,
            w.describe(),
            str(w.max_loras),
            str(w.max_lora_rank),
            str(r.used),
            f"{t.tokens} / {expected}",
            f"{t.seconds:.2f}",
            f"{r.tok_s:.0f}",
            ratio,
            w.target,
            ms(percentile(t.ttft_s, 50)),
            ms(percentile(t.ttft_s, 99)),
            ms(max(t.step_s)),
            ms(percentile(t.step_s, 99)),
            f"{len(t.decode_s)} of {len(t.step_s)}",
            ms(max(t.decode_s, default=None)),
            ms(percentile(t.decode_s, 99)),
            str(f.lora_fills),
            f"{f.lora_fill_bytes / GIB:.2f}",
            f"{f.lora_fill_seconds:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def fill_table(p: FillProbe | None) -> list[str]:
    if p is None:
        return ["", "One fill: not measured (no workload had more adapters than slots)."]
    return [
        "",
        f"One fill against its floor, on {p.workload}'s engine after the workload, median of "
        f"{p.reps}: floor = a host-to-device copy of the adapter's bytes from one page-locked "
        "buffer (CUDA events); fill = the synchronised step() of a lone "
        "request whose adapter is not in a slot, less the same step once it is:",
        "",
        "| adapter GiB | floor ms | floor GB/s | step with fill ms | step resident ms "
        "| fill ms | fill / floor | target | fills counted | engine thread ms a fill |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        f"| {p.adapter_bytes / GIB:.3f} | {p.floor_ms:.2f} | "
        f"{p.adapter_bytes / p.floor_ms / 1e6:.1f} | {p.with_fill_ms:.2f} | "
        f"{p.resident_ms:.2f} | {p.fill_ms:.2f} | {p.fill_ms / p.floor_ms:.2f} | <= 1.3 | "
        f"{p.fills} of {p.reps} | {p.thread_ms:.2f} |",
    ]


def beside_table(p: BesideProbe | None) -> list[str]:
    if p is None:
        return []
    with_p99, without_p99 = percentile(p.with_fill, 99), percentile(p.without, 99)
    ratio = f"{with_p99 / without_p99:.2f}" if with_p99 and without_p99 else "-"
    return [
        "",
        f"Decode beside fills, on the same engine: {p.batch} base requests decoding; every "
        f"{BESIDE_EVERY}th step() call a lone request arrives on an adapter in no slot (its "
        "fill runs beside the decode, then it joins for one token); decode calls: all but "
        "the one that launched a lone request's prefill and the two after it; those that "
        "started a fill against those that started none (nor did the call before):",
        "",
        "| batch | fills | calls with a fill | p99 ms | max ms | calls without | p99 ms "
        "| max ms | p99 with / without | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {p.batch} | {p.fills} | {len(p.with_fill)} | {ms(with_p99)} | "
        f"{ms(max(p.with_fill, default=None))} | {len(p.without)} | {ms(without_p99)} | "
        f"{ms(max(p.without, default=None))} | {ratio} | <= 1.10 |",
    ]


def bytes_table(setup: Setup, b: AdapterBytes) -> list[str]:
    low, high = setup.bytes_ranks
    layout = (
        "each in a region of the arena at its modules' own ranks, a shared factor once"
        if b.compact
        else "each in a whole slot (every module at max_lora_rank: the kernels of this engine "
        "read the old layout)"
    )
    rows = [
        (f"rank {low}", low, b.low_at_low, "1.000", ""),
        (f"rank {low}", high, b.low_at_high, f"{b.low_at_high / b.low_at_low:.3f}", "<= 1.15"),
        ("rank 16, per expert", high, b.per_expert, "", ""),
        (
            "rank 16, shared-outer",
            high,
            b.shared_outer,
            f"{b.shared_outer / b.per_expert:.3f}",
            "<= 0.35",
        ),
    ]
    lines = [
        "",
        f"GPU bytes of an adapter, {layout}; ratios: against the same adapter at "
        f"max_lora_rank {low}, and shared-outer against per expert:",
        "",
        "| adapter | max_lora_rank | bytes | GiB | ratio | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, rank, n, ratio, target in rows:
        lines.append(f"| {name} | {rank} | {n} | {n / GIB:.3f} | {ratio} | {target} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    keys = [w.key for w in WORKLOADS]
    parser.add_argument("--workloads", nargs="+", choices=keys, help="default: all, in order")
    parser.add_argument("--layers", type=int, help="layers of the shape (default: all)")
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals a second")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    setup = SMOKE if args.smoke else FULL
    if args.layers:
        setup = dataclasses.replace(setup, layers=args.layers)
    if args.workloads:
        chosen = tuple(w for w in setup.workloads if w.key in args.workloads)
        setup = dataclasses.replace(setup, workloads=chosen)
    if args.request_rate:
        setup = dataclasses.replace(setup, request_rate=args.request_rate)
    start = time.perf_counter()
    result = run(setup, model_folder(setup.layers, setup.shape))
    lines = report(setup, result, time.perf_counter() - start)
    write_result("adapters", lines, args.out, smoke=args.smoke)
    print("\n".join(lines))
    expected = setup.requests * setup.output_len
    short = [r.workload.key for r in result.results if r.trace.tokens != expected]
    if short:
        raise SystemExit(f"workloads {short} generated fewer than {expected} tokens")


if __name__ == "__main__":
    main()
