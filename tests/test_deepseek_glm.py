"""DeepSeek-V2, DeepSeek-V3 and GLM-4.5 against transformers(+PEFT), fp32 on the CPU: greedy
tokens equal, logprobs within 1e-4 (models and adapters: mla_fixtures.py). Then what their
parts must keep: the grouped routing equals transformers' routers, the MLA reference equals
attention over the expanded keys and values, the latent cache holds 576 values a token for V3,
chunked prefill, prefix-cache hits and preemption change nothing, MTP layers are skipped at
load, the GPU kernel table and several ranks refuse them, and so does the config reading what
is not served, naming the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import mla_fixtures as mf
import pytest
import torch
from family_fixtures import FamilyFixtures, assert_not_degenerate, assert_same, run_greedy
from safetensors.torch import load_file, save_file
from test_vs_transformers import assert_matches

from moelora import LLM

if TYPE_CHECKING:
    from conftest import FixtureBank

MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> FamilyFixtures:
    return FamilyFixtures(
        tmp_path_factory.mktemp("deepseek_glm"),
        mf,
        request.config.getoption("--moelora-device"),
        max_loras=2,
        max_lora_rank=MAX_LORA_RANK,
    )


def _assert_same(got, want) -> None:
    assert_same(got, want, 1e-5)


# ---------------------------------------------------------------------------------------------
# The engine against transformers(+PEFT)


@pytest.mark.parametrize("arch", mf.ARCHS)
def test_references_are_not_degenerate(bank: FixtureBank, fx: FamilyFixtures, arch: str) -> None:
    """Each adapter changes the greedy tokens; no near ties that would make greedy fragile."""
    assert_not_degenerate(bank, fx, arch)


@pytest.mark.parametrize(
    "loras",
    [[None] * 5, ["a"] * 5, ["b"] * 5, ["a", None, "b", "a", None]],
    ids=["base", "a", "b", "mixed"],
)
@pytest.mark.parametrize("arch", mf.ARCHS)
def test_equals_transformers(
    bank: FixtureBank, fx: FamilyFixtures, arch: str, loras: list[str | None]
) -> None:
    refs = fx.reference(bank, arch, loras)
    assert_matches(bank, run_greedy(fx.llm(arch), loras), refs, hf.PROMPTS, f"{arch} {loras}")


@pytest.mark.parametrize("arch", mf.ARCHS)
def test_the_adapters_cover_every_target(fx: FamilyFixtures, arch: str) -> None:
    """Between them the two adapters put a non-zero B on every target of the model (for
    DeepSeek each MLA projection, q_a_proj and kv_a_proj_with_mqa as qkv's slices), the dense
    MLP, the shared experts and the experts; a alone on every attention projection."""

    targets = fx.llm(arch).engine.lora_targets
    kinds = {key.split(".", 2)[2] for key in targets}
    mla = {"q_b", "kv_b"} if arch == "deepseek_v3" else {"kv_b"} if arch == "deepseek_v2" else set()
    assert kinds == {
        "qkv",
        "o",
        "mlp.gate_up",
        "mlp.down",
        "shared.gate_up",
        "shared.down",
        "experts13",
        "experts2",
        *mla,
    }
    covered = fx.covered(arch, targets, MAX_LORA_RANK)
    assert covered["a"] | covered["b"] == set(targets)
    attention = {k for k in targets if k.split(".", 2)[2] in {"qkv", "o", *mla}}
    assert attention <= covered["a"]


@pytest.mark.parametrize("arch", mf.ARCHS)
def test_chunked_prefill_and_preemption(bank: FixtureBank, fx: FamilyFixtures, arch: str) -> None:
    """4-token prefill chunks (extends that read the cached latent), and a cache of 10 pages of
    4 tokens that must preempt and recompute: the unchunked run's tokens and logprobs, and
    transformers'."""
    loras = ["a", None, "b", "a", None]
    refs = fx.reference(bank, arch, loras)
    whole = run_greedy(fx.llm(arch), loras)
    chunked = run_greedy(fx.llm(arch, max_num_batched_tokens=4), loras)
    _assert_same(chunked, whole)
    assert_matches(bank, chunked, refs, hf.PROMPTS, f"{arch} chunked")
    tight = fx.llm(arch, page_size=4, num_pages=10)
    preempted = run_greedy(tight, loras)
    _assert_same(preempted, whole)
    assert_matches(bank, preempted, refs, hf.PROMPTS, f"{arch} preempted")
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.stats().kv_pages_used == 0


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_expanded_prefill(
    bank: FixtureBank, fx: FamilyFixtures, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mla_prefill="expanded": prompts' first chunks attend to their own expanded keys and
    values (kernels/mla.expanded_attention_, called), later chunks and decode rows absorbed;
    whole and in 4-token chunks, the latent form's tokens and logprobs, and transformers'.
    Then with every extend expanded (layers/mla.expands made true: at these sizes few are
    worth it), each chunk's whole KV read back from the cache, and on a prefix-cache hit."""
    from moelora.kernels import mla
    from moelora.kernels.attention import mla_expanded
    from moelora.layers import mla as mla_layer

    calls = []

    def counting(module):
        def counted(*args, **kwargs):
            calls.append(1)
            return expanded_attention_(*args, **kwargs)

        expanded_attention_ = module.expanded_attention_
        monkeypatch.setattr(module, "expanded_attention_", counted)

    counting(mla)  # the reference's (CPU), the Triton kernel's (GPU)
    counting(mla_expanded)
    loras = ["a", None, "b", "a", None]
    refs = fx.reference(bank, arch, loras)
    latent = run_greedy(fx.llm(arch, mla_prefill="absorbed"), loras)
    assert not calls
    expanded = run_greedy(fx.llm(arch, mla_prefill="expanded"), loras)
    assert calls
    chunked = run_greedy(fx.llm(arch, mla_prefill="expanded", max_num_batched_tokens=4), loras)
    monkeypatch.setattr(mla_layer, "expands", lambda prefix, tokens, cfg: True)
    extends = run_greedy(fx.llm(arch, mla_prefill="expanded", max_num_batched_tokens=4), loras)
    cases = ((expanded, "expanded"), (chunked, "expanded, chunked"), (extends, "extends"))
    for got, what in cases:
        _assert_same(got, latent)
        assert_matches(bank, got, refs, hf.PROMPTS, f"{arch} {what}")
    shared = [(7 * i + 3) % 200 + 1 for i in range(37)]
    prompts = [shared + [11, 12, 13], shared + [50]]
    llm = fx.llm(arch, page_size=16, mla_prefill="expanded")
    miss = run_greedy(llm, ["a", "b"], prompts, max_tokens=4)
    hit = run_greedy(llm, ["a", "b"], prompts, max_tokens=4)
    assert [o.num_cached_tokens for o in hit] == [32, 32]
    _assert_same(hit, miss)


def test_the_expanded_form_is_taken_where_it_is_less_work() -> None:
    """layers/mla.expands at Moonlight's sizes: a long extend expands, a short one after a
    long prefix does not."""
    from moelora.config import MlaConfig
    from moelora.layers.mla import expands

    dims = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cfg = MlaConfig(q_lora_rank=0, softmax_scale=0.1, rope_interleave=False, **dims)
    assert expands(4096, 4096, cfg) and expands(64, 300, cfg)
    assert not expands(8192, 16, cfg) and not expands(16384, 128, cfg)


@pytest.mark.parametrize(
    "arch,mla_prefill",
    [*((arch, "absorbed") for arch in mf.ARCHS), ("deepseek_v3", "expanded")],
)
def test_a_prefix_cache_hit_equals_a_miss(
    bank: FixtureBank, fx: FamilyFixtures, arch: str, mla_prefill: str
) -> None:
    """A miss prefills each prompt from position 0 (with mla_prefill="expanded", in the
    expanded form); a hit extends the cached pages (the latent form): the same tokens and
    logprobs, and transformers'."""
    shared = [(7 * i + 3) % 200 + 1 for i in range(37)]
    prompts = [shared + [11, 12, 13], shared + [50], shared + [90, 91]]
    loras = ["a", None, "b"]
    llm = fx.llm(arch, page_size=16, mla_prefill=mla_prefill)
    miss = run_greedy(llm, loras, prompts, max_tokens=4)
    assert [o.num_cached_tokens for o in miss] == [0, 0, 0]
    hit = run_greedy(llm, loras, prompts, max_tokens=4)
    assert [o.num_cached_tokens for o in hit] == [32, 32, 32]  # 2 pages of 16 latents each
    _assert_same(hit, miss)
    refs = fx.reference(bank, arch, loras, prompts=prompts, max_tokens=4)
    assert_matches(bank, hit, refs, prompts, f"{arch} prefix-cache hit")


def test_mtp_layers_are_skipped_at_load(
    bank: FixtureBank, fx: FamilyFixtures, tmp_path: Path
) -> None:
    """A checkpoint with the multi-token-prediction layer after the decoder's (layer 3 here,
    as DeepSeek-V3's layer 61) loads, and serves as the checkpoint without it does."""
    arch = "deepseek_v3"
    model = fx.model(arch)
    folder = tmp_path / "with-mtp"
    folder.mkdir()
    for f in model.iterdir():
        if not f.name.startswith("model"):
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(model / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    mtp = {
        "model.layers.3.eh_proj.weight": (64, 128),
        "model.layers.3.enorm.weight": (64,),
        "model.layers.3.self_attn.kv_b_proj.weight": (112, 32),
        "model.layers.3.mlp.experts.0.gate_proj.weight": (24, 64),
    }
    for key, shape in mtp.items():
        tensors[key] = torch.randn(shape, generator=gen)
    save_file(tensors, folder / "model.safetensors")
    loras = [None, None, None]
    got = run_greedy(LLM(str(folder), device="cpu", dtype="float32", enable_lora=False), loras)
    assert_matches(bank, got, fx.reference(bank, arch, loras), hf.PROMPTS, "mtp layer skipped")


# ---------------------------------------------------------------------------------------------
# The parts


def _router(arch: str, topk_method: str):
    """transformers' router of the tiny `arch` (random weights and correction bias) and the
    ModelConfig moelora reads from its config."""
    import importlib

    import transformers

    from moelora.models.registry import ARCHITECTURES

    config_name, model_name = mf._CLASSES[arch]
    overrides = {"topk_method": topk_method} if arch == "deepseek_v2" else {}
    config = getattr(transformers, config_name)(
        **{**mf._COMMON, **mf._ARCH_CONFIG[arch], **overrides}
    )
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    router = getattr(modeling, config_name.replace("Config", "TopkRouter"))(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.3)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.2 * torch.randn(8, generator=gen))
    return router, ARCHITECTURES[model_name](config)


@pytest.mark.parametrize(
    "arch,topk_method",
    [
        ("deepseek_v2", "greedy"),
        ("deepseek_v2", "group_limited_greedy"),
        ("deepseek_v3", None),
        ("glm4_moe", None),
    ],
)
def test_grouped_routing_equals_transformers(arch: str, topk_method: str | None) -> None:
    """route_grouped on 200 random tokens picks transformers' router's experts, with its
    weights (routed_scaling_factor included)."""
    from moelora.kernels.grouped_routing import route_grouped

    router, mc = _router(arch, topk_method)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    weights, ids = route_grouped(
        logits,
        mc.top_k,
        mc.routing,
        scoring=mc.scoring,
        renormalize=mc.renormalize,
        correction_bias=getattr(router, "e_score_correction_bias", None),
    )
    got, want = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(
        weights.gather(1, got.indices), want_weights.gather(1, want.indices), rtol=1e-6, atol=0
    )
    if mc.routing.correction_bias:  # the bias moves some choices: the test sees it
        plain, _ = route_grouped(
            logits,
            mc.top_k,
            mc.routing,
            scoring=mc.scoring,
            renormalize=mc.renormalize,
            correction_bias=torch.zeros(8),
        )
        assert not torch.equal(plain, weights)


def _expanded_mla(q_nope, q_pe, c, k_pe, kv_b, scale, delta):
    """Textbook MLA for one sequence whose new tokens are its last: keys and values expanded
    from the latents c [K, L] (kv_b_proj plus the LoRA delta(c) [K, Hh (N + V)])."""
    T, Hh, N = q_nope.shape
    kv = (c @ kv_b.T + delta(c)).view(c.shape[0], Hh, -1)
    k = torch.cat([kv[..., :N], k_pe[:, None, :].expand(-1, Hh, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    K = c.shape[0]
    hidden = torch.arange(K)[None, :] > torch.arange(K - T, K)[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khv->qhv", probs, kv[..., N:])


def test_mla_reference_equals_attention_over_expanded_keys_and_values() -> None:
    """mla_attention (absorbed, kv_b_proj's LoRA in the latent space) against keys and values
    expanded through kv_b_proj with its LoRA, as transformers+PEFT computes them: an extend, a
    decode and a prefill over scattered pages of 4 tokens, with two adapters, a base row and a
    disabled slot, and padded rows."""
    from moelora.kernels.mla import mla_attention
    from moelora.step.batch import AttentionMetadata
    from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights

    gen = torch.Generator().manual_seed(21)
    Hh, N, R, V, L, r, S, ps = 4, 16, 8, 12, 32, 4, 3, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    kv_lens, q_lens, slots = [9, 5, 13], [3, 1, 13], [0, NO_SLOT, 2]
    pages = torch.randperm(16, generator=gen)[:12].view(3, 4).to(torch.int32)
    latent_cache, rope_cache = randn(16, ps, 1, L), randn(16, ps, 1, R)
    kv_b = randn(Hh * (N + V), L) / L**0.5
    lora = LoraWeights.dense(
        randn(S, 1, r, L) / L**0.5, randn(S, Hh * (N + V), r) * 0.3, (Hh * (N + V),)
    )
    T = sum(q_lens) + 2  # two padded rows
    slot_of_token = torch.tensor(
        [s for s, n in zip(slots, q_lens) for _ in range(n)] + [NO_SLOT] * 2, dtype=torch.int32
    )
    info = LoraBatchInfo(
        slot_of_token,
        torch.tensor([r, r, r], dtype=torch.int32),
        torch.tensor([0.5, 2.0, 1.5]),
        torch.tensor([1, 0, 1], dtype=torch.int32),  # slot 1 holds an adapter no row uses
    )
    cu = torch.tensor([0, 3, 4, 17], dtype=torch.int32)
    attn = AttentionMetadata(
        cu, torch.tensor(kv_lens, dtype=torch.int32), pages, torch.zeros(T, dtype=torch.int64), 13
    )
    q_nope, q_pe, scale = randn(T, Hh, N), randn(T, Hh, R), 0.17
    got = mla_attention(
        q_nope, q_pe, latent_cache, rope_cache, attn, kv_b, scale, lora=lora, info=info
    )
    for b, (kv_len, slot) in enumerate(zip(kv_lens, slots)):
        rows = slice(cu[b], cu[b + 1])
        c = latent_cache[pages[b].long()].flatten(0, 1)[:kv_len, 0]
        k_pe = rope_cache[pages[b].long()].flatten(0, 1)[:kv_len, 0]

        def delta(x, s=slot):
            if s == NO_SLOT:
                return torch.zeros(x.shape[0], Hh * (N + V))
            return info.scaling_of_slot[s] * (x @ lora.a[s, 0].T) @ lora.b[s].T

        want = _expanded_mla(q_nope[rows], q_pe[rows], c, k_pe, kv_b, scale, delta)
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[-2:], torch.zeros(2, Hh, V))
    base = mla_attention(q_nope, q_pe, latent_cache, rope_cache, attn, kv_b, scale)
    assert torch.equal(base[3:4], got[3:4])  # the base row: the LoRA costs it nothing
    assert (base[:3] - got[:3]).abs().amax() > 1e-2  # the adapters do act


def test_the_latent_cache_holds_576_values_a_token_for_v3(tmp_path: Path) -> None:
    """moonlight-16b-a3b (kv_lora_rank 512, qk_rope_head_dim 64): 576 values a token a layer,
    the latent and the rotary key side by side, against 2 * 16 * 192 for K and V of its heads."""
    from moelora.engine.kv_cache import allocate_kv_caches, page_bytes
    from moelora.models.registry import read_model_config
    from moelora.models.shapes import shape_config, write_config_folder

    folder = write_config_folder(shape_config("moonlight-16b-a3b", num_layers=2), tmp_path)
    mc, _ = read_model_config(str(folder))
    assert mc.mla is not None and mc.mla.cache_size == 576
    assert page_bytes(mc, 16, torch.bfloat16) == 2 * 16 * 576 * 2
    caches = allocate_kv_caches(mc, 3, 16, dtype=torch.float32, device=torch.device("cpu"))
    latent, rope = caches[1]
    assert latent.shape == (4, 16, 1, 512) and rope.shape == (4, 16, 1, 64)
    assert latent.untyped_storage().data_ptr() == rope.untyped_storage().data_ptr()
    assert rope.data_ptr() - latent.data_ptr() == 512 * 4


@pytest.mark.parametrize("shape", ["deepseek-v2-lite", "moonlight-16b-a3b"])
def test_the_softmax_scale_is_transformers(shape: str, tmp_path: Path) -> None:
    """DeepSeek's YaRN mscale_all_dim in the softmax scale, as transformers' attention has it."""
    import importlib

    from moelora.models.registry import read_model_config
    from moelora.models.shapes import shape_config, write_config_folder

    folder = write_config_folder(shape_config(shape, num_layers=1), tmp_path)
    mc, hf_config = read_model_config(str(folder))
    arch = hf_config.model_type
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    attention = getattr(modeling, mf._CLASSES[arch][0].replace("Config", "Attention"))
    assert mc.mla.softmax_scale == attention(hf_config, 0).scaling
    assert (mc.mla.softmax_scale != 192**-0.5) == (shape == "deepseek-v2-lite")


@pytest.mark.parametrize("arch", mf.ARCHS)
def test_the_gpu_kernel_table_takes_them_and_several_ranks_refuse_them(
    fx: FamilyFixtures, arch: str
) -> None:
    from moelora.errors import ConfigError, ModelConfigError
    from moelora.kernels.ops import REFERENCE_OPS
    from moelora.models.model import check_kernels
    from moelora.models.registry import read_model_config
    from moelora.models.shard import check_divides
    from moelora.parallel import Shard

    mc, _ = read_model_config(str(fx.model(arch)))
    check_kernels(mc, REFERENCE_OPS)
    check_kernels(mc, dataclasses.replace(REFERENCE_OPS, name="triton-x"))
    two = dataclasses.replace(REFERENCE_OPS, shard=Shard(rank=0, size=2))
    with pytest.raises(ModelConfigError, match=r"tensor_parallel_size=2 is not supported"):
        check_kernels(mc, two)
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size=2 is not supported for {arch}"):
        check_divides(mc, 2, expert_parallel=False)  # before the other ranks start


@pytest.mark.parametrize(
    "shape,change,message",
    [
        ("deepseek-v2-lite", {"topk_method": "noaux_tc"}, r"topk_method='noaux_tc' is not supp"),
        ("moonlight-16b-a3b", {"attention_bias": True}, r"attention_bias=True is not supported"),
        ("moonlight-16b-a3b", {"n_group": 3}, r"n_group=3 is not supported with n_routed_e"),
        ("moonlight-16b-a3b", {"n_group": 4, "topk_group": 5}, r"topk_group=5 is not supported"),
        # 16 groups of 4 experts, one allowed: fewer than Moonlight's top 6
        ("moonlight-16b-a3b", {"n_group": 16, "topk_group": 1}, r"topk_group=1 groups of 4 exp"),
        ("deepseek-v2-lite", {"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
        ("qwen3-30b-a3b", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not"),
    ],
)
def test_what_is_not_served_is_refused(
    shape: str, change: dict, message: str, tmp_path: Path
) -> None:
    from moelora.errors import ModelConfigError
    from moelora.models.registry import read_model_config
    from moelora.models.shapes import shape_config, write_config_folder

    folder = write_config_folder({**shape_config(shape, num_layers=2), **change}, tmp_path)
    with pytest.raises(ModelConfigError, match=message):
        read_model_config(str(folder))
