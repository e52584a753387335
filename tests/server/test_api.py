"""The OpenAI-compatible server over real HTTP, with the official openai client.

Every generation is greedy and compared with LLM.generate on the same model and adapter.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from .conftest import BASE, MAX_MODEL_LEN, Offline, Server

MODELS = [BASE, "sql", "chat", "extra"]
PROMPTS = [
    "SELECT name FROM users WHERE",
    "The capital of France is",
    "Tell me a story about a cat.",
    "What is a mixture of experts?",
    "INSERT INTO users (name, age) VALUES",
    "Low-rank adapters add",
    "Paris",
    "Write a question and answer it in one sentence.",
]


@pytest.mark.parametrize("model", MODELS)
def test_completion_equals_offline(server: Server, offline: Offline, model: str) -> None:
    prompt = PROMPTS[MODELS.index(model)]
    resp = server.client().completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0
    )
    expected = offline.generate([(model, prompt, 12)])[0]
    assert resp.model == model
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 12


def test_penalties_pass_through_to_the_engine(server: Server, offline: Offline) -> None:
    """presence/frequency (OpenAI) and repetition (vLLM's extra field) penalties over HTTP give
    what LLM.generate gives with the same SamplingParams."""
    from moelora import SamplingParams

    prompt = PROMPTS[1]
    penalties = dict(presence_penalty=0.7, frequency_penalty=1.1, repetition_penalty=1.3)
    resp = server.client().completions.create(
        model="sql",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        presence_penalty=0.7,
        frequency_penalty=1.1,
        extra_body={"repetition_penalty": 1.3},
    )
    params = SamplingParams(max_tokens=10, temperature=0, **penalties)
    ids = offline.tokenizer.encode(prompt)
    expected = offline.llm.generate([ids], params, lora=["sql"])[0]
    assert resp.choices[0].text == expected.text
    assert expected.text != offline.text("sql", prompt, 10)  # the penalties changed something


@pytest.mark.parametrize("model", ["sql", "chat"])
def test_completion_stream_equals_offline(server: Server, offline: Offline, model: str) -> None:
    prompt = PROMPTS[4]
    chunks = list(
        server.client().completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline.text(model, prompt, 10)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) <= {None}
    assert chunks[-1].usage.completion_tokens == 10


def test_several_prompts_and_token_ids(server: Server, offline: Offline) -> None:
    ids = offline.tokenizer.encode(PROMPTS[6])
    prompts = [PROMPTS[0], PROMPTS[1]]
    expected = [offline.text("chat", p, 8) for p in (*prompts, ids)]
    client = server.client()
    kw = dict(model="chat", max_tokens=8, temperature=0)
    resp = client.completions.create(prompt=prompts, **kw)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == expected[:2]
    assert resp.usage.completion_tokens == 16
    texts = ["", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == expected[:2]
    assert client.completions.create(prompt=ids, **kw).choices[0].text == expected[2]


@pytest.mark.parametrize("model", [BASE, "chat"])
def test_chat_equals_offline(server: Server, offline: Offline, model: str) -> None:
    messages = [
        {"role": "system", "content": "You answer in SQL."},
        {"role": "user", "content": "List the users older than 30."},
    ]
    expected = offline.text(model, offline.chat_ids(messages), 12)
    client = server.client()
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == len(offline.chat_ids(messages))
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token(server: Server, offline: Offline) -> None:
    """A +100 bias on one token makes greedy decoding emit only that token."""
    token = offline.tokenizer.encode("x")[-1]
    resp = server.client().completions.create(
        model=BASE, prompt=PROMPTS[0], max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert resp.choices[0].text == offline.tokenizer.decode([token] * 5)


def test_echo_puts_the_prompt_and_its_logprobs_in_front(server: Server, offline: Offline):
    """echo=true: the prompt's text before the completion; with logprobs, one entry per prompt
    token (None for the first) equal to LLM.generate's prompt_logprobs, offsets consistent;
    streamed, the prompt comes first and the whole text is the same."""
    from moelora import SamplingParams

    client, prompt = server.client(), PROMPTS[2]
    plain = client.completions.create(
        model="sql", prompt=prompt, max_tokens=4, temperature=0, echo=True
    )
    assert plain.choices[0].text == prompt + offline.text("sql", prompt, 4)
    resp = client.completions.create(
        model="sql", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    ids = offline.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2)
    want = offline.llm.generate([ids], params, lora=["sql"])[0]
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == plain.choices[0].text
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(want.prompt_logprobs[j][ids[j]], abs=1e-5)
        assert len(lp.top_logprobs[j]) in (2, 3)
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    streamed = list(
        client.completions.create(
            model="sql", prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True
        )
    )
    assert streamed[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    by_ids = client.completions.create(
        model="sql", prompt=ids, max_tokens=4, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == offline.tokenizer.decode(ids) + offline.text("sql", ids, 4)


def test_n_samples_per_prompt_numbered_as_openai_does(server: Server, offline: Offline) -> None:
    """n=2 over two prompts: choice i is sample i % 2 of prompt i // 2; sample j of a seeded
    request is LLM.generate with seed + j; the prompt's tokens count once in the usage."""
    from moelora import SamplingParams

    prompts = PROMPTS[:2]
    resp = server.client().completions.create(
        model="sql", prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=7
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    ids = [offline.tokenizer.encode(p) for p in prompts]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=7 + j) for j in range(2)]
    expected = offline.llm.generate([ids[0], ids[0], ids[1], ids[1]], params * 2, lora=["sql"] * 4)
    assert [c.text for c in resp.choices] == [o.text for o in expected]
    assert resp.choices[0].text != resp.choices[1].text  # different seeds, different samples
    assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in expected)


def test_chat_n_streams_every_choice(server: Server) -> None:
    """Streaming with n=3: each choice gets its role chunk, its text and its finish reason,
    and the texts equal the non-streamed answer to the same seeded request."""
    client = server.client()
    kw = dict(
        model="chat",
        messages=[{"role": "user", "content": "Hello"}],
        n=3,
        max_tokens=6,
        temperature=0.9,
        seed=123,
    )
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts, roles, finish = ["", "", ""], [None] * 3, [None] * 3
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] = roles[c.index] or c.delta.role
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert roles == ["assistant"] * 3 and finish == [c.finish_reason for c in whole.choices]


def test_chat_content_parts_and_default_max_tokens(server: Server, offline: Offline) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}]
    resp = server.client().chat.completions.create(model="sql", messages=messages, temperature=0)
    prompt_ids = offline.chat_ids([{"role": "user", "content": "Tell me"}])
    room = MAX_MODEL_LEN - len(prompt_ids)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens <= room
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_stop_strings(server: Server, offline: Offline) -> None:
    prompt, full = PROMPTS[1], offline.text("sql", PROMPTS[1], 16)
    stop = full[5:8]
    cut = full[: full.find(stop)]
    client = server.client()
    resp = client.completions.create(
        model="sql", prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    )
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (cut, "stop")
    chunks = list(
        client.completions.create(
            model="sql", prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(server: Server, offline: Offline) -> None:
    client = server.client()
    resp = client.completions.create(
        model="chat", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 3 and max(top.values()) == pytest.approx(chosen)
    chat = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_seeded_sampling_repeats(server: Server) -> None:
    client = server.client()
    texts = [
        client.completions.create(
            model="extra",
            prompt=PROMPTS[2],
            max_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=1234,
            extra_body={"top_k": 50},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]


def test_models_lists_base_and_adapters(server: Server) -> None:
    cards = {m.id: m for m in server.client().models.list().data}
    assert {BASE, "sql", "chat", "extra"} <= set(cards)
    assert cards[BASE].parent is None
    for name in ("sql", "chat", "extra"):
        assert cards[name].parent == BASE
        assert cards[name].root == str(server.adapters[name])


def test_concurrent_requests_over_adapters(server: Server, offline: Offline) -> None:
    """64 requests over 3 adapters and the base (2 slots), some streamed: all equal offline."""
    requests = [
        (MODELS[i % 4], PROMPTS[(i * 3) % len(PROMPTS)], 6 + i % 7, i % 3 == 0) for i in range(64)
    ]
    expected = offline.generate([(m, p, n) for m, p, n, _ in requests])

    async def one(client, model: str, prompt: str, max_tokens: int, stream: bool) -> str:
        kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if not stream:
            return (await client.completions.create(**kw)).choices[0].text
        chunks = [c async for c in await client.completions.create(**kw, stream=True)]
        return "".join(c.choices[0].text for c in chunks)

    async def run_all() -> list[str]:
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, *r) for r in requests))

    texts = asyncio.run(run_all())
    assert texts == [e.text for e in expected]
    m = server.metrics()
    assert m["moelora_lora_slots_total"] == 2 and m["moelora_lora_slots_used"] <= 2


def test_load_and_unload_while_traffic_runs(server: Server, offline: Offline) -> None:
    traffic = [(MODELS[i % 3], PROMPTS[i % len(PROMPTS)], 24) for i in range(12)]
    expected = [e.text for e in offline.generate(traffic)]
    hot_prompt = PROMPTS[3]

    async def scenario() -> tuple[list[str], str]:
        async with (
            server.async_client(timeout=120) as client,
            httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http,
        ):
            tasks = [
                asyncio.ensure_future(
                    client.completions.create(model=m, prompt=p, max_tokens=n, temperature=0)
                )
                for m, p, n in traffic
            ]
            await asyncio.sleep(0.05)
            body = {"lora_name": "hot", "lora_path": str(server.adapters["hot"])}
            assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 200
            hot = await client.completions.create(
                model="hot", prompt=hot_prompt, max_tokens=8, temperature=0
            )
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})
            assert r.status_code == 200, r.text
            outs = await asyncio.gather(*tasks)
            return [o.choices[0].text for o in outs], hot.choices[0].text

    texts, hot_text = asyncio.run(scenario())
    assert texts == expected
    assert hot_text == offline.text("hot", hot_prompt, 8)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="hot", prompt="x", max_tokens=2)
    assert "hot" not in {m.id for m in server.client().models.list().data}


def test_unload_busy_adapter_is_409(server: Server) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        body = {
            "model": "chat",
            "prompt": PROMPTS[0],
            "max_tokens": 240,
            "ignore_eos": True,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert r.status_code == 409
            assert r.json()["error"]["message"]
        _wait_idle(server)
        assert "chat" in {m.id for m in server.client().models.list().data}


def _wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["moelora_num_requests_running"] + m["moelora_num_requests_waiting"] == 0
        if (idle and m["moelora_kv_pages_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_pages(server: Server) -> None:
    aborted = server.metrics().get('moelora_requests_total{model="sql",status="abort"}', 0)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        body = {
            "model": "sql",
            "prompt": PROMPTS[2],
            "max_tokens": 240,
            "ignore_eos": True,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            for _ in range(3):
                next(lines)
            assert server.metrics()["moelora_kv_pages_used"] > 0
    m = _wait_idle(server)
    assert m["moelora_kv_pages_used"] == 0 and m["moelora_num_requests_running"] == 0
    assert m['moelora_requests_total{model="sql",status="abort"}'] == aborted + 1


def test_disconnect_while_waiting_for_full_response(server: Server) -> None:
    aborted = server.metrics().get('moelora_requests_total{model="demo",status="abort"}', 0)
    body = {"model": BASE, "prompt": PROMPTS[5], "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=0.2)
    m = _wait_idle(server)
    assert m["moelora_kv_pages_used"] == 0
    assert m['moelora_requests_total{model="demo",status="abort"}'] == aborted + 1


def test_metrics(server: Server) -> None:
    server.client().completions.create(model="sql", prompt="a", max_tokens=3, temperature=0)
    m = server.metrics()
    assert m['moelora_requests_total{model="sql",status="length"}'] >= 1
    assert m['moelora_generation_tokens_total{model="sql"}'] >= 3
    assert m['moelora_prompt_tokens_total{model="sql"}'] >= 1
    assert m["moelora_time_to_first_token_seconds_count"] >= 1
    assert m["moelora_inter_token_latency_seconds_count"] >= 2
    assert m['moelora_inter_token_latency_seconds_bucket{le="+Inf"}'] >= 2
    assert m["moelora_kv_pages_total"] > 0
    assert m["moelora_eager_steps_total"] + m["moelora_graph_replays_total"] > 0
    assert m["moelora_gpu_memory_allocated_bytes"] == 0  # the server runs on the CPU
    assert m["process_resident_memory_bytes"] > 100 * 2**20  # torch alone takes more
    assert _wait_idle(server)["moelora_lora_slot_refs"] == 0
    # sql just ran: it is in a slot (two slots, three adapters: one at least lives on the host)
    assert m['moelora_lora_adapter_loaded{adapter="sql",level="gpu"}'] == 1
    levels = [k for k in m if k.startswith('moelora_lora_adapter_loaded{adapter="chat"')]
    assert len(levels) == 1 and levels[0].endswith(
        ('level="gpu"}', 'level="cpu"}', 'level="disk"}')
    )
    assert m['moelora_lora_adapter_requests_waiting{adapter="sql"}'] == 0
    assert m["moelora_lora_fills_total"] >= 1 and m["moelora_lora_fill_bytes_total"] > 0
    cards = {
        c["id"]: c
        for c in httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"]
    }
    assert cards["sql"]["residency"] == "gpu" and cards["sql"]["num_requests_waiting"] == 0
    assert "residency" not in cards[BASE]
    # on the GPU: in a slot (--max-loras 2 of them) or parked in the adapter arena beside
    # them, as many as its memory holds
    on_gpu = [c for c in cards.values() if c.get("residency") == "gpu"]
    assert len(on_gpu) >= 1 and m["moelora_lora_slots_used"] <= m["moelora_lora_slots_total"] == 2


# ----------------------------------------------------------------------------- bad input


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 0},
        {"temperature": -0.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"n": 0},
        {"n": 129},
        {"prompt": [1] * (MAX_MODEL_LEN + 1)},
        {"prompt": ""},
        {"max_tokens": "many"},
        {"prompt": None},
        {"logprobs": 21},
        {"seed": 2**64},
        {"stop": [""]},
        {"presence_penalty": 2.5},
        {"logit_bias": {"abc": 1}},
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"100000000": 1}},
        {"repetition_penalty": 0},
        {"stop_token_ids": [-1]},
    ],
)
def test_bad_completion_params_are_400(server: Server, body: dict) -> None:
    full = {"model": "sql", "prompt": "hello", "max_tokens": 4, **body}
    r = httpx.post(f"{server.url}/v1/completions", json=full, headers=server.headers)
    _error(r, 400)


def test_a_tiny_temperature_samples(server: Server) -> None:
    """1e-40 is raised to vLLM's floor of 0.01 (dividing the logits by it made NaN, and the
    step failed for every request in it)."""
    body = {
        "model": "sql",
        "prompt": "hello",
        "max_tokens": 4,
        "temperature": 1e-40,
        "ignore_eos": True,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_bad_chat_params_are_400(server: Server) -> None:
    url = f"{server.url}/v1/chat/completions"
    for body in [
        {"messages": []},
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    ]:
        _error(httpx.post(url, json={"model": BASE, **body}, headers=server.headers), 400)


def test_malformed_json_is_400(server: Server) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"):
        r = httpx.post(
            f"{server.url}{path}", content=b'{"model": "sql", "prompt": ', headers=headers
        )
        _error(r, 400)


def test_unknown_model_is_404(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "nope" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


@pytest.mark.parametrize(
    ("name", "path_key", "why"),
    [
        ("ghost", None, "missing path"),
        ("big", "big", "rank above --max-lora-rank"),
        ("misshapen", "misshapen", "wrong shapes"),
        ("sql", "hot", "name exists"),
        (BASE, "hot", "the base model's name"),
    ],
)
def test_bad_adapter_load_is_400(server: Server, name: str, path_key: str | None, why: str):
    path = str(server.adapters[path_key]) if path_key else "/nonexistent/adapter"
    before = {m.id for m in server.client().models.list().data}
    r = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": path},
        headers=server.headers,
    )
    _error(r, 400)
    assert {m.id for m in server.client().models.list().data} == before, why
    if name not in before:
        with pytest.raises(openai.NotFoundError):
            server.client().completions.create(model=name, prompt="hi", max_tokens=2)


def test_refused_name_can_be_loaded_properly_afterwards(server: Server, offline: Offline):
    url = f"{server.url}/v1"
    body = {"lora_name": "misshapen", "lora_path": str(server.adapters["misshapen"])}
    _error(httpx.post(f"{url}/load_lora_adapter", json=body, headers=server.headers), 400)
    body["lora_path"] = str(server.adapters["hot"])
    r = httpx.post(f"{url}/load_lora_adapter", json=body, headers=server.headers)
    assert r.status_code == 200, r.text
    resp = server.client().completions.create(
        model="misshapen", prompt=PROMPTS[6], max_tokens=6, temperature=0
    )
    assert resp.choices[0].text == offline.text("hot", PROMPTS[6], 6)
    r = httpx.post(
        f"{url}/unload_lora_adapter", json={"lora_name": "misshapen"}, headers=server.headers
    )
    assert r.status_code == 200


def test_replace_swaps_an_adapters_weights_under_its_name(server: Server, offline: Offline):
    url, prompt = f"{server.url}/v1", PROMPTS[5]

    def answer() -> str:
        resp = server.client().completions.create(
            model="swap", prompt=prompt, max_tokens=6, temperature=0
        )
        return resp.choices[0].text

    body = {"lora_name": "swap", "lora_path": str(server.adapters["hot"])}
    assert httpx.post(f"{url}/load_lora_adapter", json=body, headers=server.headers).is_success
    assert answer() == offline.text("hot", prompt, 6)
    body["lora_path"] = str(server.adapters["chat"])
    _error(httpx.post(f"{url}/load_lora_adapter", json=body, headers=server.headers), 400)
    r = httpx.post(
        f"{url}/load_lora_adapter", json={**body, "replace": True}, headers=server.headers
    )
    assert r.status_code == 200 and "replaced" in r.text, r.text
    assert answer() == offline.text("chat", prompt, 6)  # the same prompt: no cached page reused
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "swap"}, headers=server.headers)
    assert r.status_code == 200


def test_unload_unknown_is_404(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=server.headers
    )
    _error(r, 404)


def test_api_key(server: Server) -> None:
    from openai import OpenAI

    for key in ("wrong", ""):
        client = OpenAI(base_url=f"{server.url}/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "sql", "prompt": "hi"})
    _error(r, 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_server_still_serves_after_errors(server: Server, offline: Offline) -> None:
    resp = server.client().completions.create(
        model="sql", prompt=PROMPTS[7], max_tokens=8, temperature=0
    )
    assert resp.choices[0].text == offline.text("sql", PROMPTS[7], 8)
    assert httpx.get(f"{server.url}/health").status_code == 200
