"""Async scheduling (the default): step N+1 is launched before step N's tokens are known. The
outputs are those of one step at a time, and the cases where a request is planned into a step
it no longer needs stay exact: its token is dropped, its pages and slot go back once, and no
slot a step in flight reads is refilled under it."""

from __future__ import annotations

import dataclasses

import hf_fixtures as hf
import pytest

from moelora import LLM, SamplingParams
from moelora.demo import ensure_demo
from moelora.errors import AdapterBusyError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 77, 31, 8, 100, 4, 66], [3, 14, 15, 92], list(range(40, 70)), [250]]
LORAS = [None, "a", None, "a"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("async")
    model = hf.make_model("qwen3_moe", root / "model", seed=5)
    adapter = hf.make_per_expert_adapter(
        model, root / "adapter", seed=6, rank=4, alpha=8, arch="qwen3_moe"
    )
    return str(model), str(adapter)


def _llm(tiny, *, on: bool, **kw) -> LLM:
    model, adapter = tiny
    return LLM(
        model,
        lora_modules={"a": adapter},
        device="cpu",
        max_lora_rank=8,
        async_scheduling=on,
        **kw,
    )


def _seen(outs) -> list[tuple]:
    """What an output says, as plain values."""
    return [
        (list(o.token_ids), o.text, o.finish_reason, o.logprobs, o.prompt_logprobs) for o in outs
    ]


def _same(got: list[tuple], want: list[tuple]) -> bool:
    """Tokens, text and finish reason exactly; logprobs, which move by float rounding with the
    batch's shape (a request that stopped in step N still computes a row in step N+1, so the
    batches differ), to 1e-4."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        for entries, expected in zip(g[3:], w[3:]):
            assert (entries is None) == (expected is None)
            for e, x in zip(entries or [], expected or []):
                assert (e is None) == (x is None) and (e is None or e.keys() == x.keys())
                for t in e or {}:
                    assert e[t] == pytest.approx(x[t], abs=1e-4)
    return True


class Steps:
    """Records the request ids of every launched step, and refuses a page freed twice."""

    def __init__(self, llm: LLM) -> None:
        engine = self.engine = llm.engine
        self.plans: list[list[str]] = []
        forward, free = engine.runner.forward_step, engine.pages.free

        def recording_forward(plan, prev_tokens=None):
            self.plans.append([c.request.request_id for c in plan.chunks])
            return forward(plan, prev_tokens=prev_tokens)

        def checked_free(pages):
            twice = set(pages) & set(engine.pages._free)
            assert not twice, f"pages {sorted(twice)} freed twice"
            free(pages)

        engine.runner.forward_step = recording_forward
        engine.pages.free = checked_free

    def count(self, request_id: str) -> int:
        return sum(request_id in plan for plan in self.plans)


def test_same_outputs_as_one_step_at_a_time_on_the_demo():
    """Mixed adapters and every stop: EOS, a stop id, a stop string ending inside a token,
    max_tokens, max_model_len; seeded sampling, logprobs, prompt logprobs, and penalties (which
    run one step at a time). The demo's tokenizer has multi-character tokens."""
    assets = ensure_demo()
    kw = dict(lora_modules={k: str(v) for k, v in assets.adapters.items()}, device="cpu")
    off = LLM(str(assets.model), async_scheduling=False, max_model_len=64, **kw)
    on = LLM(str(assets.model), async_scheduling=True, max_model_len=64, **kw)
    prompts = ["SELECT name FROM", "hello there", "the cat sat on", "x" * 30, "2 + 2 ="]
    loras = ["sql", "chat", None, "sql", "chat"]
    probe = off.generate(prompts, GREEDY, lora=loras)
    tok = off.get_tokenizer()
    stop_id = probe[0].token_ids[4]
    # a stop string that ends one character into a token of several
    i = next(i for i, t in enumerate(probe[1].token_ids) if i > 1 and len(tok.decode([t])) > 1)
    stop_text = tok.decode(list(probe[1].token_ids[: i + 1]))
    stop_text = stop_text[len(tok.decode(list(probe[1].token_ids[:i]))) - 2 :][:3]
    params = [
        dataclasses.replace(GREEDY, stop_token_ids=[stop_id], logprobs=2),
        dataclasses.replace(GREEDY, ignore_eos=False, stop=[stop_text]),
        SamplingParams(max_tokens=3, temperature=0.8, seed=7, prompt_logprobs=1),
        SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),  # to max_model_len
        SamplingParams(max_tokens=9, temperature=0.7, seed=3, repetition_penalty=1.3),
    ]
    want = _seen(off.generate(prompts, params, lora=loras))
    assert [w[2] for w in want] == ["stop", "stop", "length", "length", "length"]
    assert _same(_seen(on.generate(prompts, params, lora=loras)), want)
    # without the penalties the steps overlap, and give the same again
    assert _same(_seen(on.generate(prompts[:4], params[:4], lora=loras[:4])), want[:4])
    eos = probe[2].token_ids[5]
    for llm in (on, off):
        llm.engine.eos_token_ids = frozenset({eos})
    eos_params = dataclasses.replace(GREEDY, ignore_eos=False)
    want = _seen(off.generate(prompts, eos_params, lora=loras))
    assert want[2][2] == "stop" and want[2][0][-1] == eos
    assert _same(_seen(on.generate(prompts, eos_params, lora=loras)), want)


def test_a_request_that_stops_while_planned_again_drops_that_token(tiny):
    """EOS in step N is seen after step N+1 was launched with the request in it: that token is
    never emitted, and the pages go back once. max_tokens is known ahead: no step is wasted."""
    off, on = _llm(tiny, on=False), _llm(tiny, on=True)
    probe = off.generate(PROMPTS, GREEDY, lora=LORAS)
    eos = probe[1].token_ids[3]
    for llm in (off, on):
        llm.engine.eos_token_ids = frozenset({eos})
    params = dataclasses.replace(GREEDY, ignore_eos=False)
    want = _seen(off.generate(PROMPTS, params, lora=LORAS))
    steps = Steps(on)
    got = on.generate(PROMPTS, params, lora=LORAS)
    assert _same(_seen(got), want)
    stopped = next(i for i, w in enumerate(want) if w[2] == "stop")
    n = len(want[stopped][0])
    rid = got[stopped].request_id
    assert steps.count(rid) == n + 1  # its prompt and n - 1 decodes, then the dropped one
    full = next(i for i, w in enumerate(want) if w[2] == "length")
    assert steps.count(got[full].request_id) == GREEDY.max_tokens  # none wasted
    stats = on.engine.stats()
    assert stats.kv_pages_used == 0 and on.engine.slot_table.refs == [0, 0, 0, 0]
    assert not on.engine.has_unfinished_requests()


def test_generate_leaves_the_engine_idle_when_the_last_request_stops_on_eos(tiny):
    """The last request to finish stops on EOS in step N while step N+1, planned with it, is
    in flight: generate returns with that step committed, no page held (seen with a slow
    adapter read, which made the stopping request the last)."""
    off, on = _llm(tiny, on=False), _llm(tiny, on=True)
    eos = off.generate(PROMPTS[1:2], GREEDY, lora="a")[0].token_ids[3]
    on.engine.eos_token_ids = frozenset({eos})
    params = dataclasses.replace(GREEDY, ignore_eos=False)
    (out,) = on.generate(PROMPTS[1:2], params, lora="a")
    assert out.finish_reason == "stop" and len(out.token_ids) == 4
    assert not on.engine.has_unfinished_requests()
    assert on.engine.stats().kv_pages_used == 0 and on.engine.slot_table.refs[0] == 0


def test_abort_mid_flight(tiny):
    on = _llm(tiny, on=True)
    want = _seen(_llm(tiny, on=False).generate(PROMPTS[:1], GREEDY))
    engine = on.engine
    engine.add_request("keep", PROMPTS[0], GREEDY, None)
    engine.add_request("gone", PROMPTS[2], GREEDY, "a")
    outs = engine.step() + engine.step()
    while not engine._requests["gone"].num_placeholders:  # "a" is read from its folder first
        outs += engine.step()
    assert engine._flights
    gone = engine.abort_request("gone")  # its last output, with the tokens committed so far
    assert gone.finish_reason == "abort" and len(gone.token_ids) >= 1
    assert engine._requests.get("gone") is None and engine.slot_table.refs[0] == 0
    assert engine.abort_request("gone") is None and engine.abort_request("never") is None
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert "gone" not in {o.request_id for o in outs[2:]}
    assert _same(_seen([o for o in outs if o.finished]), want)
    assert engine.stats().kv_pages_used == 0


def test_preemption_under_page_pressure(tiny):
    """12 pages of 4 tokens cannot hold the four sequences: a preemption waits until no step
    is in flight, and the tokens are those of one step at a time."""
    kw = dict(page_size=4, num_pages=12, max_loras=1)
    want = _seen(_llm(tiny, on=False, **kw).generate(PROMPTS, GREEDY, lora=LORAS))
    on = _llm(tiny, on=True, **kw)
    steps = Steps(on)
    assert _same(_seen(on.generate(PROMPTS, GREEDY, lora=LORAS)), want)
    assert on.engine.scheduler.num_preemptions > 0 and on.engine.stats().kv_pages_used == 0
    assert len(steps.plans) > 0


def test_no_slot_is_refilled_under_the_step_in_flight(tiny):
    """One slot, two adapters in turn: each load waits for the slot's requests to finish, and
    never lands in a slot that the step in flight reads."""
    model, adapter = tiny
    on = _llm(tiny, on=True, max_loras=1)
    on.load_lora("b", adapter)
    engine = on.engine
    fill = engine.slot_pool.fill
    fills = []

    def checked_fill(slot, lora, *region, **kwargs):
        readers = [c.request for step in engine._flights for c in step.plan.chunks]
        assert all(r.slot != slot for r in readers), f"slot {slot} refilled under a step"
        fills.append(lora.name)
        fill(slot, lora, *region, **kwargs)

    engine.slot_pool.fill = checked_fill
    loras = ["a", "b", "a", "b"]
    off = _llm(tiny, on=False, max_loras=1)
    off.load_lora("b", adapter)
    want = _seen(off.generate(PROMPTS, GREEDY, lora=loras))
    assert _same(_seen(on.generate(PROMPTS, GREEDY, lora=loras)), want)
    assert fills == ["a", "b"]  # b took the slot once a's requests were done with it


def test_unloading_an_adapter_the_step_in_flight_reads(tiny):
    """Busy while its request runs (409 over HTTP). Once the request has stopped (EOS, seen
    after the next step was launched with it), the unload waits for that step, which still
    reads the adapter's slot, and succeeds."""
    on = _llm(tiny, on=True)
    engine = on.engine
    probe = _llm(tiny, on=False).generate(PROMPTS[1], GREEDY, lora="a")[0]
    engine.eos_token_ids = frozenset({probe.token_ids[2]})
    engine.add_request("r", PROMPTS[1], dataclasses.replace(GREEDY, ignore_eos=False), "a")
    engine.step()
    with pytest.raises(AdapterBusyError):
        on.unload_lora("a")
    outs = []
    while not any(o.finished for o in outs):
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and len(outs[-1].token_ids) == 3
    assert engine._flights and engine.slot_table.refs[0] == 1  # still read
    on.unload_lora("a")
    assert "a" not in on.list_loras() and engine.slot_table.refs == [0, 0, 0, 0]
    assert not engine._flights and engine.stats().kv_pages_used == 0


def test_abort_of_an_answer_committed_outside_step_drops_it(tiny):
    """An abort waits for the step in flight: a batch-mate may finish in that commit, and its
    answer waits for the next step(). Aborted in that window, it never arrives from step(): the
    abort returns it."""
    on = _llm(tiny, on=True)
    engine = on.engine
    short = dataclasses.replace(GREEDY, max_tokens=2)
    engine.add_request("short", PROMPTS[1], short, None)
    engine.add_request("long", PROMPTS[0], GREEDY, None)
    outs = engine.step() + engine.step()  # short's last token is in flight now
    assert not any(o.finished for o in outs)
    long = engine.abort_request("long")  # commits the step in flight: short finishes there
    assert long.finish_reason == "abort" and len(long.token_ids) == 2
    assert [o.request_id for o in engine._ready] == ["short"] and engine._ready[0].finished
    last = engine.abort_request("short")
    assert last.finish_reason == "length" and len(last.token_ids) == 2
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.stats().kv_pages_used == 0
