"""moelora against transformers(+PEFT), fp32 on the CPU: greedy tokens equal, logprobs within 1e-4.

The first tests pin down the file formats the loader must read (what transformers 5 writes for
the experts, how PEFT lays out `target_parameters` LoRA) and check the reference itself; the rest
run the engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch

if TYPE_CHECKING:
    from conftest import FixtureBank

ARCHS = hf.ARCHS
MAX_LORA_RANK = 16

# ---------------------------------------------------------------------------------------------
# The formats and the reference (transformers and PEFT only)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_writes_experts_per_expert(bank: FixtureBank, arch: str) -> None:
    tensors = hf.read_checkpoint(bank.model(arch))
    dims = hf.read_dims(bank.model(arch))
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2"))
    if arch != "mixtral":
        block, (gate, up, down) = ("mlp", ("gate_proj", "up_proj", "down_proj"))
    h, i = dims.hidden, dims.moe_intermediate
    for layer, sparse in enumerate(dims.sparse_layers):
        prefix = f"model.layers.{layer}.{block}"
        if not sparse:
            assert tensors[f"{prefix}.gate_proj.weight"].shape == (dims.dense_intermediate, h)
            continue
        assert tensors[f"{prefix}.gate.weight"].shape == (dims.num_experts, h)
        for e in range(dims.num_experts):
            assert tensors[f"{prefix}.experts.{e}.{gate}.weight"].shape == (i, h)
            assert tensors[f"{prefix}.experts.{e}.{up}.weight"].shape == (i, h)
            assert tensors[f"{prefix}.experts.{e}.{down}.weight"].shape == (h, i)
    assert not any("gate_up_proj" in k for k in tensors)
    assert ("lm_head.weight" in tensors) == (arch != "olmoe")  # olmoe is the tied case


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("layout,shards", [("fused", 1), ("fused", 2), ("per_expert", 3)])
def test_checkpoint_rewrite_is_lossless(
    bank: FixtureBank, arch: str, layout: str, shards: int
) -> None:
    path = bank.layout(arch, layout, shards)
    tensors = hf.read_checkpoint(path)
    assert any(k.endswith("experts.gate_up_proj") for k in tensors) == (layout == "fused")
    assert (path / "model.safetensors.index.json").exists() == (shards > 1)
    want = hf.load_hf_model(bank.model(arch)).state_dict()
    got = hf.load_hf_model(path).state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_legacy_config_is_the_same_model(bank: FixtureBank) -> None:
    """qwen3_moe's config.json uses rope_scaling/rope_theta/num_experts: same model as 5.x keys."""
    legacy = json.loads((bank.model("qwen3_moe") / "config.json").read_text())
    assert legacy["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert "rope_parameters" not in legacy and "num_experts" in legacy
    native = bank.model_variant("native-config", "qwen3_moe")
    assert "rope_parameters" in json.loads((native / "config.json").read_text())
    prompts = hf.PROMPTS[:2]
    want = bank.reference(native, prompts, [None] * 2)
    got = bank.reference(bank.model("qwen3_moe"), prompts, [None] * 2)
    assert [o.tokens for o in want] == [o.tokens for o in got]


def _expert_forward(gate_up, down, x, top_idx, top_w):
    """Textbook MoE: sum_k w_k * down_e @ (silu(gate_e @ x) * (up_e @ x)), e = top_idx[:, k]."""
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for t in range(x.shape[0]):
        for k in range(top_idx.shape[1]):
            e = int(top_idx[t, k])
            gu = gate_up[e] @ x[t]
            out[t] += top_w[t, k] * (down[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize(
    "targeted", [("gate_up_proj", "down_proj"), ("gate_up_proj",), ("down_proj",)]
)
def test_peft_target_parameters_layout(bank: FixtureBank, targeted: tuple[str, ...]) -> None:
    """What the loader must read: lora_A [r*E, in], lora_B [out, r*E]; A_e = A[e*r:(e+1)*r],
    B_e = B[:, e::E]. gate_up is the inner wrapper (`experts.base_layer.lora_*`) only when both
    are targeted; a lone target is `experts.lora_*`."""
    arch, rank, alpha = "qwen3_moe", 4, 12
    model = bank.model(arch)
    adapter = bank.adapter(
        "layout-" + "-".join(targeted),
        lambda p: hf.make_peft_adapter(
            model,
            p,
            targets=None,
            target_parameters=[f"mlp.experts.{t}" for t in targeted],
            seed=5,
            rank=rank,
            alpha=alpha,
        ),
    )
    config, tensors = hf.read_adapter(adapter)
    assert sorted(config["target_parameters"]) == sorted(f"mlp.experts.{t}" for t in targeted)
    dims = hf.read_dims(model)
    n_e, h, i = dims.num_experts, dims.hidden, dims.moe_intermediate
    scaling = alpha / rank
    base = hf.load_hf_model(model)
    peft_model = hf.load_reference_model(model, adapter)
    gen = torch.Generator().manual_seed(0)
    for layer in range(dims.num_layers):
        prefix = f"{hf.PEFT_PREFIX}model.layers.{layer}.mlp.experts"
        names = {"gate_up_proj": f"{prefix}.lora_", "down_proj": f"{prefix}.lora_"}
        if len(targeted) == 2:
            names["gate_up_proj"] = f"{prefix}.base_layer.lora_"
        shapes = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}  # (in, out)
        assert len([k for k in tensors if k.startswith(prefix)]) == 2 * len(targeted)
        experts = base.model.layers[layer].mlp.experts
        weights = {"gate_up_proj": experts.gate_up_proj.detach().clone()}
        weights["down_proj"] = experts.down_proj.detach().clone()
        for t in targeted:
            lora_a, lora_b = tensors[names[t] + "A.weight"], tensors[names[t] + "B.weight"]
            fan_in, fan_out = shapes[t]
            assert lora_a.shape == (rank * n_e, fan_in), (t, lora_a.shape)
            assert lora_b.shape == (fan_out, rank * n_e), (t, lora_b.shape)
            for e in range(n_e):
                a_e = lora_a[e * rank : (e + 1) * rank]
                b_e = lora_b[:, e::n_e]
                weights[t][e] += scaling * (b_e @ a_e)
        x = torch.randn(6, h, generator=gen)
        top_idx = torch.stack([torch.randperm(n_e, generator=gen)[:2] for _ in range(6)])
        top_w = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
        want = _expert_forward(weights["gate_up_proj"], weights["down_proj"], x, top_idx, top_w)
        peft_experts = peft_model.base_model.model.model.layers[layer].mlp.experts
        with torch.no_grad():
            got = peft_experts(x, top_idx, top_w)
            unadapted = experts(x, top_idx, top_w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - unadapted).abs().max() > 0.1  # the adapter does change the experts


def per_expert_to_target_parameters(model: Path, per_expert: Path, dst: Path, arch: str) -> Path:
    """The same adapter in PEFT's target_parameters layout: gate and up get rank 2r with
    A = [A_gate; A_up] and B = blockdiag(B_gate, B_up) (alpha doubled, so scaling is kept)."""
    config, tensors = hf.read_adapter(per_expert)
    dims = hf.read_dims(model)
    block, (gate, up, down) = hf._expert_names(arch)
    rank, n_e = config["r"], dims.num_experts
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if ".experts." not in key:
            out[key] = t
    for layer in range(dims.num_layers):
        src = f"{hf.PEFT_PREFIX}model.layers.{layer}.{block}.experts"
        dst_prefix = f"{hf.PEFT_PREFIX}model.layers.{layer}.mlp.experts"

        def ab(e: int, proj: str, src: str = src) -> tuple[torch.Tensor, torch.Tensor]:
            return tensors[f"{src}.{e}.{proj}.lora_A.weight"], tensors[
                f"{src}.{e}.{proj}.lora_B.weight"
            ]

        gu_a = torch.cat([torch.cat([ab(e, gate)[0], ab(e, up)[0]]) for e in range(n_e)])
        gu_b = torch.zeros(2 * dims.moe_intermediate, 2 * rank * n_e)
        d_a = torch.cat([ab(e, down)[0] for e in range(n_e)])
        d_b = torch.zeros(dims.hidden, rank * n_e)
        for e in range(n_e):
            b_e = torch.block_diag(ab(e, gate)[1], ab(e, up)[1])  # [2I, 2r]
            gu_b[:, e::n_e] = b_e
            d_b[:, e::n_e] = ab(e, down)[1]
        out[f"{dst_prefix}.base_layer.lora_A.weight"] = gu_a
        out[f"{dst_prefix}.base_layer.lora_B.weight"] = gu_b
        out[f"{dst_prefix}.lora_A.weight"] = d_a
        out[f"{dst_prefix}.lora_B.weight"] = d_b
    attention = sorted(
        {t for t in config["target_modules"] if t.startswith(("q_", "k_", "v_", "o_"))}
    )
    config = {
        **config,
        "target_modules": attention,
        "target_parameters": hf.EXPERT_PARAMS,
        "rank_pattern": {"gate_up_proj": 2 * rank},
        "alpha_pattern": {"gate_up_proj": 2 * config["lora_alpha"]},
    }
    return hf.write_adapter(dst, config, out)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_reference_agrees_with_peft(bank: FixtureBank, arch: str) -> None:
    """The merged reference for hand-written per-expert adapters equals PEFT running the same
    adapter in target_parameters form (this also re-checks the interleaved-B formula)."""
    model, per_expert = bank.model(arch), bank.per_expert_adapter(arch)
    converted = bank.adapter(
        f"converted-{arch}",
        lambda p: per_expert_to_target_parameters(model, per_expert, p, arch),
    )
    prompts = hf.PROMPTS[:3]
    want = hf.reference_generate(model, prompts, [per_expert] * 3, hf.MAX_TOKENS)
    got = hf.reference_generate(model, prompts, [converted] * 3, hf.MAX_TOKENS)
    for w, g in zip(want, got):
        assert w.tokens == g.tokens
        assert max(abs(a - b) for a, b in zip(w.logprobs, g.logprobs)) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_references_are_not_degenerate(bank: FixtureBank, arch: str) -> None:
    """Adapters change greedy tokens, outputs are not one repeated token, no near ties."""
    model = bank.model(arch)
    outs = {
        name: bank.reference(model, hf.PROMPTS, [adapter] * len(hf.PROMPTS))
        for name, adapter in [
            ("base", None),
            ("peft", bank.peft_adapter(arch)),
            ("per_expert", bank.per_expert_adapter(arch)),
        ]
    }
    tokens = {name: [o.tokens for o in o_list] for name, o_list in outs.items()}
    assert tokens["base"] != tokens["peft"] and tokens["base"] != tokens["per_expert"]
    for name, o_list in outs.items():
        assert len({t for o in o_list for t in o.tokens}) > 10, name
        assert min(m for o in o_list for m in o.margins) > 1e-3, name


# ---------------------------------------------------------------------------------------------
# The engine against the reference


def greedy_params(max_tokens: int = hf.MAX_TOKENS):
    from moelora import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)


def make_llm(bank: FixtureBank, model: Path, loras: dict[str, Path] | None = None, **kwargs):
    from moelora import LLM

    kwargs = {"max_loras": 4, "max_lora_rank": MAX_LORA_RANK, **kwargs}
    if bank.device != "cpu":
        kwargs["num_pages"] = 64  # several engines live at once: no sizing from free memory
    lora_modules = {name: str(path) for name, path in (loras or {}).items()}
    return LLM(str(model), lora_modules=lora_modules, dtype="float32", device=bank.device, **kwargs)


def run(llm, prompts: list[list[int]], lora, max_tokens: int = hf.MAX_TOKENS):
    return llm.generate(prompts, greedy_params(max_tokens), lora=lora)


def assert_matches(
    bank: FixtureBank, outs, refs: list[hf.RefOutput], prompts, label: str, tol: float = 0.0
) -> None:
    """Greedy tokens equal to transformers', logprobs within the bank's tolerance (or tol,
    where larger: a family whose fixtures round more)."""
    tol = max(tol, bank.logprob_tol)
    assert len(outs) == len(refs), label
    for n, (out, ref, prompt) in enumerate(zip(outs, refs, prompts)):
        where = f"{label}, request {n}"
        assert list(out.prompt_token_ids) == list(prompt), where
        tokens = list(out.token_ids)
        if tokens != ref.tokens:
            step = next(
                (j for j, (a, b) in enumerate(zip(tokens, ref.tokens)) if a != b),
                min(len(tokens), len(ref.tokens)),
            )
            margin = ref.margins[step] if step < len(ref.margins) else float("nan")
            pytest.fail(
                f"{where}: first differing token at step {step}: moelora {tokens} vs "
                f"transformers {ref.tokens} (reference top-1/top-2 logit margin there "
                f"{margin:.4f})"
            )
        assert out.finish_reason == "length", where
        assert len(out.logprobs) == len(tokens), where
        for step, (token, want) in enumerate(zip(tokens, ref.logprobs)):
            got = out.logprobs[step][token]
            assert abs(got - want) <= tol, (
                f"{where}, step {step}: logprob {got:.6f} vs transformers {want:.6f}"
            )


class Engines:
    """One engine per arch with the arch's two standard adapters, built on first use."""

    def __init__(self, bank: FixtureBank) -> None:
        self.bank = bank
        self._llms: dict[str, object] = {}

    def get(self, arch: str):
        if arch not in self._llms:
            loras = {"a": self.bank.peft_adapter(arch), "b": self.bank.per_expert_adapter(arch)}
            self._llms[arch] = make_llm(self.bank, self.bank.model(arch), loras)
        return self._llms[arch]


@pytest.fixture(scope="module")
def engines(bank: FixtureBank) -> Engines:
    return Engines(bank)


@pytest.mark.parametrize("arch", ARCHS)
def test_base_model(bank: FixtureBank, engines: Engines, arch: str) -> None:
    refs = bank.reference(bank.model(arch), hf.PROMPTS, [None] * len(hf.PROMPTS))
    outs = run(engines.get(arch), hf.PROMPTS, None)
    assert_matches(bank, outs, refs, hf.PROMPTS, f"{arch} base")


@pytest.mark.parametrize("adapter", ["a", "b"])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_adapter(bank: FixtureBank, engines: Engines, arch: str, adapter: str) -> None:
    """a: PEFT rank 8 (attention, shared expert / dense MLP, experts via target_parameters);
    b: hand-written per-expert rank 4."""
    path = bank.peft_adapter(arch) if adapter == "a" else bank.per_expert_adapter(arch)
    refs = bank.reference(bank.model(arch), hf.PROMPTS, [path] * len(hf.PROMPTS))
    outs = run(engines.get(arch), hf.PROMPTS, adapter)
    assert_matches(bank, outs, refs, hf.PROMPTS, f"{arch} adapter {adapter}")


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch(bank: FixtureBank, engines: Engines, arch: str) -> None:
    loras = ["a", None, "b", "a", None]
    paths = {"a": bank.peft_adapter(arch), "b": bank.per_expert_adapter(arch), None: None}
    refs = bank.reference(bank.model(arch), hf.PROMPTS, [paths[n] for n in loras])
    outs = run(engines.get(arch), hf.PROMPTS, loras)
    assert_matches(bank, outs, refs, hf.PROMPTS, f"{arch} mixed batch {loras}")


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_layouts_load_identically(bank: FixtureBank, arch: str) -> None:
    """Per-expert and fused 3D experts, single file and sharded: same outputs, base and LoRA."""
    loras = ["a", None, "a"]
    prompts = hf.PROMPTS[:3]
    peft = bank.peft_adapter(arch)
    refs = bank.reference(bank.model(arch), prompts, [peft, None, peft])
    for layout, shards in [("fused", 1), ("fused", 2), ("per_expert", 3)]:
        llm = make_llm(bank, bank.layout(arch, layout, shards), {"a": peft})
        assert_matches(bank, run(llm, prompts, loras), refs, prompts, f"{arch} {layout} x{shards}")


def test_rslora(bank: FixtureBank) -> None:
    """scaling = alpha / sqrt(r), for PEFT (qwen3_moe) and per-expert (mixtral) adapters."""
    arch = "qwen3_moe"
    model = bank.model(arch)
    peft = bank.adapter(
        "rslora-peft",
        lambda p: hf.make_peft_adapter(
            model,
            p,
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=hf.EXPERT_PARAMS,
            seed=11,
            rank=16,
            alpha=4,
            use_rslora=True,
        ),
    )
    assert json.loads((peft / "adapter_config.json").read_text())["use_rslora"] is True
    refs = bank.reference(model, hf.PROMPTS[:3], [peft, None, peft])
    outs = run(make_llm(bank, model, {"rs": peft}), hf.PROMPTS[:3], ["rs", None, "rs"])
    assert_matches(bank, outs, refs, hf.PROMPTS[:3], f"{arch} rslora PEFT")

    arch = "mixtral"
    model = bank.model(arch)
    per_expert = bank.adapter(
        "rslora-per-expert",
        lambda p: hf.make_per_expert_adapter(
            model, p, seed=12, rank=9, alpha=6, arch=arch, use_rslora=True
        ),
    )
    refs = bank.reference(model, hf.PROMPTS[:3], [per_expert, None, per_expert])
    outs = run(make_llm(bank, model, {"rs": per_expert}), hf.PROMPTS[:3], ["rs", None, "rs"])
    assert_matches(bank, outs, refs, hf.PROMPTS[:3], f"{arch} rslora per-expert")


def test_rank_and_alpha_pattern(bank: FixtureBank) -> None:
    """gate_up and down (and q and o) with different ranks and alphas in one adapter."""
    arch = "qwen2_moe"
    model = bank.model(arch)
    adapter = bank.adapter(
        "patterns",
        lambda p: hf.make_peft_adapter(
            model,
            p,
            targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
            target_parameters=hf.EXPERT_PARAMS,
            seed=13,
            rank=4,
            alpha=8,
            rank_pattern={"gate_up_proj": 8, "q_proj": 2, "shared_expert.gate_proj": 6},
            alpha_pattern={"down_proj": 3, "o_proj": 24, "gate_up_proj": 5},
        ),
    )
    _, tensors = hf.read_adapter(adapter)
    n_e = hf.read_dims(model).num_experts
    prefix = f"{hf.PEFT_PREFIX}model.layers.0"
    assert tensors[f"{prefix}.mlp.experts.base_layer.lora_A.weight"].shape[0] == 8 * n_e
    assert tensors[f"{prefix}.mlp.experts.lora_A.weight"].shape[0] == 4 * n_e
    assert tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"].shape[0] == 2
    assert tensors[f"{prefix}.mlp.shared_expert.gate_proj.lora_A.weight"].shape[0] == 6
    refs = bank.reference(model, hf.PROMPTS[:3], [adapter, None, adapter])
    outs = run(make_llm(bank, model, {"pat": adapter}), hf.PROMPTS[:3], ["pat", None, "pat"])
    assert_matches(bank, outs, refs, hf.PROMPTS[:3], f"{arch} rank_pattern/alpha_pattern")


def test_adapters_on_some_layers_and_some_expert_weights(bank: FixtureBank) -> None:
    """Layer 2 only (PEFT, qwen2_moe); layer 0 only (per-expert, mixtral); experts' gate_up only
    and down only (olmoe: a lone target_parameter is `experts.lora_*`, whichever it is)."""
    model = bank.model("qwen2_moe")
    layer2 = bank.adapter(
        "layer2",
        lambda p: hf.make_peft_adapter(
            model,
            p,
            targets=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
            layers_to_transform=[2],
            target_parameters=[f"layers.2.{t}" for t in hf.EXPERT_PARAMS],
            seed=14,
            rank=4,
            alpha=8,
        ),
    )
    _, tensors = hf.read_adapter(layer2)
    assert {re.search(r"layers\.(\d+)\.", k)[1] for k in tensors} == {"2"}
    refs = bank.reference(model, hf.PROMPTS[:3], [layer2, None, layer2])
    outs = run(make_llm(bank, model, {"l2": layer2}), hf.PROMPTS[:3], ["l2", None, "l2"])
    assert_matches(bank, outs, refs, hf.PROMPTS[:3], "qwen2_moe PEFT on layer 2 only")

    model = bank.model("mixtral")
    layer0 = bank.adapter(
        "layer0",
        lambda p: hf.make_per_expert_adapter(
            model, p, seed=15, rank=8, alpha=8, arch="mixtral", layers=[0], attention=("k_proj",)
        ),
    )
    refs = bank.reference(model, hf.PROMPTS[:3], [layer0, None, layer0])
    outs = run(make_llm(bank, model, {"l0": layer0}), hf.PROMPTS[:3], ["l0", None, "l0"])
    assert_matches(bank, outs, refs, hf.PROMPTS[:3], "mixtral per-expert on layer 0 only")

    model = bank.model("olmoe")
    lone = {
        name: bank.adapter(
            f"lone-{name}",
            lambda p, name=name, seed=seed: hf.make_peft_adapter(
                model,
                p,
                targets=None,
                target_parameters=[f"mlp.experts.{name}"],
                seed=seed,
                rank=4,
                alpha=8,
            ),
        )
        for name, seed in [("gate_up_proj", 16), ("down_proj", 17)]
    }
    loras = ["gate_up_proj", "down_proj", None]
    refs = bank.reference(model, hf.PROMPTS[:3], [lone[n] if n else None for n in loras])
    outs = run(make_llm(bank, model, lone), hf.PROMPTS[:3], loras)
    assert_matches(bank, outs, refs, hf.PROMPTS[:3], "olmoe experts gate_up only / down only")


def test_more_adapters_than_slots(bank: FixtureBank) -> None:
    """max_loras=2 with three adapters (one at rank == max_lora_rank): they swap through slots,
    within one generate call and across calls."""
    arch = "mixtral"
    model = bank.model(arch)
    c = bank.adapter(
        "rank16",
        lambda p: hf.make_peft_adapter(
            model,
            p,
            targets=["q_proj", "o_proj"],
            target_parameters=hf.EXPERT_PARAMS,
            seed=18,
            rank=MAX_LORA_RANK,
            alpha=32,
        ),
    )
    paths = {"a": bank.peft_adapter(arch), "b": bank.per_expert_adapter(arch), "c": c, None: None}
    llm = make_llm(bank, model, {n: p for n, p in paths.items() if n}, max_loras=2)
    loras = ["a", "b", "c", None, "c"]
    refs = bank.reference(model, hf.PROMPTS, [paths[n] for n in loras])
    assert_matches(
        bank, run(llm, hf.PROMPTS, loras), refs, hf.PROMPTS, f"{arch} 3 adapters in 2 slots"
    )
    for name in ["c", "a", "b", "c"]:
        refs = bank.reference(model, hf.PROMPTS[:2], [paths[name], None])
        outs = run(llm, hf.PROMPTS[:2], [name, None])
        assert_matches(bank, outs, refs, hf.PROMPTS[:2], f"{arch} adapter {name} after swaps")


def test_load_and_unload_on_a_live_engine(bank: FixtureBank) -> None:
    arch = "olmoe"
    model = bank.model(arch)
    llm = make_llm(bank, model)
    assert list(llm.list_loras()) == []
    llm.load_lora("b", str(bank.per_expert_adapter(arch)))
    llm.load_lora("a", str(bank.peft_adapter(arch)))
    assert sorted(llm.list_loras()) == ["a", "b"]
    loras = ["a", None, "b"]
    paths = {"a": bank.peft_adapter(arch), "b": bank.per_expert_adapter(arch), None: None}
    refs = bank.reference(model, hf.PROMPTS[:3], [paths[n] for n in loras])
    assert_matches(
        bank, run(llm, hf.PROMPTS[:3], loras), refs, hf.PROMPTS[:3], f"{arch} live-loaded"
    )
    llm.unload_lora("a")
    assert list(llm.list_loras()) == ["b"]
    refs = bank.reference(model, hf.PROMPTS[:2], [paths["b"], None])
    assert_matches(
        bank, run(llm, hf.PROMPTS[:2], ["b", None]), refs, hf.PROMPTS[:2], f"{arch} after unload"
    )
    # the name comes back with other weights: nothing of the old adapter may be reused
    other = bank.adapter(
        "olmoe-other",
        lambda p: hf.make_peft_adapter(
            model,
            p,
            targets=["k_proj", "o_proj"],
            target_parameters=hf.EXPERT_PARAMS,
            seed=19,
            rank=6,
            alpha=6,
        ),
    )
    llm.load_lora("a", str(other))
    refs = bank.reference(model, hf.PROMPTS[:3], [other, None, paths["b"]])
    outs = run(llm, hf.PROMPTS[:3], loras)
    assert_matches(
        bank, outs, refs, hf.PROMPTS[:3], f"{arch} name 'a' reloaded with another adapter"
    )


def test_adapter_saved_as_bin_and_mixtral_mlp_alias(bank: FixtureBank) -> None:
    """adapter_model.bin (PEFT safe_serialization=False) reads like safetensors; per-expert
    Mixtral keys under `mlp.experts.{e}` (transformers 5 module names) equal `block_sparse_moe`."""
    arch = "mixtral"
    model, per_expert = bank.model(arch), bank.per_expert_adapter(arch)

    def as_bin(dst: Path) -> Path:
        config, tensors = hf.read_adapter(per_expert)
        hf.write_adapter(dst, config, tensors)
        (dst / "adapter_model.safetensors").unlink()
        torch.save(tensors, dst / "adapter_model.bin")
        return dst

    def as_mlp(dst: Path) -> Path:
        config, tensors = hf.read_adapter(per_expert)
        renamed = {k.replace(".block_sparse_moe.", ".mlp."): t for k, t in tensors.items()}
        return hf.write_adapter(dst, config, renamed)

    variants = {
        "bin": bank.adapter("mixtral-bin", as_bin),
        "mlp": bank.adapter("mixtral-mlp-alias", as_mlp),
    }
    llm = make_llm(bank, model, variants)
    loras = ["bin", None, "mlp"]
    refs = bank.reference(model, hf.PROMPTS[:3], [per_expert, None, per_expert])
    assert_matches(
        bank, run(llm, hf.PROMPTS[:3], loras), refs, hf.PROMPTS[:3], f"{arch} .bin / mlp."
    )


def test_yarn_rope_scaling(bank: FixtureBank) -> None:
    model = bank.model_variant(
        "yarn",
        "qwen3_moe",
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        },
    )
    refs = bank.reference(model, hf.PROMPTS[:3], [None] * 3)
    assert_matches(
        bank,
        run(make_llm(bank, model), hf.PROMPTS[:3], None),
        refs,
        hf.PROMPTS[:3],
        "qwen3_moe yarn",
    )


def test_tied_embeddings_qwen3(bank: FixtureBank) -> None:
    model = bank.model_variant("tied", "qwen3_moe", tie_word_embeddings=True)
    assert "lm_head.weight" not in hf.read_checkpoint(model)
    refs = bank.reference(model, hf.PROMPTS[:3], [None] * 3)
    assert_matches(
        bank, run(make_llm(bank, model), hf.PROMPTS[:3], None), refs, hf.PROMPTS[:3], "qwen3 tied"
    )


def test_prompt_logprobs_equal_transformers_in_chunks(bank: FixtureBank) -> None:
    """prompt_logprobs (vLLM's layout: None, then one entry per prompt token) for a base and an
    adapter request in one batch, with the prompts prefilled in 7-token chunks, against one
    transformers(+PEFT) forward over each prompt."""
    from moelora import SamplingParams

    arch = "qwen3_moe"
    model, adapter = bank.model(arch), bank.peft_adapter(arch)
    llm = make_llm(bank, model, {"a": adapter}, max_num_batched_tokens=7)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    prompts = [p for p in hf.PROMPTS if len(p) > 8][:2]
    outs = llm.generate(prompts, params, lora=[None, "a"])
    for out, prompt, path in zip(outs, prompts, [None, adapter]):
        ref = hf.load_reference_model(model, path)
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([prompt])).logits[0].float()
        want = logits.log_softmax(-1)
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for j in range(1, len(prompt)):
            entry = lps[j]
            assert prompt[j] in entry and len(entry) in (3, 4)
            assert abs(entry[prompt[j]] - want[j - 1, prompt[j]].item()) <= bank.logprob_tol
            best = want[j - 1].topk(3).indices.tolist()
            assert set(best) <= set(entry)
