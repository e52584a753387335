"""The engine on a tiny model: chunked prefill, preemption and batch-mates change no token;
stop conditions; aborts free everything; seeded sampling repeats; logprobs are vLLM's."""

import hf_fixtures as hf
import pytest

from moelora import LLM, SamplingParams
from moelora.errors import AdapterBusyError, EngineDeadError, InvalidRequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 77, 31, 8, 100, 4, 66], [3, 14, 15, 92], list(range(40, 70)), [250]]


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model = hf.make_model("qwen3_moe", root / "model", seed=3)
    adapter = hf.make_per_expert_adapter(
        model, root / "adapter", seed=4, rank=4, alpha=8, arch="qwen3_moe"
    )
    return str(model), str(adapter)


@pytest.fixture(scope="module")
def roomy(model_and_adapter):
    model, adapter = model_and_adapter
    return LLM(model, lora_modules={"a": adapter}, device="cpu", max_lora_rank=8)


def generate(llm, loras=(None, "a", None, "a")):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=list(loras))]


def test_chunked_prefill_and_preemption_change_no_token(model_and_adapter, roomy):
    model, adapter = model_and_adapter
    expected = generate(roomy)
    # 8-token budget: every prompt is prefilled in chunks, mixed with decodes of the others
    chunked = LLM(
        model, lora_modules={"a": adapter}, device="cpu", max_lora_rank=8, max_num_batched_tokens=8
    )
    assert generate(chunked) == expected
    # 12 pages of 4 tokens cannot hold all four sequences: some are preempted and recomputed
    tight = LLM(
        model,
        lora_modules={"a": adapter},
        device="cpu",
        max_lora_rank=8,
        page_size=4,
        num_pages=12,
        max_loras=1,
    )
    assert generate(tight) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.stats().kv_pages_used == 0
    # prompt logprobs: one entry per prompt token whether or not the prompt was recomputed
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    before = tight.engine.scheduler.num_preemptions
    got = tight.generate(PROMPTS, params, lora=[None, "a", None, "a"])
    assert tight.engine.scheduler.num_preemptions > before
    want = roomy.generate(PROMPTS, params, lora=[None, "a", None, "a"])
    for g, w, prompt in zip(got, want, PROMPTS):
        assert len(g.prompt_logprobs) == len(prompt) and g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) <= 1e-5 for k in a)


def test_folded_and_row_tiled_attention_lora_agree(model_and_adapter, roomy):
    """Steps of up to FOLD_LORA_MAX_TOKENS tokens fold the attention's LoRA into the norms and
    rotary; longer ones take add_lora_. Two 180-token prompts prefilled in one 360-token step
    (add_lora_) and in 64-token chunks (folded) give the same tokens and logprobs."""
    from moelora.layers.attention_lora import FOLD_LORA_MAX_TOKENS

    model, adapter = model_and_adapter
    prompts = [[(7 * i + 3) % 200 + 1 for i in range(180)]]
    prompts.append([(11 * i) % 250 + 2 for i in range(180)])

    assert sum(map(len, prompts)) > FOLD_LORA_MAX_TOKENS > 64
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    whole = roomy.generate(prompts, params, lora=["a", "a"])
    chunked = LLM(
        model, lora_modules={"a": adapter}, device="cpu", max_lora_rank=8, max_num_batched_tokens=64
    ).generate(prompts, params, lora=["a", "a"])
    for w, c in zip(whole, chunked):
        assert w.token_ids == c.token_ids
        for a, b in zip(w.logprobs, c.logprobs):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 for k in a)


def test_a_request_does_not_depend_on_its_batch_mates(roomy):
    together = generate(roomy)
    alone = [
        roomy.generate([p], GREEDY, lora=a)[0].token_ids
        for p, a in zip(PROMPTS, (None, "a", None, "a"))
    ]
    assert together == alone
    assert together[0] != generate(roomy, ("a", "a", None, None))[0]  # the adapter matters


def test_stop_token_ids_stop_strings_and_max_tokens(roomy):
    base = roomy.generate([PROMPTS[0]], GREEDY)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = roomy.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    stop_text = base.text[3:5]
    assert stop_text, base.text  # else the stop string below would check nothing
    out = roomy.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop=[stop_text])
    )[0]
    assert out.finish_reason == "stop" and stop_text not in out.text
    assert base.text.startswith(out.text)


def test_eos_stops_unless_ignored(roomy, monkeypatch):
    """The model's end-of-sequence ids stop a request (finish_reason "stop", the id kept as
    the last token), unless it sets ignore_eos."""
    base = roomy.generate([PROMPTS[0]], GREEDY)[0]
    eos = base.token_ids[4]
    monkeypatch.setattr(roomy.engine, "eos_token_ids", frozenset({eos}))
    out = roomy.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0]
    first = base.token_ids.index(eos)
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    assert roomy.generate([PROMPTS[0]], GREEDY)[0].token_ids == base.token_ids


def test_max_model_len_is_enforced(model_and_adapter):
    model, _ = model_and_adapter
    llm = LLM(model, device="cpu", max_model_len=16)
    out = llm.generate([list(range(1, 11))], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(InvalidRequestError, match="max_model_len=16"):
        llm.generate([list(range(1, 18))], GREEDY)


def test_abort_frees_pages_and_slot_reference(roomy):
    engine = roomy.engine
    engine.add_request("x", PROMPTS[2], GREEDY, "a")
    engine.add_request("y", PROMPTS[1], GREEDY, None)
    engine.step()
    assert engine.stats().kv_pages_used > 0 and engine.stats().num_running == 2
    assert engine.stats().lora_slot_refs == 1  # x holds a's slot; y, a base request, none
    with pytest.raises(AdapterBusyError):
        roomy.unload_lora("a")
    engine.abort_request("x")
    engine.abort_request("y")
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert engine.slot_table.refs == [0] * len(engine.slot_table.refs)
    assert stats.lora_slot_refs == 0 and stats.gpu_memory_allocated == 0  # on the CPU
    assert not engine.has_unfinished_requests()


def test_abort_frees_everything_in_every_state(model_and_adapter):
    """Waiting (never scheduled), mid-prefill (a chunk of its prompt computed), running,
    preempted (sent back to waiting): each abort gives back its pages and slot reference."""
    model, adapter = model_and_adapter
    llm = LLM(
        model,
        lora_modules={"a": adapter},
        device="cpu",
        max_lora_rank=8,
        max_num_batched_tokens=8,
        page_size=4,
        num_pages=12,
        max_loras=1,
    )
    engine = llm.engine

    def assert_empty():
        stats = engine.stats()
        assert stats.kv_pages_used == 0 and stats.num_running == stats.num_waiting == 0
        assert engine.slot_table.refs == [0] * len(engine.slot_table.refs)
        assert not engine.has_unfinished_requests()

    engine.add_request("waiting", PROMPTS[2], GREEDY, "a")
    engine.abort_request("waiting")
    assert_empty()
    engine.add_request("prefill", PROMPTS[2], GREEDY, "a")  # 30 tokens, 8 a step
    while not engine._requests["prefill"].num_computed_tokens:  # its adapter is read first
        engine.step()
    assert 0 < engine._requests["prefill"].num_computed_tokens < len(PROMPTS[2])
    engine.abort_request("prefill")
    assert_empty()
    for i, (prompt, lora) in enumerate(zip(PROMPTS, (None, "a", None, "a"))):
        engine.add_request(f"r{i}", prompt, GREEDY, lora)
    before = engine.scheduler.num_preemptions
    while engine.scheduler.num_preemptions == before:
        engine.step()
    assert any(r.num_computed_tokens == 0 for r in engine.scheduler.waiting)  # a preempted one
    for i in range(len(PROMPTS)):
        engine.abort_request(f"r{i}")
    assert_empty()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora=[None, "a", None, "a"])]


def test_a_failed_step_leaves_no_request_behind(model_and_adapter, monkeypatch):
    """generate() that raises mid-way (here a step, as a bug or Ctrl-C would) aborts its
    requests: the next generate() on the same LLM starts from an empty engine."""
    model, _ = model_and_adapter
    llm = LLM(model, device="cpu")
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().kv_pages_used == 0
    assert len(llm.generate(PROMPTS, GREEDY)) == len(PROMPTS)


def test_text_needs_a_tokenizer(model_and_adapter, monkeypatch):
    """Without a tokenizer, text prompts and stop strings are refused with what to do."""
    model, _ = model_and_adapter
    llm = LLM(model, device="cpu")
    monkeypatch.setattr(llm.engine, "tokenizer", None)
    with pytest.raises(InvalidRequestError, match="text prompts need a tokenizer"):
        llm.generate(["hello"], GREEDY)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        llm.generate([PROMPTS[0]], SamplingParams(stop=["x"]))
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_repeats_and_logprobs_hold_the_chosen_token(roomy):
    params = SamplingParams(
        max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=11, logprobs=3, ignore_eos=True
    )
    a = roomy.generate([PROMPTS[0], PROMPTS[1]], params)
    b = roomy.generate([PROMPTS[0], PROMPTS[1]], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for tok, lp in zip(a[0].token_ids, a[0].logprobs):
        assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())


def test_requests_the_engine_cannot_serve_are_refused_before_anything_runs(roomy):
    with pytest.raises(InvalidRequestError, match="logprobs=100000"):
        roomy.generate([PROMPTS[0]], SamplingParams(logprobs=100000))
    with pytest.raises(InvalidRequestError, match="prompt token id 9999"):
        roomy.generate([[1, 9999]], GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt token id 2.0 is invalid: expected an"):
        roomy.generate([[1, 2.0]], GREEDY)
    with pytest.raises(InvalidRequestError, match="lora has 1 entries"):
        roomy.generate(PROMPTS[:2], GREEDY, lora=["a"])
    assert not roomy.engine.has_unfinished_requests()


def test_bad_sampling_params_are_refused_with_the_value_named():
    with pytest.raises(InvalidRequestError, match="seed=18446744073709551616"):
        SamplingParams(seed=2**64)
    with pytest.raises(InvalidRequestError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    # values of the wrong type would fail inside a step, failing its batch-mates too
    for kw in (
        dict(logprobs=1.5),
        dict(prompt_logprobs=True),
        dict(top_k=2.5),
        dict(seed=1.5),
        dict(stop_token_ids=5),
        dict(stop_token_ids=[1.0]),
        dict(stop_token_ids=[-1]),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(temperature="0.5"),
    ):
        (name,) = kw
        with pytest.raises(InvalidRequestError, match=f"{name}=.* is invalid"):
            SamplingParams(**kw)


def test_incremental_detokenization_equals_decoding_everything(model_and_adapter):
    from moelora.tokenizer import Tokenizer

    tok = Tokenizer(model_and_adapter[0], [])
    text = "héllo wörld, 日本語 and 🙂 emoji; plain ascii too."
    ids = tok.encode(text)
    assert len(ids) > len(text)  # byte-level: multi-byte characters span several tokens
    out, offsets = "", (0, 0)
    for n in range(1, len(ids) + 1):
        delta, offsets = tok.decode_incremental(ids[:n], offsets)
        assert "\ufffd" not in delta  # a character is never emitted half-done
        out += delta
        assert tok.decode(ids[:n]).startswith(out)
    assert out == tok.decode(ids) == text


def test_frequency_and_presence_penalties_steer_greedy_decoding(roomy):
    """Each greedy token is the argmax of the step's raw logprobs (all 257 tokens) minus the
    penalties of the tokens generated before it; and the penalties change the output."""
    params = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logprobs=hf.VOCAB_SIZE,
    )
    outs = roomy.generate(PROMPTS, params, lora=[None, "a", None, "a"])
    for out in outs:
        for t, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            before = out.token_ids[:t]
            score = {v: x - 1.5 * before.count(v) - 0.5 * (v in before) for v, x in lp.items()}
            assert token == max(score, key=score.get)
    plain = generate(roomy)
    assert [o.token_ids for o in outs] != plain


def test_logit_bias_outside_the_vocabulary_is_refused(roomy):
    with pytest.raises(InvalidRequestError, match="logit_bias token id 257"):
        roomy.generate([PROMPTS[0]], SamplingParams(logit_bias={257: 1.0}))


def test_a_closed_engine_refuses_to_go_on_and_another_builds(model_and_adapter):
    model, adapter = model_and_adapter
    with LLM(model, lora_modules={"a": adapter}, device="cpu", max_lora_rank=8) as first:
        expected = generate(first)
        kv = first.engine.runner.kv_caches[0][0]
        weight = next(first.engine.model.parameters())
    with pytest.raises(EngineDeadError, match="the engine is closed"):
        first.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineDeadError, match="the engine is closed"):
        first.engine.step()
    first.close()  # again: nothing
    assert first.engine.model is None and first.engine.runner.kv_caches == []
    # what still refers to them holds no memory: the storage went with close()
    assert all(t.untyped_storage().nbytes() == 0 for t in (kv, weight))
    assert first.list_loras() == []
    second = LLM(model, lora_modules={"a": adapter}, device="cpu", max_lora_rank=8)
    assert generate(second) == expected


def test_a_stop_tokens_text_is_not_output(tmp_path):
    """As vLLM: the token that stops a request (stop_token_ids, or an EOS a grammar ends on) is
    in token_ids but its text is not, special or not."""
    from moelora.demo import ensure_demo

    demo = ensure_demo(tmp_path / "demo")
    llm = LLM(str(demo.model), device="cpu")
    tok = llm.get_tokenizer()
    prompt = [11, 42, 7, 99]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ids = free[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode(ids[i : i + 1]))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[ids[k]])
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[: k + 1]
    assert out.text == tok.decode(ids[:k]) != tok.decode(ids[: k + 1])
