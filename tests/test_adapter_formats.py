"""Expert adapters whose factors are shared by the experts: shared-outer (gate_up's lora_A and
down's lora_B one tensor for every expert) and fully shared, in the forms trainers export them:

- stacked, SGLang's (#21466) and Megatron-Bridge's packed export:
  `mlp.experts.gate_up_proj.lora_A.weight` [1 | E, r, H], `.lora_B.weight` [1 | E, 2I, r],
  `mlp.experts.down_proj.lora_A.weight` [1 | E, r, I], `.lora_B.weight` [1 | E, H, r];
- Megatron-Bridge's shared-outer export of a per-expert checkpoint: the shared side stacked on
  `mlp.experts.{gate,up}_proj.lora_A` [1, r, H] / `mlp.experts.down_proj.lora_B` [1, H, r], the
  other side on the per-expert keys `mlp.experts.{e}.{gate,up,down}_proj`;
- PEFT's own forms (target_parameters, per-expert), where the shared factor is written once per
  expert: that is the expanded adapter transformers+PEFT runs as the reference.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch
from test_vs_transformers import assert_matches, make_llm, run

if TYPE_CHECKING:
    from conftest import FixtureBank

P = hf.PEFT_PREFIX + "model.layers"

# ---------------------------------------------------------------------------------------------
# Parsing, on LoRA targets of a made-up MoE layer (no model needed)

E, H, I, R = 4, 24, 10, 3  # experts, hidden, expert intermediate, rank
CONFIG = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R}


def _targets(*, interleaved: bool = False) -> dict:
    """Layer 0 has experts; layer 1 is a dense MLP layer."""
    from moelora.lora.slots import LoraTarget

    return {
        "layers.0.experts13": LoraTarget("layers.0.experts13", H, (I, I), E, None, "", interleaved),
        "layers.0.experts2": LoraTarget("layers.0.experts2", I, (H,), E, None, ""),
        "layers.1.mlp.gate_up": LoraTarget("layers.1.mlp.gate_up", H, (2 * I, 2 * I), 0, None, ""),
    }


def _parse(tensors: dict[str, torch.Tensor], *, name: str = "fmt", config=None, **kwargs):
    from moelora.lora.adapter import adapter_from_tensors

    targets = kwargs.pop("targets", None) or _targets()
    return adapter_from_tensors(
        name, tensors, config or CONFIG, targets, max_rank=8, dtype=torch.float32, **kwargs
    )


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _stacked(lead: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """SGLang's stacked form; lead: leading dim of gu_a, gu_b, d_a, d_b (1 = shared)."""
    shapes = {"gu_a": (R, H), "gu_b": (2 * I, R), "d_a": (R, I), "d_b": (H, R)}
    keys = {
        "gu_a": f"{P}.0.mlp.experts.gate_up_proj.lora_A.weight",
        "gu_b": f"{P}.0.mlp.experts.gate_up_proj.lora_B.weight",
        "d_a": f"{P}.0.mlp.experts.down_proj.lora_A.weight",
        "d_b": f"{P}.0.mlp.experts.down_proj.lora_B.weight",
    }
    return {keys[f]: _rand(lead[f], *shapes[f], seed=seed + i) for i, f in enumerate(shapes)}


SHARED_OUTER = {"gu_a": 1, "gu_b": E, "d_a": E, "d_b": 1}
FULLY_SHARED = {"gu_a": 1, "gu_b": 1, "d_a": 1, "d_b": 1}
PER_EXPERT = {"gu_a": E, "gu_b": E, "d_a": E, "d_b": E}


def _factors(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The four stacked factors, each broadcast to every expert."""
    gu_a, gu_b, d_a, d_b = tensors.values()
    return tuple(t.expand(E, *t.shape[1:]) for t in (gu_a, gu_b, d_a, d_b))


@pytest.mark.parametrize(
    "lead,shared",
    [
        (SHARED_OUTER, {("layers.0.experts13", "a"), ("layers.0.experts2", "b")}),
        (FULLY_SHARED, {(t, f) for t in ("layers.0.experts13", "layers.0.experts2") for f in "ab"}),
        (PER_EXPERT, set()),
    ],
    ids=["shared-outer", "fully-shared", "per-expert"],
)
def test_stacked_factors_expand_to_every_expert(lead: dict[str, int], shared: set) -> None:
    tensors = _stacked(lead)
    adapter = _parse(tensors)
    gu_a, gu_b, d_a, d_b = _factors(tensors)
    m13, m2 = adapter.modules["layers.0.experts13"], adapter.modules["layers.0.experts2"]
    assert m13.a.shape == (E, 2, R, H) and m13.b.shape == (E, 2 * I, R)
    assert torch.equal(m13.a, gu_a[:, None].expand(E, 2, R, H))  # one A for gate and up
    assert torch.equal(m13.b, gu_b)
    assert torch.equal(m2.a[:, 0], d_a) and torch.equal(m2.b, d_b)
    assert adapter.shared == shared
    assert adapter.rank == R and adapter.scaling == 2.0


def _per_expert_keys(gu_a, gu_b, d_a, d_b) -> dict[str, torch.Tensor]:
    """The same adapter in PEFT's per-expert form (every factor written once per expert)."""
    out = {}
    for e in range(E):
        base = f"{P}.0.mlp.experts.{e}"
        for proj, a, b in [
            ("gate_proj", gu_a[e], gu_b[e, :I]),
            ("up_proj", gu_a[e], gu_b[e, I:]),
            ("down_proj", d_a[e], d_b[e]),
        ]:
            out[f"{base}.{proj}.lora_A.weight"] = a.clone()
            out[f"{base}.{proj}.lora_B.weight"] = b.clone()
    return out


def _assert_same(got, want) -> None:
    assert got.modules.keys() == want.modules.keys()
    for key, m in want.modules.items():
        assert torch.equal(got.modules[key].a, m.a), key
        assert torch.equal(got.modules[key].b, m.b), key
    assert got.shared == want.shared and got.rank == want.rank and got.scaling == want.scaling


@pytest.mark.parametrize("lead", [SHARED_OUTER, FULLY_SHARED], ids=["shared-outer", "fully"])
def test_per_expert_form_with_a_factor_written_per_expert_equals_the_stacked_one(lead) -> None:
    """PEFT's per-expert form holds a shared factor as E equal tensors: the same slots, and the
    factor is recognized as shared."""
    tensors = _stacked(lead, seed=10)
    _assert_same(_parse(_per_expert_keys(*_factors(tensors))), _parse(tensors))


def test_megatron_shared_outer_on_per_expert_keys_mixtral_names() -> None:
    """Megatron-Bridge on a per-expert checkpoint: the shared side under the expert-agnostic
    name ([1, ...]), the other side per expert; with Mixtral's block_sparse_moe / w1 w3 w2."""
    gate_a, up_a, d_b = _rand(1, R, H, seed=20), _rand(1, R, H, seed=21), _rand(1, H, R, seed=22)
    gu_b, d_a = _rand(E, 2 * I, R, seed=23), _rand(E, R, I, seed=24)
    moe = f"{P}.0.block_sparse_moe.experts"
    tensors = {
        f"{moe}.w1.lora_A.weight": gate_a,
        f"{moe}.w3.lora_A.weight": up_a,
        f"{moe}.w2.lora_B.weight": d_b,
    }
    for e in range(E):
        tensors[f"{moe}.{e}.w1.lora_B.weight"] = gu_b[e, :I]
        tensors[f"{moe}.{e}.w3.lora_B.weight"] = gu_b[e, I:]
        tensors[f"{moe}.{e}.w2.lora_A.weight"] = d_a[e]
    adapter = _parse(tensors)
    m13, m2 = adapter.modules["layers.0.experts13"], adapter.modules["layers.0.experts2"]
    assert torch.equal(m13.a[:, 0], gate_a.expand(E, R, H))
    assert torch.equal(m13.a[:, 1], up_a.expand(E, R, H))
    assert torch.equal(m13.b, gu_b) and torch.equal(m2.a[:, 0], d_a)
    assert torch.equal(m2.b, d_b.expand(E, H, R))
    assert adapter.shared == {("layers.0.experts13", "a"), ("layers.0.experts2", "b")}


def test_peft_target_parameters_with_a_replicated_factor_is_shared() -> None:
    """PEFT target_parameters: A [r*E, in] (expert e in rows e*r:(e+1)*r), B [out, r*E] (expert e
    in columns e::E). gate_up's A blocks all equal, and down's B columns: shared-outer."""
    gu_a = _rand(R, H, seed=30).repeat(E, 1)
    gu_b, d_a = _rand(2 * I, R * E, seed=31), _rand(R * E, I, seed=32)
    d_b = _rand(H, R, seed=33).repeat_interleave(E, dim=1)  # column j*E + e = B[:, j]
    tensors = {
        f"{P}.0.mlp.experts.base_layer.lora_A.weight": gu_a,
        f"{P}.0.mlp.experts.base_layer.lora_B.weight": gu_b,
        f"{P}.0.mlp.experts.lora_A.weight": d_a,
        f"{P}.0.mlp.experts.lora_B.weight": d_b,
    }
    stacked = {
        f"{P}.0.mlp.experts.gate_up_proj.lora_A.weight": gu_a[:R][None],
        f"{P}.0.mlp.experts.gate_up_proj.lora_B.weight": hf.expert_factors(gu_a, gu_b, E)[1],
        f"{P}.0.mlp.experts.down_proj.lora_A.weight": d_a.reshape(E, R, I),
        f"{P}.0.mlp.experts.down_proj.lora_B.weight": d_b[:, ::E][None],
    }
    adapter = _parse(tensors)
    assert adapter.shared == {("layers.0.experts13", "a"), ("layers.0.experts2", "b")}
    _assert_same(adapter, _parse(stacked))


def test_gate_up_rows_follow_the_checkpoint_order() -> None:
    """GPT-OSS alternates gate and up in gate_up_proj: a stacked lora_B's rows alternate alike,
    and the slot holds the gate rows, then the up rows."""
    tensors = _stacked(SHARED_OUTER, seed=40)
    adapter = _parse(tensors, targets=_targets(interleaved=True))
    gu_b = _factors(tensors)[1]
    want = torch.cat([gu_b[:, 0::2], gu_b[:, 1::2]], dim=1)
    assert torch.equal(adapter.modules["layers.0.experts13"].b, want)


def test_rank_and_alpha_pattern_on_stacked_keys() -> None:
    """Patterns name the projection (gate_up_proj, down_proj), as on PEFT's keys; a module's own
    scaling is folded into its B, zero-padded to the adapter's rank."""
    tensors = _stacked(SHARED_OUTER, seed=50)
    key = f"{P}.0.mlp.experts.gate_up_proj.lora_"
    tensors[key + "A.weight"] = tensors[key + "A.weight"][:, :2]
    tensors[key + "B.weight"] = tensors[key + "B.weight"][..., :2]
    config = {**CONFIG, "rank_pattern": {"gate_up_proj": 2}, "alpha_pattern": {"down_proj": 9}}
    adapter = _parse(tensors, config=config)
    gu_a, gu_b, d_a, d_b = _factors(tensors)
    m13, m2 = adapter.modules["layers.0.experts13"], adapter.modules["layers.0.experts2"]
    assert adapter.rank == R and adapter.scaling == 2.0
    assert torch.equal(m13.a[:, :, :2], gu_a[:, None].expand(E, 2, 2, H))
    assert not m13.a[:, :, 2:].any() and not m13.b[..., 2:].any()
    torch.testing.assert_close(m13.b[..., :2], gu_b * (6 / 2) / 2.0)  # alpha 6 at rank 2
    torch.testing.assert_close(m2.b, d_b * (9 / R) / 2.0)


# ---------------------------------------------------------------------------------------------
# Refusals: an AdapterError naming the adapter, the key and the mismatch


def _edit(lead: dict[str, int], **changes) -> dict[str, torch.Tensor]:
    """_stacked(lead) with keys (short names: gu_a ... d_b, or full keys) set or removed."""
    tensors = _stacked(lead, seed=60)
    short = dict(zip(["gu_a", "gu_b", "d_a", "d_b"], tensors))
    for key, value in changes.items():
        key = short.get(key, key)
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    return tensors


def _megatron_gate(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Shared gate A on the stacked key, per-expert gate B."""
    out = {f"{P}.0.mlp.experts.gate_proj.lora_A.weight": a}
    out |= {f"{P}.0.mlp.experts.{e}.gate_proj.lora_B.weight": b for e in range(E)}
    return out


REFUSALS = {
    "leading-dim-neither-1-nor-E": (
        _edit(SHARED_OUTER, gu_a=_rand(2, R, H, seed=1)),
        [r"experts\.gate_up_proj\.lora_A", r"\(2, 3, 24\)", r"\[1, \.\.\.\]", r"\[4, \.\.\.\]"],
    ),
    "stacked-key-not-3d": (
        _edit(SHARED_OUTER, d_b=_rand(H, R, seed=1)),
        [r"experts\.down_proj\.lora_B", r"\(24, 3\)"],
    ),
    "factor-given-twice": (
        _megatron_gate(_rand(1, R, H, seed=1), _rand(I, R, seed=2))
        | {f"{P}.0.mlp.experts.2.gate_proj.lora_A.weight": _rand(R, H, seed=3)},
        [r"experts\.gate_proj\.lora_A", r"experts\.2\.gate_proj\.lora_A", r"expert 2"],
    ),
    "shared-a-wrong-hidden": (
        _megatron_gate(_rand(1, R, 30, seed=1), _rand(I, R, seed=2)),
        [r"experts\.gate_proj\.lora_A", r"\b30\b", r"\(3, 24\)"],
    ),
    "shared-a-and-per-expert-b-ranks-differ": (
        _megatron_gate(_rand(1, R, H, seed=1), _rand(I, R + 1, seed=2)),
        [r"experts\.0\.gate_proj", r"experts\.gate_proj\.lora_A", r"\(10, 4\)"],
    ),
    "shared-a-without-b": (
        {f"{P}.0.mlp.experts.gate_proj.lora_A.weight": _rand(1, R, H, seed=1)},
        [r"experts\.gate_proj\.lora_A", r"experts\.gate_proj\.lora_B", r"experts\.0\.gate_proj"],
    ),
    "per-expert-b-missing-for-one-expert": (
        {
            k: v
            for k, v in _megatron_gate(_rand(1, R, H, seed=1), _rand(I, R, seed=2)).items()
            if ".experts.3." not in k
        },
        [r"experts\.gate_proj\.lora_A", r"expert 3", r"experts\.3\.gate_proj\.lora_B"],
    ),
    "gate-up-b-half-rows": (
        _edit(SHARED_OUTER, gu_b=_rand(E, I, R, seed=1)),
        [r"experts\.gate_up_proj", r"\(10, 3\)", r"\(20, 3\)"],
    ),
    "stacked-key-on-dense-layer": (
        {
            f"{P}.1.mlp.experts.down_proj.lora_A.weight": _rand(1, R, I, seed=1),
            f"{P}.1.mlp.experts.down_proj.lora_B.weight": _rand(1, H, R, seed=2),
        },
        [r"layers\.1\.mlp\.experts\.down_proj", r"matches no module"],
    ),
    "stacked-rank-above-max": (
        _edit(FULLY_SHARED, d_a=_rand(1, 12, I, seed=1), d_b=_rand(1, H, 12, seed=2)),
        [r"experts\.down_proj", r"\b12\b", r"\b8\b"],
    ),
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_refused(case: str) -> None:
    from moelora.errors import AdapterError

    tensors, mentions = REFUSALS[case]
    with pytest.raises(AdapterError) as err:
        _parse(tensors, name=f"bad-{case}")
    message = str(err.value)
    assert f"bad-{case}" in message, message
    for pattern in mentions:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"


# ---------------------------------------------------------------------------------------------
# The engine against transformers+PEFT on the expanded adapter (qwen3_moe, fp32, CPU)

ARCH = "qwen3_moe"  # 3 layers, hidden 64, 8 experts (top-2), moe intermediate 40


def _share(peft_dir: Path, dst: Path, factors: tuple[str, ...], num_experts: int) -> Path:
    """A PEFT target_parameters adapter with the named expert factors (gu_a, gu_b, d_a, d_b)
    made equal for every expert (expert 0's): the expanded adapter PEFT runs."""
    config, tensors = hf.read_adapter(peft_dir)
    for key, t in tensors.items():
        gate_up = ".experts.base_layer." in key
        factor = ("gu_" if gate_up else "d_") + ("a" if ".lora_A." in key else "b")
        if ".experts." not in key or factor not in factors:
            continue
        if factor.endswith("a"):  # [r*E, in]: expert e in rows e*r:(e+1)*r
            tensors[key] = t[: t.shape[0] // num_experts].repeat(num_experts, 1)
        else:  # [out, r*E]: expert e in columns e::E
            tensors[key] = t[:, ::num_experts].repeat_interleave(num_experts, dim=1)
    return hf.write_adapter(dst, config, tensors)


def _compact(expanded: Path, dst: Path, dims: hf.Dims, *, per_expert_keys: bool) -> Path:
    """The expanded adapter with each expert factor equal for all experts written once: stacked
    (SGLang's form) or, per_expert_keys, Megatron-Bridge's export of a per-expert checkpoint
    (shared factors stacked under `experts.{gate,up,down}_proj`, the rest per expert)."""
    config, tensors = hf.read_adapter(expanded)
    out = {k: t for k, t in tensors.items() if ".experts." not in k}
    num_experts = dims.num_experts
    for layer in range(dims.num_layers):
        src = f"{P}.{layer}.mlp.experts"
        for param, wrapper in [("gate_up_proj", ".base_layer"), ("down_proj", "")]:
            a, b = hf.expert_factors(
                tensors[f"{src}{wrapper}.lora_A.weight"],
                tensors[f"{src}{wrapper}.lora_B.weight"],
                num_experts,
            )
            a, b = (t[:1] if bool((t == t[:1]).all()) else t for t in (a, b))
            if not per_expert_keys:
                out[f"{src}.{param}.lora_A.weight"] = a.clone()
                out[f"{src}.{param}.lora_B.weight"] = b.clone()
                continue
            halves = [("gate_proj", b[:, : b.shape[1] // 2]), ("up_proj", b[:, b.shape[1] // 2 :])]
            for proj, b_proj in halves if param == "gate_up_proj" else [(param, b)]:
                for factor, t in [("A", a), ("B", b_proj)]:
                    if len(t) == 1:
                        out[f"{src}.{proj}.lora_{factor}.weight"] = t.clone()
                    for e in range(len(t) if len(t) > 1 else 0):
                        out[f"{src}.{e}.{proj}.lora_{factor}.weight"] = t[e].clone()
    alpha = dict(config.get("alpha_pattern") or {})
    if per_expert_keys and "gate_up_proj" in alpha:
        alpha |= {"gate_proj": alpha["gate_up_proj"], "up_proj": alpha.pop("gate_up_proj")}
    config = {**config, "target_parameters": None, "alpha_pattern": alpha}
    config["target_modules"] = sorted(config["target_modules"] + ["gate_up_proj", "down_proj"])
    return hf.write_adapter(dst, config, out)


def _adapters(bank: FixtureBank) -> tuple[dict[str, Path], dict[str, Path]]:
    """(compact adapters, the expanded PEFT adapter each equals): shared-outer (stacked, and on
    per-expert keys), fully shared, and shared-outer with expert ranks of r / top_k via
    rank_pattern and an alpha_pattern ("LoRA Without Regret")."""
    model = bank.model(ARCH)
    dims = hf.read_dims(model)

    def peft(name: str, **kwargs) -> Path:
        kwargs = {"seed": 71, "rank": 8, "alpha": 16, **kwargs}
        return bank.adapter(
            f"formats-peft-{name}",
            lambda p: hf.make_peft_adapter(
                model, p, targets=["q_proj", "v_proj"], target_parameters=hf.EXPERT_PARAMS, **kwargs
            ),
        )

    def expanded(name: str, src: Path, factors: tuple[str, ...]) -> Path:
        return bank.adapter(f"formats-{name}", lambda p: _share(src, p, factors, dims.num_experts))

    def compact(name: str, src: Path, *, per_expert_keys: bool = False) -> Path:
        return bank.adapter(
            f"formats-{name}-compact",
            lambda p: _compact(src, p, dims, per_expert_keys=per_expert_keys),
        )

    patterns = dict(
        rank_pattern={"gate_up_proj": 4, "down_proj": 4}, alpha_pattern={"down_proj": 5}
    )
    ref = {
        "outer": expanded("outer", peft("a"), ("gu_a", "d_b")),
        "full": expanded("full", peft("b", seed=72), ("gu_a", "gu_b", "d_a", "d_b")),
        "pattern": expanded("pattern", peft("c", seed=73, **patterns), ("gu_a", "d_b")),
    }
    loras = {
        "outer": compact("outer", ref["outer"]),
        "outer-megatron": compact("outer-megatron", ref["outer"], per_expert_keys=True),
        "full": compact("full", ref["full"]),
        "pattern": compact("pattern", ref["pattern"]),
    }
    return loras, {**ref, "outer-megatron": ref["outer"]}


def test_engine_equals_peft_on_the_expanded_adapter(bank: FixtureBank) -> None:
    from moelora.lora.adapter import load_adapter

    model = bank.model(ARCH)
    dims = hf.read_dims(model)
    loras, ref = _adapters(bank)
    _, stacked = hf.read_adapter(loras["outer"])
    n_e = dims.num_experts
    assert stacked[f"{P}.0.mlp.experts.gate_up_proj.lora_A.weight"].shape == (1, 8, 64)
    assert stacked[f"{P}.0.mlp.experts.down_proj.lora_B.weight"].shape == (1, 64, 8)
    assert stacked[f"{P}.0.mlp.experts.down_proj.lora_A.weight"].shape == (n_e, 8, 40)
    _, stacked = hf.read_adapter(loras["pattern"])  # experts at rank 4 = 8 / top-2
    assert stacked[f"{P}.0.mlp.experts.down_proj.lora_A.weight"].shape == (n_e, 4, 40)

    llm = make_llm(bank, model, loras)
    # the compact forms parse to the very slots of the expanded one, shared factors recognized
    targets = llm.engine.lora_targets
    for name, path in loras.items():
        got, want = (
            load_adapter(name, str(p), targets, max_rank=16, dtype=torch.float32)
            for p in (path, ref[name])
        )
        _assert_same(got, want)
        assert len(want.shared) == dims.num_layers * (4 if name == "full" else 2), want.shared

    names = [n for n in loras for _ in range(2)] + [None]
    prompts = [hf.PROMPTS[i % len(hf.PROMPTS)] for i in range(len(names))]
    refs = bank.reference(model, prompts, [ref[n] if n else None for n in names])
    assert_matches(bank, run(llm, prompts, names), refs, prompts, "shared expert factors")
    base = bank.reference(model, prompts[:2], [None] * 2)
    assert all(r.tokens != b.tokens for r, b in zip(refs[:2], base))  # the adapters do matter
