"""Prefix caching: a hit gives the tokens and logprobs of a miss; the cache never shares a page
across adapters, adapter loads, base and cache salts; and under random traffic (shared
prefixes, adapters, aborts, preemptions, reloads) every page comes back and no request is
given a page that another one writes."""

from __future__ import annotations

import random

import hf_fixtures as hf
import pytest

from moelora import LLM, SamplingParams
from moelora.engine.kv_cache import PageAllocator
from moelora.engine.prefix_cache import namespace
from moelora.errors import AdapterBusyError, InvalidRequestError

SHARED = [(7 * i + 3) % 200 + 1 for i in range(37)]  # a system prompt: 2 pages of 16 and some
PROMPTS = [SHARED + [11, 12, 13], SHARED + [50], SHARED[:32], SHARED + [90, 91, 92, 93, 94]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix")
    model = hf.make_model("qwen3_moe", root / "model", seed=8)
    paths = {"model": str(model)}
    for name, seed in (("a", 9), ("b", 10)):
        paths[name] = str(
            hf.make_per_expert_adapter(
                model, root / name, seed=seed, rank=4, alpha=8, arch="qwen3_moe"
            )
        )
    return paths


def _chosen(outs) -> list[tuple[list[int], list[float]]]:
    return [(list(o.token_ids), [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def _assert_same(got, want) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-5)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("arch", hf.ARCHS)
def test_a_hit_gives_the_tokens_and_logprobs_of_a_miss(bank, arch: str, page_size: int) -> None:
    llm = LLM(
        str(bank.model(arch)),
        lora_modules={"a": str(bank.per_expert_adapter(arch))},
        device="cpu",
        dtype="float32",
        max_lora_rank=8,
        page_size=page_size,
    )
    loras = [None, "a", "a", None]
    miss = llm.generate(PROMPTS, GREEDY, lora=loras)  # admitted together: nothing cached yet
    assert [o.num_cached_tokens for o in miss] == [0, 0, 0, 0]
    hit = llm.generate(PROMPTS, GREEDY, lora=loras)
    # whole pages short of the last token, which is computed again (PROMPTS[2] is two pages
    # of 16: one page less)
    want = [(len(p) - 1) // page_size * page_size for p in PROMPTS]
    assert [o.num_cached_tokens for o in hit] == want
    _assert_same(_chosen(hit), _chosen(miss))
    off = LLM(
        str(bank.model(arch)),
        lora_modules={"a": str(bank.per_expert_adapter(arch))},
        device="cpu",
        dtype="float32",
        max_lora_rank=8,
        page_size=page_size,
        enable_prefix_caching=False,
    )
    _assert_same(_chosen(hit), _chosen(off.generate(PROMPTS, GREEDY, lora=loras)))


@pytest.mark.parametrize("page_size", [16, 1])
def test_the_next_turn_finds_the_answers_pages_cached(tiny, page_size: int) -> None:
    """A conversation's turn 2 is turn 1's prompt and answer and a new message: the answer's
    full pages were cached as they were generated, and the turn's tokens are a miss's."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    loras = ["a", None]
    turn2 = []
    for llm in (_llm(tiny, page_size=page_size), _llm(tiny, enable_prefix_caching=False)):
        first = llm.generate(PROMPTS[:2], params, lora=loras)
        prompts = [p + list(o.token_ids) + [21, 22, 23, 24, 25] for p, o in zip(PROMPTS, first)]
        turn2.append(llm.generate(prompts, params, lora=loras))
    # computed in turn 1: the prompt and every answer token but the last (never an input)
    want = [(len(p) + 19) // page_size * page_size for p in PROMPTS[:2]]
    assert [o.num_cached_tokens for o in turn2[0]] == want
    _assert_same(_chosen(turn2[0]), _chosen(turn2[1]))


def _llm(tiny, **kw) -> LLM:
    return LLM(
        tiny["model"],
        lora_modules={"a": tiny["a"], "b": tiny["b"]},
        device="cpu",
        dtype="float32",
        max_lora_rank=8,
        **kw,
    )


def test_adapters_and_base_never_share_a_page(tiny) -> None:
    llm = _llm(tiny)
    engine = llm.engine
    cached_pages: dict[str, set[int]] = {}  # the cached pages each namespace's requests held
    launch = engine.runner.forward_step

    def recording_launch(plan, prev_tokens=None):
        for c in plan.chunks:
            held = {p for p in c.request.pages if p in engine.pages._hash_of}
            cached_pages.setdefault(c.request.lora or "base", set()).update(held)
        return launch(plan, prev_tokens=prev_tokens)

    engine.runner.forward_step = recording_launch
    for lora in ("a", "b", None):  # one after another: each could hit the one before
        assert llm.generate([PROMPTS[0]], GREEDY, lora=[lora])[0].num_cached_tokens == 0
    for lora in ("a", "b", None):
        assert llm.generate([PROMPTS[0]], GREEDY, lora=[lora])[0].num_cached_tokens == 32
    a, b, base = cached_pages["a"], cached_pages["b"], cached_pages["base"]
    assert len(a) == len(b) == len(base) == 2
    assert not (a & b) and not (a & base) and not (b & base)


def test_a_reload_under_the_same_name_gives_the_new_adapters_tokens(tiny) -> None:
    llm = _llm(tiny)
    engine = llm.engine
    first = _chosen(llm.generate(PROMPTS, GREEDY, lora=["a"] * 4))
    cached = engine.stats().kv_pages_cached
    engine.unload_lora("a")
    assert engine.stats().kv_pages_cached < cached  # a's pages left the cache
    engine.load_lora("a", tiny["b"])
    outs = llm.generate(PROMPTS, GREEDY, lora=["a"] * 4)
    assert outs[0].num_cached_tokens == 0  # b's weights under a's name: a new namespace
    fresh = LLM(
        tiny["model"],
        lora_modules={"a": tiny["b"]},
        device="cpu",
        dtype="float32",
        max_lora_rank=8,
        enable_prefix_caching=False,
    )
    want = _chosen(fresh.generate(PROMPTS, GREEDY, lora=["a"] * 4))
    _assert_same(_chosen(outs), want)
    assert [t for t, _ in want] != [t for t, _ in first]  # the two adapters differ


def test_a_cache_salt_isolates(tiny) -> None:
    llm = _llm(tiny)

    def cached(salt, lora=None) -> int:
        params = SamplingParams(max_tokens=2, temperature=0, cache_salt=salt)
        return llm.generate([PROMPTS[0]], params, lora=[lora])[0].num_cached_tokens

    assert cached(None) == 0
    assert cached("tenant-1") == 0
    assert cached("tenant-1") == 32
    assert cached("tenant-2") == 0
    assert cached(None) == 32
    assert cached("tenant-1", "a") == 0  # a salt is inside its adapter's namespace
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt=7)


def test_no_salt_spells_another_namespace() -> None:
    """A salt is the only namespace field a request sets; whatever its text, it lands in a
    namespace of its own, apart from every adapter load's and base's."""
    loads = [None, 0, 1, 2, 10]
    tricky = ["", "0", "1", "base", "adapter", "('adapter', 0)", "(('adapter', 0),)", "None"]
    tricky += ["('salt', '')", "'), ('adapter', 0", "\x00", "adapter\x000"]
    spaces = [namespace(g, None) for g in loads]
    spaces += [namespace(g, s) for g in loads for s in tricky]
    assert len(set(spaces)) == len(spaces)


def test_cached_pages_are_evicted_least_recently_released_first() -> None:
    alloc = PageAllocator(4)
    a, b = alloc.allocate(1), alloc.allocate(1)
    alloc.register(a[0], b"ha", None)
    alloc.register(b[0], b"hb", None)
    alloc.free(b)
    alloc.free(a)  # a released last: b goes first
    assert alloc.num_free == 4 and alloc.num_used == 0 and alloc.num_cached == 2
    assert alloc.cached_prefix([b"ha", b"hx"]) == a  # held again: not evictable
    assert alloc.allocate(3) == [2, 3, b[0]]  # the free pages, then the evicted cached one
    assert alloc.cached_prefix([b"hb"]) == []
    assert alloc.num_free == 0
    alloc.reset_cache()  # a is held: it leaves the cache and is freed as a plain page
    alloc.free(a)
    assert alloc.num_cached == 0 and alloc.num_free == 1


def _check_launch(engine, launch):
    """A launch that refuses to write a page that is cached or that another request holds,
    and checks every page's reference count against the requests that hold it."""

    def checked(plan, prev_tokens=None):
        ps, pages = engine.config.page_size, engine.pages
        live = [r for r in engine._requests.values() if r.pages]
        holders: dict[int, int] = {}
        for r in live:
            for p in r.pages:
                holders[p] = holders.get(p, 0) + 1
        for c in plan.chunks:
            written = c.request.pages[c.start // ps : (c.start + c.num_tokens - 1) // ps + 1]
            for p in written:
                assert p not in pages._hash_of, f"page {p} is cached and written"
                assert holders[p] == 1, f"page {p} is written and shared"
        for p, n in holders.items():  # finished requests in flight still hold theirs
            assert pages._refs[p] >= n
        return launch(plan, prev_tokens=prev_tokens)

    return checked


def test_random_traffic_returns_every_page(tiny) -> None:
    """~600 requests over shared prefixes, three namespaces and salts, under a page budget
    small enough to preempt, with aborts and adapter reloads on the way."""
    rng = random.Random(0)
    llm = _llm(tiny, page_size=4, num_pages=40, max_num_seqs=12, max_num_batched_tokens=48)
    engine = llm.engine
    engine.runner.forward_step = _check_launch(engine, engine.runner.forward_step)
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randrange(4, 17))] for _ in range(6)]
    live: list[str] = []
    prompts: dict[str, list[int]] = {}
    turns: list[list[int]] = []  # finished requests' prompts and answers
    for i in range(600):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(rng.randrange(4))]
        if turns and rng.random() < 0.3:  # a next turn: an earlier prompt and its answer, and more
            prompt = rng.choice(turns) + [rng.randrange(1, 250) for _ in range(rng.randrange(3))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 9),
            temperature=0,
            ignore_eos=True,
            cache_salt=rng.choice([None, None, "t"]),
        )
        engine.add_request(str(i), prompt, params, rng.choice([None, "a", "b"]))
        live.append(str(i))
        prompts[str(i)] = prompt
        if rng.random() < 0.08:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.02:
            name = rng.choice(["a", "b"])
            try:
                engine.unload_lora(name)
            except AdapterBusyError:
                pass
            else:
                engine.load_lora(name, tiny[rng.choice(["a", "b"])])
        if i % 3 == 0:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
                    turns.append(prompts[out.request_id] + list(out.token_ids))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and stats.kv_pages_used == 0
    assert engine.reset_prefix_cache()
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.kv_pages_cached == 0
    assert sorted(engine.pages._free) == list(range(stats.kv_pages_total))
