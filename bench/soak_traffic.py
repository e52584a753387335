"""The soak's traffic (bench/soak.py): what each client sends, and how each answer is counted.

A client draws request kinds from its own seeded random.Random until the deadline; one more
client loads, unloads and reloads an adapter beside them, and one reads /metrics. Each answer
is counted by kind and class: 2xx, 4xx expected (the 4xx a bad input must get; a 409 to an
unload while the adapter's requests run; a 404 to a request that raced its adapter's unload),
4xx unexpected, 5xx, cancelled (an abort or a disconnect of ours), error (no HTTP answer). What
the verdict fails on is also written to `problems`, with a first example of each.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

KINDS = ("completion", "chat", "stream", "abort", "disconnect", "structured", "prefix", "bad")
WEIGHTS = (14, 14, 14, 8, 8, 16, 16, 10)  # bad: ~10% of the requests
WORDS = (
    "the a of to and in expert adapter token batch cache page model route layer query table "
    "select where group order limit user name value count cat story paris rome capital river "
    "light stone green quick brown fox jumps over lazy dog mixture rank serve stream"
).split()
CITIES = ["Paris", "Rome", "Oslo"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": CITIES}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}@[a-z]{1,8}\.com"
CHOICES = ["yes", "no", "maybe"]


@dataclass(frozen=True)
class Profile:
    """The sizes of one setup's traffic."""

    concurrency: int  # clients, each one request at a time
    max_tokens: tuple[int, int]  # of an ordinary request, drawn uniformly
    long_tokens: int  # of an aborted or disconnected one (ignore_eos): still running when cut
    disconnect_after: float  # s before a disconnecting client closes its connection
    prefix_words: int  # of each shared document
    warmup: float  # s of the same traffic before the baseline is read
    hot_hold: float  # s the hot adapter stays loaded between unloads
    hot_gap: float  # s it stays unloaded
    scrape_every: float  # s between /metrics samples during the load
    idle_timeout: float  # s the server has to become idle after the traffic stops
    request_timeout: float  # s without an answer before a request counts as an error


@dataclass
class Hot:
    """The adapter loaded, unloaded and reloaded (from the same folder) under traffic."""

    name: str
    path: str
    loaded: bool = False
    draining: bool = False  # an unload is under way (or was refused, 409): no new request picks it
    unloads_begun: int = 0  # a request sent before an unload began may get 404: expected
    ever_loaded: bool = False


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, class) -> answers
    events: Counter = field(default_factory=Counter)  # abort, disconnect, load, reload, ...
    latency: defaultdict = field(default_factory=lambda: defaultdict(list))  # kind -> s (2xx)
    ttft: list[float] = field(default_factory=list)  # s, of streams read to [DONE]
    problems: Counter = field(default_factory=Counter)  # what fails the verdict -> times
    examples: dict[str, str] = field(default_factory=dict)  # a problem -> its first detail

    def problem(self, what: str, detail: str) -> None:
        self.problems[what] += 1
        self.examples.setdefault(what, detail[:300])

    def sent(self, kind: str) -> int:
        return sum(n for (k, _), n in self.outcomes.items() if k == kind)


@dataclass
class Traffic:
    client: httpx.AsyncClient
    profile: Profile
    base: str
    adapters: list[str]  # served from the start
    hot: Hot
    docs: list[str]  # the shared prefixes
    deadline: float
    tally: Tally
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class Bad:
    """A bad input and the status it must get."""

    name: str
    path: str
    body: dict | bytes
    expected: int
    headers: dict[str, str] = field(default_factory=dict)


def bad_inputs(base: str) -> list[Bad]:
    one = {"model": base, "prompt": "x", "max_tokens": 4}
    chat = {"model": base, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no"}}}
    two_constraints = {"guided_regex": "a", "guided_choice": ["a"]}
    return [
        Bad("bad JSON", "/v1/completions", b'{"model": "x", "prompt": ', 400),
        Bad("unknown model", "/v1/completions", {**one, "model": "no-such-model"}, 404),
        Bad("max_tokens too large", "/v1/completions", {**one, "max_tokens": 10**7}, 400),
        Bad("bad schema", "/v1/chat/completions", {**chat, "response_format": bad_schema}, 400),
        Bad(
            "unknown role",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "wizard", "content": "x"}]},
            400,
        ),
        Bad("string max_tokens", "/v1/completions", {**one, "max_tokens": "16"}, 400),
        Bad("negative temperature", "/v1/completions", {**one, "temperature": -1}, 400),
        Bad("empty prompt", "/v1/completions", {**one, "prompt": ""}, 400),
        Bad("prompt too long", "/v1/completions", {**one, "prompt": "x " * 150_000}, 400),
        Bad("token id out of range", "/v1/completions", {**one, "prompt": [10**9]}, 400),
        Bad("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}', 400),
        Bad("bad regex", "/v1/completions", {**one, "structured_outputs": {"regex": "(["}}, 400),
        Bad("two constraints", "/v1/completions", {**one, **two_constraints}, 400),
        Bad("no messages", "/v1/chat/completions", {**chat, "messages": []}, 400),
        Bad("n = 0", "/v1/completions", {**one, "n": 0}, 400),
        Bad("wrong API key", "/v1/completions", one, 401, {"Authorization": "Bearer wrong"}),
        Bad("text/plain body", "/v1/completions", b"{}", 415, {"Content-Type": "text/plain"}),
        Bad("unload unknown", "/v1/unload_lora_adapter", {"lora_name": "no-such-adapter"}, 404),
        Bad("load missing", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/x"}, 400),
    ]


# ---- the clients ------------------------------------------------------------------------


async def run(traffic: Traffic, seed: int) -> None:
    """Every client until the deadline, the adapter cycle and the /metrics sampler beside them."""
    rngs = [random.Random(seed * 1000 + i) for i in range(traffic.profile.concurrency)]
    bad = bad_inputs(traffic.base)
    await asyncio.gather(
        *(client_loop(traffic, rng, bad) for rng in rngs),
        adapter_cycle(traffic),
        sampler(traffic),
    )


async def client_loop(t: Traffic, rng: random.Random, bad: list[Bad]) -> None:
    while time.monotonic() < t.deadline:
        kind = rng.choices(KINDS, weights=WEIGHTS)[0]
        try:
            if kind == "bad":
                await send_bad(t, rng.choice(bad))
            else:
                await SENDERS[kind](t, rng)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            t.tally.outcomes[kind, "error"] += 1
            t.tally.problem(f"{kind}: no HTTP answer ({type(e).__name__})", repr(e))
            await asyncio.sleep(0.5)  # a server that is gone is not hammered


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def pick_model(t: Traffic, rng: random.Random) -> tuple[str, int | None]:
    """(model, unloads begun when sent: set for the hot adapter only). The draw does not depend
    on whether the hot adapter is loaded: the base model stands in for it when it is not."""
    model = rng.choice([t.base, *t.adapters, t.hot.name])
    if model == t.hot.name:
        if not t.hot.loaded or t.hot.draining:
            return t.base, None
        return model, t.hot.unloads_begun
    return model, None


def body_for(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of a completion or a chat, half each."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8])}
    common["seed"] = rng.randrange(1 << 16)
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": words(rng, 3, 30)}
    messages = [{"role": "user", "content": words(rng, 3, 30)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": words(rng, 3, 10)})
    return "/v1/chat/completions", {**common, "messages": messages}


def classify(t: Traffic, kind: str, r: httpx.Response, hot_sent: int | None) -> str:
    status = r.status_code
    if status < 300:
        cls = "2xx"
    elif status == 404 and hot_sent is not None and t.hot.unloads_begun != hot_sent:
        t.tally.events["hot adapter 404 (raced its unload)"] += 1
        cls = "4xx expected"
    elif status < 500:
        cls = "4xx unexpected"
        t.tally.problem(f"{kind}: unexpected {status}", r.text)
    else:
        cls = "5xx"
        t.tally.problem(f"{kind}: {status}", r.text)
    t.tally.outcomes[kind, cls] += 1
    return cls


async def send_whole(
    t: Traffic,
    kind: str,
    path: str,
    body: dict,
    hot_sent: int | None,
    check: Callable[[dict], None] | None = None,
) -> None:
    if body["model"] != t.base:
        t.tally.events["adapter requests"] += 1
    start = time.monotonic()
    r = await t.client.post(path, json=body)
    if classify(t, kind, r, hot_sent) == "2xx":
        t.tally.latency[kind].append(time.monotonic() - start)
        if check is not None:
            check(r.json())


async def send_stream(
    t: Traffic, kind: str, path: str, body: dict, hot_sent: int | None, close_after: int = 0
) -> None:
    """Read SSE to [DONE]; with close_after, close the connection after that many chunks."""
    if body["model"] != t.base:
        t.tally.events["adapter requests"] += 1
    body = {**body, "stream": True}
    start, first, chunks = time.monotonic(), None, 0
    async with t.client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            classify(t, kind, r, hot_sent)
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                t.tally.outcomes[kind, "2xx"] += 1
                t.tally.latency[kind].append(time.monotonic() - start)
                t.tally.ttft.append(first if first is not None else time.monotonic() - start)
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                t.tally.outcomes[kind, "5xx"] += 1
                t.tally.problem(f"{kind}: an error event mid-stream", line)
                return
            if first is None and any(_text(c) for c in chunk.get("choices", [])):
                first = time.monotonic() - start
            chunks += 1
            if close_after and chunks >= close_after:
                t.tally.outcomes[kind, "cancelled"] += 1
                t.tally.events["abort"] += 1
                return  # leaving the block closes the connection mid-stream
    t.tally.outcomes[kind, "5xx"] += 1
    t.tally.problem(f"{kind}: the stream ended without [DONE]", json.dumps(body)[:200])


def _text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


# ---- the kinds ----------------------------------------------------------------------------


async def completion(t: Traffic, rng: random.Random) -> None:
    model, hot_sent = pick_model(t, rng)
    body = {
        "model": model,
        "prompt": words(rng, 3, 30),
        "max_tokens": rng.randint(*t.profile.max_tokens),
    }
    body["temperature"], body["seed"] = rng.choice([0.0, 0.8]), rng.randrange(1 << 16)
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.2:
        body["logprobs"] = 2
    await send_whole(t, "completion", "/v1/completions", body, hot_sent)


async def chat(t: Traffic, rng: random.Random) -> None:
    model, hot_sent = pick_model(t, rng)
    messages = [{"role": "user", "content": words(rng, 3, 30)}]
    body = {"model": model, "messages": messages, "max_tokens": rng.randint(*t.profile.max_tokens)}
    if rng.random() < 0.2:
        body["logprobs"], body["top_logprobs"] = True, 2
    await send_whole(t, "chat", "/v1/chat/completions", body, hot_sent)


async def stream(t: Traffic, rng: random.Random) -> None:
    model, hot_sent = pick_model(t, rng)
    path, body = body_for(rng, model, rng.randint(*t.profile.max_tokens))
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    await send_stream(t, "stream", path, body, hot_sent)


async def abort(t: Traffic, rng: random.Random) -> None:
    """A stream the client closes after 1 to 4 chunks, its request still running."""
    model, hot_sent = pick_model(t, rng)
    path, body = body_for(rng, model, t.profile.long_tokens)
    body["ignore_eos"] = True
    await send_stream(t, "abort", path, body, hot_sent, close_after=rng.randint(1, 4))


async def disconnect(t: Traffic, rng: random.Random) -> None:
    """A non-streamed request whose client closes the connection before the answer comes."""
    model, hot_sent = pick_model(t, rng)
    path, body = body_for(rng, model, t.profile.long_tokens)
    body["ignore_eos"] = True
    if model != t.base:
        t.tally.events["adapter requests"] += 1
    try:
        r = await asyncio.wait_for(t.client.post(path, json=body), t.profile.disconnect_after)
    except asyncio.TimeoutError:  # the cancelled request's connection is closed, not reused
        t.tally.outcomes["disconnect", "cancelled"] += 1
        t.tally.events["disconnect"] += 1
        return
    classify(t, "disconnect", r, hot_sent)


async def structured(t: Traffic, rng: random.Random) -> None:
    """A JSON schema (response_format), a regex or a choice; a finished answer must obey it."""
    model, hot_sent = pick_model(t, rng)
    spec = rng.choice(["json", "regex", "choice"])
    path, body = body_for(rng, model, 48)
    if spec == "json":
        schema = {"name": "weather", "schema": SCHEMA}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        body["structured_outputs"] = {"regex": REGEX} if spec == "regex" else {"choice": CHOICES}

    def check(answer: dict) -> None:
        for choice in answer["choices"]:
            text = choice.get("text", (choice.get("message") or {}).get("content"))
            if choice["finish_reason"] == "stop":
                t.tally.events["structured answers checked"] += 1
                if not obeys(spec, text or ""):
                    t.tally.problem(f"structured: an answer off its {spec}", repr(text))

    await send_whole(t, "structured", path, body, hot_sent, check)


def obeys(spec: str, text: str) -> bool:
    if spec == "regex":
        return re.fullmatch(REGEX, text) is not None
    if spec == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"city", "sunny"}
        and value["city"] in CITIES
        and isinstance(value["sunny"], bool)
    )


async def prefix(t: Traffic, rng: random.Random) -> None:
    """A prompt that begins with one of the long shared documents, streamed or not."""
    model, hot_sent = pick_model(t, rng)
    doc, question = rng.choice(t.docs), words(rng, 3, 8)
    common = {"model": model, "max_tokens": rng.randint(*t.profile.max_tokens), "temperature": 0.0}
    if rng.random() < 0.5:
        path, body = "/v1/completions", {**common, "prompt": f"{doc}\n{question}"}
    else:
        messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
        path, body = "/v1/chat/completions", {**common, "messages": messages}
    if rng.random() < 0.5:
        await send_stream(t, "prefix", path, body, hot_sent)
    else:
        await send_whole(t, "prefix", path, body, hot_sent)


async def send_bad(t: Traffic, bad: Bad) -> None:
    kw = {"content": bad.body} if isinstance(bad.body, bytes) else {"json": bad.body}
    r = await t.client.post(bad.path, headers=bad.headers, **kw)
    if r.status_code == bad.expected:
        t.tally.outcomes["bad", "4xx expected"] += 1
        return
    cls = "2xx" if r.status_code < 300 else "4xx unexpected" if r.status_code < 500 else "5xx"
    t.tally.outcomes["bad", cls] += 1
    t.tally.problem(f"bad input {bad.name!r}: {r.status_code}, expected {bad.expected}", r.text)


SENDERS: dict[str, Callable[[Traffic, random.Random], Awaitable[None]]] = {
    "completion": completion,
    "chat": chat,
    "stream": stream,
    "abort": abort,
    "disconnect": disconnect,
    "structured": structured,
    "prefix": prefix,
}


# ---- beside the clients -------------------------------------------------------------------


async def adapter_cycle(t: Traffic) -> None:
    """Load the hot adapter, let traffic use it, unload it (a 409 while its requests run, then
    again once they have drained), reload it from the same folder; it is loaded at the end."""
    hot, p = t.hot, t.profile
    while True:
        if not hot.loaded:
            await load_hot(t)
        if not await pause(t, p.hot_hold):
            return
        await unload_hot(t)
        if not await pause(t, p.hot_gap):
            if not hot.loaded:
                await load_hot(t)
            return


async def pause(t: Traffic, seconds: float) -> bool:
    """Sleep `seconds` or until the deadline; False once the deadline has passed."""
    await asyncio.sleep(max(0.0, min(seconds, t.deadline - time.monotonic())))
    return time.monotonic() < t.deadline


async def load_hot(t: Traffic) -> None:
    hot = t.hot
    body = {"lora_name": hot.name, "lora_path": hot.path}
    r = await t.client.post("/v1/load_lora_adapter", json=body)
    if classify(t, "adapter ops", r, None) == "2xx":
        t.tally.events["load"] += 1
        if hot.ever_loaded:  # from the same folder, after an unload
            t.tally.events["reload"] += 1
        hot.loaded = hot.ever_loaded = True


async def unload_hot(t: Traffic) -> None:
    hot = t.hot
    hot.unloads_begun += 1
    # no request picks it from here on: one picked while the unload is on its way would carry
    # this count, and its 404 would look unexpected
    hot.draining = True
    # its requests sent before the deadline, each answered within request_timeout
    give_up = max(t.deadline, time.monotonic()) + t.profile.request_timeout
    while True:
        r = await t.client.post("/v1/unload_lora_adapter", json={"lora_name": hot.name})
        if r.status_code != 409:
            break
        t.tally.outcomes["adapter ops", "4xx expected"] += 1
        t.tally.events["unload refused 409 (in use)"] += 1
        if time.monotonic() > give_up:
            t.tally.problem("unload: still 409 after its requests had time to drain", r.text)
            hot.draining = False
            return
        await asyncio.sleep(0.2)
    if classify(t, "adapter ops", r, None) == "2xx":
        t.tally.events["unload"] += 1
        hot.loaded = False
    hot.draining = False


async def sampler(t: Traffic) -> None:
    """/metrics every scrape_every seconds while the clients run (and /health, /v1/models)."""
    start = time.monotonic()
    while await pause(t, t.profile.scrape_every):
        for path in ("/health", "/v1/models"):
            await get(t.client, path, t.tally)
        t.samples.append((time.monotonic() - start, await scrape(t.client, t.tally)))


async def get(client: httpx.AsyncClient, path: str, tally: Tally) -> httpx.Response | None:
    """GET path; anything but a 200 is a problem (None: no HTTP answer)."""
    try:
        r = await client.get(path)
    except httpx.HTTPError as e:
        tally.problem(f"{path}: no HTTP answer ({type(e).__name__})", repr(e))
        return None
    if r.status_code != 200:
        tally.problem(f"{path}: {r.status_code}", r.text)
    return r


async def scrape(client: httpx.AsyncClient, tally: Tally) -> dict[str, float]:
    """/metrics' samples by name with labels, e.g. 'x{model="sql"}' ({}: no answer)."""
    r = await get(client, "/metrics", tally)
    if r is None or r.status_code != 200:
        return {}
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
