"""Deterministic inference on the GPU in bf16 (EngineConfig.enable_deterministic_inference,
issue 42): a request's tokens and logprob bits are those it gets alone, whatever shares its
steps (batches of 8 to 250 mixed requests), however its prompt is chunked, whether its prefix
came from the cache, with async scheduling on or off, replayed in graphs or eager; on the
Qwen3-MoE fixture, and in batches on the other test architectures; and run to run.

Skipped without CUDA; run on the device by scripts/gpu-check.
"""

import dataclasses
import random

import hf_fixtures as hf
import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.models.shapes import shape_config, write_config_folder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_ADAPTERS = 4
SHAPE = dict(
    hidden_size=256,
    head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=16,
    moe_intermediate_size=128,
    max_position_embeddings=1024,  # prompts of up to 600 tokens and their outputs
)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
RANKS = (8, 16, 32, 64)
NAMES = [None, *(f"a{i}" for i in range(NUM_ADAPTERS))]  # the base and every adapter


def _adapters(model, root, arch: str) -> dict[str, str]:
    """NUM_ADAPTERS adapters of ranks 8 to 64 on the attention and every expert (Qwen2-MoE:
    its shared expert and dense layer too); GPT-OSS's experts by PEFT target_parameters."""
    out = {}
    for i, rank in enumerate(RANKS):
        path, seed = root / f"a{i}", 200 + i
        if arch == "gpt_oss":
            made = hf.make_peft_adapter(
                model,
                path,
                targets=list(ATTENTION),
                target_parameters=hf.EXPERT_PARAMS,
                seed=seed,
                rank=rank,
                alpha=2 * rank,
            )
        else:
            made = hf.make_per_expert_adapter(
                model, path, seed=seed, rank=rank, alpha=2 * rank, arch=arch, attention=ATTENTION
            )
        out[f"a{i}"] = str(made)
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The Qwen3-MoE fixture at SHAPE: every test but the architectures' runs on it."""
    root = tmp_path_factory.mktemp("gpu-determinism")
    model = hf.make_model("qwen3_moe", root / "model", seed=7, **SHAPE)
    return str(model), _adapters(model, root, "qwen3_moe")


@pytest.fixture(scope="module", params=["mixtral", "olmoe", "qwen2_moe", "gpt_oss"])
def arch_assets(request, tmp_path_factory):
    """The other test architectures at their tiny fixture sizes (hidden 64), prompts of up to
    600 tokens."""
    root = tmp_path_factory.mktemp(f"gpu-determinism-{request.param}")
    model = hf.make_model(request.param, root / "model", seed=7, max_position_embeddings=1024)
    return str(model), _adapters(model, root, request.param)


def _llm(assets, **kw) -> LLM:
    model, adapters = assets
    options = dict(
        lora_modules=adapters,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=64,
        dtype="bfloat16",
        max_graph_bs=256,
        max_num_seqs=256,
        num_pages=4096,
        enable_deterministic_inference=True,
    )
    return LLM(model, **(options | kw))


def _requests(seed: int, n: int) -> tuple[list[list[int]], list]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(16, 600))] for _ in range(n)]
    return prompts, [rng.choice(NAMES) for _ in range(n)]


def _bits(out) -> tuple:
    """Tokens and each chosen token's logprob, exactly."""
    return tuple(out.token_ids), tuple(lp[t] for lp, t in zip(out.logprobs, out.token_ids))


def test_the_same_engine_built_again_gives_the_same_bits(assets):
    """Run to run: three engines of one config, one after another in this process (this test
    comes first in the file, so its first engine is the process's first), the same 24 requests:
    the same bits (two engines of one config have given one logprob a float32 ulp apart, tokens
    equal). A failure lists, at each differing request's first
    differing step, the top-8 entries whose logprobs differ: all of them when the log-softmax's
    normalizer moved, one when only that token's logit did."""
    prompts, loras = _requests(3, 24)
    top = dataclasses.replace(PARAMS, logprobs=8)
    runs = []
    for _ in range(3):
        llm = _llm(assets, max_num_batched_tokens=2048, enable_prefix_caching=False)
        runs.append(llm.generate(prompts, top, lora=loras))
        llm.close()
    want = [_bits(o) for o in runs[-1]]
    report = {}
    for n, outs in enumerate(runs[:-1]):
        for request, step, lora in _differences([_bits(o) for o in outs], want, loras):
            got, ref = outs[request].logprobs[step], runs[-1][request].logprobs[step]
            moved = {t: (float(got[t]).hex(), float(ref.get(t, 0.0)).hex()) for t in got}
            moved = {t: pair for t, pair in moved.items() if pair[0] != pair[1]}
            report.setdefault(n, []).append((request, step, lora, moved))
    assert not report, report  # run: [(request, step, adapter, {token: (got, want)})]


def _probes_in_batches(llm: LLM) -> dict[int, list]:
    """6 probes alone, then each inside batches of 8, 48, 136 and 250 random mixed requests
    (prompts of 16 to 600 tokens: prefill chunks and decode batches of every size; prefix
    caching on, so the batched runs also hit the pages the runs alone left): each batch size's
    differing probes."""
    probes, probe_loras = _requests(1, 6)
    alone = [_bits(llm.generate([p], PARAMS, lora=[lo])[0]) for p, lo in zip(probes, probe_loras)]
    report = {}
    for size in (8, 48, 136, 250):
        others, other_loras = _requests(size, size - len(probes))
        outs = llm.generate(probes + others, PARAMS, lora=probe_loras + other_loras)
        got = [_bits(o) for o in outs[: len(probes)]]
        report[size] = _differences(got, alone, probe_loras)
    llm.close()
    return report


def test_probes_alone_equal_probes_in_batches_of_8_to_250(assets):
    report = _probes_in_batches(_llm(assets, max_num_batched_tokens=2048))
    assert all(not d for d in report.values()), report  # (probe, first differing step, adapter)


def test_every_architecture_keeps_its_probes_bits_in_batches(arch_assets):
    """Mixtral, OLMoE (its full-width q/k norm), Qwen2-MoE (shared expert, a dense layer,
    q/k/v biases) and GPT-OSS (sinks, sliding windows, biases, experts by target_parameters),
    mixed adapters: the probes' test."""
    report = _probes_in_batches(_llm(arch_assets, max_num_batched_tokens=2048))
    assert all(not d for d in report.values()), (arch_assets[0], report)


def test_chunked_async_eager_and_cached_equal_whole(assets):
    """The same 24 requests whole (a budget of 2048 tokens), chunked at 512, with async
    scheduling off, eager (no graphs), and as prefix-cache hits: the same bits."""
    prompts, loras = _requests(3, 24)
    whole = _llm(assets, max_num_batched_tokens=2048, enable_prefix_caching=False)
    want = [_bits(o) for o in whole.generate(prompts, PARAMS, lora=loras)]
    whole.close()
    variants = {
        "chunked at 512": dict(max_num_batched_tokens=512, enable_prefix_caching=False),
        "async off": dict(async_scheduling=False, enable_prefix_caching=False),
        "eager": dict(enforce_eager=True, enable_prefix_caching=False),
    }
    found = {}
    for what, kw in variants.items():
        llm = _llm(assets, **({"max_num_batched_tokens": 2048} | kw))
        found[what] = [_bits(o) for o in llm.generate(prompts, PARAMS, lora=loras)]
        llm.close()
    cached = _llm(assets, max_num_batched_tokens=2048)
    cached.generate(prompts, SamplingParams(max_tokens=1), lora=loras)  # their prefixes cached
    hits = cached.generate(prompts, PARAMS, lora=loras)
    assert all(o.num_cached_tokens >= 16 for o in hits)
    found["cache hits"] = [_bits(o) for o in hits]
    # every variant's count, and each differing request's first differing output step and
    # adapter, in one message: which step kind and adapter the bits part at
    report = {what: _differences(got, want, loras) for what, got in found.items()}
    assert all(not d for d in report.values()), report


def _differences(got: list, want: list, loras: list) -> list[tuple[int, int, str]]:
    """(request, first output step whose token or logprob differs, its adapter)."""
    out = []
    for n, ((tokens, lps), (want_tokens, want_lps)) in enumerate(zip(got, want)):
        steps = [
            i
            for i, pair in enumerate(zip(zip(tokens, lps), zip(want_tokens, want_lps)))
            if pair[0] != pair[1]
        ]
        if steps or len(tokens) != len(want_tokens):
            out.append((n, steps[0] if steps else len(tokens), str(loras[n])))
    return out


def test_logits_rows_do_not_follow_the_rows_beside_them(assets):
    """The lm_head of a deterministic engine: a row's logits bits alone and among 3, 37 and 200
    rows (cuBLAS's kernel follows the row count; the batch-invariant linear does not)."""
    llm = _llm(assets, max_num_batched_tokens=2048)
    model = llm.engine.model
    gen = torch.Generator(device="cuda").manual_seed(4)
    hidden = torch.randn(200, model.cfg.hidden_size, generator=gen, device="cuda")
    hidden = hidden.to(torch.bfloat16)
    with torch.inference_mode():
        alone = model.compute_logits(hidden[:1])
        for rows in (3, 37, 200):
            assert torch.equal(model.compute_logits(hidden[:rows])[:1], alone), rows
    llm.close()


# -- the Qwen3-30B-A3B shape (its widths, 128 experts top-8, 2 layers, dummy weights) --


@pytest.fixture(scope="module")
def shape_folder(tmp_path_factory) -> str:
    config = shape_config("qwen3-30b-a3b", num_layers=2)
    return str(write_config_folder(config, tmp_path_factory.mktemp("gpu-determinism-shape")))


def _shape_llm(folder: str, **kw) -> LLM:
    """The shape with NUM_ADAPTERS random adapters of RANKS on every projection and expert."""
    options = dict(
        load_format="dummy",
        max_loras=NUM_ADAPTERS,
        max_lora_rank=64,
        dtype="bfloat16",
        max_graph_bs=256,
        max_num_seqs=256,
        max_model_len=8192 + 64,
        num_pages=16384,
        enable_deterministic_inference=True,
    )
    llm = LLM(folder, **(options | kw))
    for i, rank in enumerate(RANKS):
        llm.add_random_lora(f"a{i}", rank=rank, seed=300 + i)
    return llm


def test_the_shape_keeps_its_probes_bits_in_batches(shape_folder):
    llm = _shape_llm(shape_folder, max_num_batched_tokens=2048)
    report = _probes_in_batches(llm)
    assert all(not d for d in report.values()), report


def test_the_shape_chunked_at_512_and_2048_equals_whole_up_to_8k_tokens(shape_folder):
    """12 prompts of 16 to 8192 tokens, mixed adapters: steps of 512 and 2048 tokens against
    every prompt whole in its first step (a budget of 16384 tokens)."""
    rng = random.Random(5)
    lengths = [8192, 4097, 16, *(rng.randint(16, 8192) for _ in range(9))]
    prompts = [[rng.randrange(1, 30000) for _ in range(n)] for n in lengths]
    loras = [rng.choice(NAMES) for _ in prompts]
    found = {}
    for budget in (16384, 2048, 512):
        llm = _shape_llm(shape_folder, max_num_batched_tokens=budget, enable_prefix_caching=False)
        found[budget] = [_bits(o) for o in llm.generate(prompts, PARAMS, lora=loras)]
        llm.close()
    report = {b: _differences(found[b], found[16384], loras) for b in (2048, 512)}
    assert all(not d for d in report.values()), report


def test_the_shape_cache_hits_equal_misses_on_200_requests(shape_folder):
    """200 random requests on 10 shared prefixes of 40 to 200 tokens (each plus 1 to 30
    tokens of its own), mixed adapters, all at once: as prefix-cache hits (the prefixes
    cached first, under each adapter) against an engine without the cache."""
    rng = random.Random(6)
    prefixes = [[rng.randrange(1, 30000) for _ in range(rng.randint(40, 200))] for _ in range(10)]
    prompts, loras = [], []
    for _ in range(200):
        own = [rng.randrange(1, 30000) for _ in range(rng.randint(1, 30))]
        prompts.append(rng.choice(prefixes) + own)
        loras.append(rng.choice(NAMES))
    misses = _shape_llm(shape_folder, max_num_batched_tokens=2048, enable_prefix_caching=False)
    want = [_bits(o) for o in misses.generate(prompts, PARAMS, lora=loras)]
    misses.close()
    hits = _shape_llm(shape_folder, max_num_batched_tokens=2048)
    warm = [p for p in prefixes for _ in NAMES]
    hits.generate(warm, SamplingParams(max_tokens=1), lora=[n for _ in prefixes for n in NAMES])
    outs = hits.generate(prompts, PARAMS, lora=loras)
    assert sum(o.num_cached_tokens >= 32 for o in outs) >= 150  # most of them are hits
    report = _differences([_bits(o) for o in outs], want, loras)
    assert not report, report
