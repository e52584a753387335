"""PEFT adapter folders -> LoraAdapter: host tensors already in the slot layout, validated.

Accepted key forms (after 'base_model.model.' and Mixtral's aliases are folded):
  model.layers.L.self_attn.{q,k,v,o}_proj                  attention
  model.layers.L.self_attn.{q_a_proj,kv_a_proj_with_mqa,q_b_proj,kv_b_proj}
                                                           MLA (DeepSeek; q_proj, o_proj above)
  model.layers.L.linear_attn.{in_proj_qkvz,in_proj_ba,out_proj}
                                                           gated DeltaNet (Qwen3-Next; Qwen3.5:
                                                           in_proj_{qkv,z,b,a}); q_proj of a
                                                           gated attention holds its gate too
  model.layers.L.mlp.{gate,up,down}_proj                   dense MLP layer
  model.layers.L.mlp.shared_expert.{gate,up,down}_proj     Qwen2-MoE shared expert
                                                           (DeepSeek's, GLM's: shared_experts)
  model.layers.L.mlp.experts.E.{gate,up,down}_proj         one expert (Mixtral: w1, w3, w2)
  model.layers.L.mlp.experts[.base_layer]                  PEFT target_parameters on the 3D
      expert weights: A [r*E, in] holds expert e in rows e*r:(e+1)*r; B [out, r*E] holds it in
      columns e::E (interleaved). gate_up and down are told apart by their shapes. GPT-OSS's
      gate_up_proj is [E, H, 2I] with gate and up alternating, and PEFT's B rows alternate alike.
  model.layers.L.mlp.experts.E.gate_up_proj                one expert's fused gate_up: one A
      [r, H] serves gate and up, B [2I, r] in the checkpoint's gate_up row order
  model.layers.L.mlp.experts.{gate_up,gate,up,down}_proj   a factor stacked over the experts, no
      expert index (SGLang, Megatron-Bridge; Mixtral: w1, w3, w2): A [1 | E, r, in], B
      [1 | E, out, r]. A leading 1 is one factor shared by every expert (shared-outer: gate_up's
      A and down's B; fully shared: all four); its partner may be on the per-expert keys. Each
      expert gets the shared factor (_expand_expert_factors).
A factor equal for every expert, in whatever form (PEFT's forms hold such a factor once per
expert), is listed in LoraAdapter.shared.
Everything else is refused with an AdapterError naming the adapter, the key and the mismatch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelora.errors import AdapterError
from moelora.lora.arena import FactorPlace, RegionLayout, pack, region_layout
from moelora.lora.slots import LoraTarget
from moelora.models.loader import LINEAR_IN, canonical_name

_PREFIX = "base_model.model."
_ATTN = re.compile(r"^layers\.(\d+)\.self_attn\.([qkvo])_proj$")
_MLA = re.compile(r"^layers\.(\d+)\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|kv_b_proj)$")
# an MLA projection's target (layers/mla.py) and output slice there
_MLA_TARGET = {
    "q_a_proj": ("qkv", 0),
    "kv_a_proj_with_mqa": ("qkv", 1),
    "q_b_proj": ("q_b", 0),
    "kv_b_proj": ("kv_b", 0),
}
# gated DeltaNet (layers/linear_attention.py): the input projections are slices of its
# in_proj target (models/loader.LINEAR_IN), out_proj its out_proj target
_LINEAR = re.compile(r"^layers\.(\d+)\.linear_attn\.(in_proj_[a-z]+|out_proj)$")
_DENSE = re.compile(r"^layers\.(\d+)\.mlp\.(shared_expert\.)?(gate|up|down)_proj$")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up|gate|up|down)_proj$")
_EXPERTS_3D = re.compile(r"^layers\.(\d+)\.mlp\.experts(\.base_layer)*$")
# a factor stacked over experts on a key without an expert index (SGLang, Megatron-Bridge)
_EXPERTS_STACKED = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj|w1|w3|w2)$"
)
_REFUSED_TARGETS = ("embed_tokens", "lm_head")
# which output slice of gate|up (or down) a proj is; None: one A serves both (a fused gate_up)
_SLICE_OF = {"gate": 0, "up": 1, "down": 0, "gate_up": None}


@dataclass(frozen=True)
class ModuleLora:
    a: torch.Tensor  # [n, r, in] or [E, n, r, in]
    b: torch.Tensor  # [out, r] or [E, out, r]; per-module scaling / adapter scaling folded in


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank of any module: the slot's rank
    scaling: float  # the slot's scaling
    modules: dict[str, ModuleLora]  # LoraTarget.key -> weights
    # (target key, "a" | "b") of each expert factor that is the same for every expert
    # (shared-outer and fully-shared adapters, in any of their forms); modules still hold it
    # once per expert
    shared: frozenset[tuple[str, str]] = frozenset()
    # the modules packed in one page-locked buffer in their arena region's layout
    # (lora/arena.py; the modules are views of it): what one fill copies. None: not packed
    packed: torch.Tensor | None = None

    def pinned(self) -> LoraAdapter:
        """The adapter packed into one page-locked buffer (`packed`, the modules views of it),
        which a slot fill copies asynchronously, at the full host-to-device bandwidth and in
        one copy. An adapter on the device, already packed, or whose tensors are all
        page-locked already is returned as it is (names registered over the same page-locked
        tensors share them, as before packing: a fill then copies factor by factor)."""
        factors = [t for m in self.modules.values() for t in (m.a, m.b)]
        if self.packed is not None or any(t.device.type != "cpu" for t in factors):
            return self
        if factors and all(t.is_pinned() for t in factors):
            return self
        layout = self.layout()
        if not layout.places:
            return self
        dtype = next(iter(self.modules.values())).a.dtype
        packed = pack(self.modules, layout, dtype, pin=True)
        modules = {key: _view(packed, m, layout.places[key]) for key, m in self.modules.items()}
        return dataclasses.replace(self, modules=modules, packed=packed)

    def layout(self) -> RegionLayout:
        """Where its modules sit in its arena region (in module order; shared factors once)."""
        return region_layout(self.modules, self.shared, self.modules)

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors as held on the GPU (what a slot fill copies): a factor
        shared by every expert counts once."""
        if self.packed is not None:
            return self.packed.nbytes
        elem = next((m.a.element_size() for m in self.modules.values()), 0)
        return self.layout().size * elem


def _view(packed: torch.Tensor, m: ModuleLora, p: FactorPlace) -> ModuleLora:
    """m's factors as views of the packed buffer (a shared factor: one copy, expanded)."""
    experts = m.a.ndim == 4

    def factor(t: torch.Tensor, off: int, expert_stride: int) -> torch.Tensor:
        if experts and not expert_stride:
            return packed[off : off + t[0].numel()].view(1, *t.shape[1:]).expand(t.shape)
        return packed[off : off + t.numel()].view(t.shape)

    return ModuleLora(factor(m.a, p.a_off, p.a_expert), factor(m.b, p.b_off, p.b_expert))


@dataclass(frozen=True)
class _Piece:
    """One PEFT (A, B) pair placed into a target: slice index, expert (None = all/dense)."""

    target: str
    slice_index: int | None  # None: the pair covers every slice with one A (3D gate_up)
    expert: int | None
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    key: str


def load_adapter(
    name: str,
    path: str,
    targets: dict[str, LoraTarget],
    *,
    max_rank: int,
    dtype: torch.dtype,
    meta: bool = False,
) -> LoraAdapter:
    """The PEFT adapter folder `path` (adapter_config.json, adapter_model.safetensors or .bin).
    meta=True reads no tensor data, only the weights file's header: the adapter comes back on
    meta tensors (its layout, rank, scaling and nbytes), refused exactly as a full load is."""
    cfg = _read_config(name, path)
    return _parse(name, path, cfg, _read_tensors(name, path, meta), targets, max_rank, dtype)


def adapter_from_tensors(
    name: str,
    tensors: dict[str, torch.Tensor],
    peft_config: dict,
    targets: dict[str, LoraTarget],
    *,
    max_rank: int,
    dtype: torch.dtype,
) -> LoraAdapter:
    """An adapter from a PEFT state dict and its adapter_config as a dict, no folder (a trainer's
    weights, in memory): checked and laid out as load_adapter does the folder's. The tensors
    are copied, so the trainer may go on changing its own."""
    if not isinstance(peft_config, dict):
        raise AdapterError(
            f"adapter {name!r}: peft_config is a {type(peft_config).__name__}, expected a dict "
            "(adapter_config.json's contents; LoraConfig.to_dict() gives one)"
        )
    bad = [k for k, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise AdapterError(f"adapter {name!r}: key {bad[0]!r} is not a tensor")
    cpu = {k: t.detach().to("cpu") for k, t in tensors.items()}
    cfg = _check_config(name, dict(peft_config), "peft_config")
    return _parse(name, "<tensors>", cfg, cpu, targets, max_rank, dtype)


def _parse(
    name: str,
    path: str,
    cfg: dict,
    tensors: dict[str, torch.Tensor],
    targets: dict[str, LoraTarget],
    max_rank: int,
    dtype: torch.dtype,
) -> LoraAdapter:
    tensors, labels = _expand_expert_factors(name, tensors, targets)
    placer = _Placer(name, cfg, targets, labels)
    pieces = [p for key, (a, b) in _pairs(name, tensors).items() for p in placer.place(key, a, b)]
    if not pieces:
        raise AdapterError(f"adapter {name!r} ({path}): no LoRA weights found")
    rank = max(p.a.shape[0] for p in pieces)
    if rank > max_rank:
        worst = max(pieces, key=lambda p: p.a.shape[0])
        raise AdapterError(
            f"adapter {name!r}: key {placer.where(worst.key)} has rank {rank}, expected at most "
            f"max_lora_rank={max_rank}"
        )
    scaling = _scale(cfg, cfg.get("lora_alpha", cfg.get("r", 8)), cfg.get("r", rank)) or 1.0
    modules = _assemble(pieces, targets, rank, scaling, dtype)
    return LoraAdapter(name, path, rank, scaling, modules, _shared_factors(modules, targets))


def _read_config(name: str, path: str) -> dict:
    cfg_file = Path(path) / "adapter_config.json"
    if not Path(path).is_dir():
        raise AdapterError(f"adapter {name!r}: folder {path!r} does not exist")
    if not cfg_file.exists():
        raise AdapterError(f"adapter {name!r}: {cfg_file} is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"adapter {name!r}: {cfg_file} is not valid JSON: {e}") from e
    return _check_config(name, cfg, str(cfg_file))


def _check_config(name: str, cfg: object, where: str) -> dict:
    """What of a PEFT config the engine can serve; where: the file or argument it came from."""
    if not isinstance(cfg, dict):
        raise AdapterError(
            f"adapter {name!r}: {where} holds a {type(cfg).__name__}, expected an object"
        )
    checks = [
        (
            cfg.get("peft_type", "LORA").upper() == "LORA",
            "peft_type",
            cfg.get("peft_type"),
            "'LORA'",
        ),
        (not cfg.get("use_dora"), "use_dora", cfg.get("use_dora"), "false (DoRA is not supported)"),
        (
            cfg.get("bias", "none") == "none",
            "bias",
            cfg.get("bias"),
            "'none' (LoRA bias is not supported)",
        ),
        (
            not cfg.get("modules_to_save"),
            "modules_to_save",
            cfg.get("modules_to_save"),
            "none (fully trained modules are not supported)",
        ),
    ]
    for ok, option, found, expected in checks:
        if not ok:
            raise AdapterError(f"adapter {name!r}: option {option}={found!r}, expected {expected}")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    for t in targets:
        if any(r in t for r in _REFUSED_TARGETS):
            raise AdapterError(
                f"adapter {name!r}: target_modules has {t!r}, expected no embedding or lm_head "
                "targets"
            )
    return cfg


def _read_tensors(name: str, path: str, meta: bool = False) -> dict[str, torch.Tensor]:
    st, binf = Path(path) / "adapter_model.safetensors", Path(path) / "adapter_model.bin"
    if st.exists():
        from safetensors.torch import load_file

        return _header_tensors(st) if meta else load_file(str(st))
    if binf.exists():
        # on the meta device torch.load unpickles the keys and shapes but reads no storage
        device = "meta" if meta else "cpu"
        return torch.load(str(binf), map_location=device, weights_only=True)
    raise AdapterError(f"adapter {name!r}: {st} (or adapter_model.bin) is missing")


def _header_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as meta tensors of their shapes and dtypes, from its header."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            s = f.get_slice(key)
            shape, dtype = s.get_shape(), _SAFETENSORS_DTYPES.get(s.get_dtype())
            if dtype is None:  # a rarer one: an empty slice has it (a scalar reads itself)
                dtype = (s[:0] if shape else s[...]).dtype
            tensors[key] = torch.empty(shape, dtype=dtype, device="meta")
    return tensors


# safetensors' names of the common dtypes (naming one costs less than reading an empty slice)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _expand_expert_factors(
    name: str, tensors: dict[str, torch.Tensor], targets: dict[str, LoraTarget]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Factors stacked over the experts on a key without an expert index -> PEFT's per-expert
    keys: `mlp.experts.P.lora_A.weight` [1 | E, r, in] and `.lora_B.weight` [1 | E, out, r] (P:
    gate_up_proj, gate_proj, up_proj, down_proj) become `mlp.experts.{e}.P.lora_*` [r, in] /
    [out, r]. A leading dim of 1 is one factor shared by every expert: each expert gets a view
    of it. A factor's partner may sit on the per-expert keys instead (Megatron-Bridge's
    shared-outer export of a per-expert checkpoint).

    This is the one place a shared factor is expanded (keeping it compact on the GPU replaces
    it). Returns the tensors and, for each per-expert module made here, how errors name it.
    """
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, tuple[str, torch.Tensor]] = {}  # key -> (layer, tensor)
    for key, t in tensors.items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        m = _EXPERTS_STACKED.match(canonical_name(module))
        if m and kind in ("A.weight", "B.weight"):
            stacked[key] = (m.group(1), t)
        else:
            out[key] = t
    made: dict[str, tuple[str, int]] = {}  # per-expert key -> (stacked key, expert)
    for key, (layer, t) in stacked.items():
        target = targets.get(f"layers.{layer}.experts13")
        if target is None:
            raise AdapterError(
                f"adapter {name!r}: key {_module(key)!r} matches no module of the model"
            )
        E = target.num_experts
        if t.ndim != 3 or t.shape[0] not in (1, E):
            raise AdapterError(
                f"adapter {name!r}: key {key!r} has shape {tuple(t.shape)}, expected [1, ...] "
                f"(one factor shared by all {E} experts) or [{E}, ...] (one per expert)"
            )
        head, _, tail = key.rpartition(".experts.")
        for e in range(E):
            expert_key = f"{head}.experts.{e}.{tail}"
            if expert_key in out:
                raise AdapterError(
                    f"adapter {name!r}: keys {key!r} and {expert_key!r} both hold expert {e}'s "
                    f"{_factor(key)}, expected only one of them"
                )
            out[expert_key] = t[0 if len(t) == 1 else e]
            made[expert_key] = (key, e)
    return out, _made_labels(name, out, made)


def _made_labels(
    name: str, tensors: dict[str, torch.Tensor], made: dict[str, tuple[str, int]]
) -> dict[str, str]:
    """How errors name each per-expert module _expand_expert_factors made (the stacked key its
    factors came from); a made factor without its partner is refused here, by that key."""
    labels = {}
    for expert_key, (key, e) in made.items():
        partner, stacked_partner = _partner(expert_key), _partner(key)
        if partner not in tensors:
            raise AdapterError(
                f"adapter {name!r}: key {key!r} has no {_factor(partner)} for expert {e}, "
                f"expected {stacked_partner!r} or {partner!r}"
            )
        module = _module(expert_key)
        if made.get(partner, ("",))[0] == stacked_partner:
            labels[module] = f"{_module(key)!r} (expert {e})"
        else:
            labels[module] = f"{module!r} ({_factor(key)} from {key!r})"
    return labels


def _module(key: str) -> str:
    """PEFT's module name of a lora_A / lora_B key."""
    return key.removeprefix(_PREFIX).rpartition(".lora_")[0]


def _factor(key: str) -> str:
    """'lora_A' or 'lora_B'."""
    return "lora_" + key.rpartition(".lora_")[2][0]


def _partner(key: str) -> str:
    """The lora_B key of a lora_A key, and the other way round."""
    stem, _, kind = key.rpartition(".lora_")
    return f"{stem}.lora_{'B' if kind.startswith('A') else 'A'}.weight"


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """PEFT module key -> (A, B); any other tensor is refused."""
    a_of, b_of = {}, {}
    for key, t in tensors.items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind == "A.weight":
            a_of[module] = t
        elif kind == "B.weight":
            b_of[module] = t
        else:
            what = "LoRA bias" if kind == "B.bias" else "DoRA/embedding/other weights"
            raise AdapterError(
                f"adapter {name!r}: key {key!r} is {what}, expected only lora_A/lora_B weights"
            )
    for module in set(a_of) ^ set(b_of):
        raise AdapterError(f"adapter {name!r}: key {module!r} lacks its lora_A or lora_B weight")
    return {m: (a_of[m], b_of[m]) for m in a_of}


@dataclass(frozen=True)
class _Placer:
    """Places one adapter's PEFT (A, B) pairs onto the model's LoRA targets."""

    name: str
    cfg: dict
    targets: dict[str, LoraTarget]
    labels: dict[str, str] = field(default_factory=dict)  # module key -> how errors name it

    def place(self, key: str, a: torch.Tensor, b: torch.Tensor) -> list[_Piece]:
        """key is PEFT's module name (also what rank/alpha patterns match against)."""
        canon = canonical_name(key)
        if any(r in canon for r in _REFUSED_TARGETS):
            raise self.error(
                key,
                "targets an embedding or lm_head, expected attention, MLP or expert projections",
            )
        if m := _ATTN.match(canon):
            layer, proj = m.group(1), m.group(2)
            tkey = f"layers.{layer}.{'o' if proj == 'o' else 'qkv'}"
            return [self.piece(key, a, b, tkey, 0 if proj == "o" else "qkv".index(proj))]
        if m := _MLA.match(canon):
            target, index = _MLA_TARGET[m.group(2)]
            return [self.piece(key, a, b, f"layers.{m.group(1)}.{target}", index)]
        if m := _LINEAR.match(canon):
            return [self.linear_piece(key, a, b, m.group(1), m.group(2))]
        if m := _DENSE.match(canon):
            layer, shared, proj = m.group(1), m.group(2), m.group(3)
            base = "shared" if shared else "mlp"
            tkey = f"layers.{layer}.{base}.{'down' if proj == 'down' else 'gate_up'}"
            return [self.piece(key, a, b, tkey, _SLICE_OF[proj])]
        if m := _EXPERT.match(canon):
            layer, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            tkey = f"layers.{layer}.experts{'2' if proj == 'down' else '13'}"
            return [self.piece(key, a, b, tkey, _SLICE_OF[proj], expert)]
        if m := _EXPERTS_3D.match(canon):
            return self.experts_3d(key, a, b, m.group(1))
        raise self.error(key, "matches no module of the model")

    def piece(self, key, a, b, tkey: str, index: int | None, expert: int | None = None) -> _Piece:
        """index None: a fused gate_up, one A for both slices and B over all of them."""
        t = self.targets.get(tkey)
        if t is None or (expert is not None and expert >= t.num_experts):
            raise self.error(key, "matches no module of the model")
        r = a.shape[0]
        out = t.out_features if index is None else t.out_slices[index]
        want_a, want_b = (r, t.in_features), (out, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise self.error(
                key,
                f"has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                f"expected {want_a} / {want_b}",
            )
        if index is None:
            b = _b_rows(t, b)
        return _Piece(tkey, index, expert, a, b, _module_scale(self.cfg, key, r), key)

    def linear_piece(self, key, a, b, layer: str, proj: str) -> _Piece:
        """A gated DeltaNet projection: out_proj, or the slice of in_proj that proj is in this
        model's layout (Qwen3-Next's two grouped projections or Qwen3.5's four)."""
        if proj == "out_proj":
            return self.piece(key, a, b, f"layers.{layer}.out_proj", 0)
        target = self.targets.get(f"layers.{layer}.in_proj")
        grouped = target is not None and len(target.out_slices) == 2
        index = LINEAR_IN[grouped].get(proj) if target is not None else None
        if index is None:
            raise self.error(key, "matches no module of the model")
        return self.piece(key, a, b, f"layers.{layer}.in_proj", index)

    def experts_3d(self, key, a, b, layer: str) -> list[_Piece]:
        """target_parameters on mlp.experts: gate_up (A [rE, H], B [2I, rE]) or down (A [rE, I],
        B [H, rE]); the shapes tell which (H != I, or 2I != H, always holds one way)."""
        t13 = self.targets.get(f"layers.{layer}.experts13")
        t2 = self.targets.get(f"layers.{layer}.experts2")
        if t13 is None:
            raise self.error(key, "matches no module of the model")
        E = t13.num_experts
        for t, param in ((t13, "gate_up_proj"), (t2, "down_proj")):
            r = a.shape[0] // E
            fits = a.shape[1] == t.in_features and b.shape[0] == t.out_features
            if fits and a.shape[0] == r * E and b.shape[1] == r * E:
                # rank/alpha patterns name the parameter, as PEFT's target_parameters do
                scale = _module_scale(
                    self.cfg, re.sub(r"(\.base_layer)+$", "", key) + "." + param, r
                )
                index = None if t is t13 else 0  # gate_up: one A serves both slices
                # expert e: rows e*r:(e+1)*r of A, but columns e::E of B (PEFT interleaves B)
                return [
                    _Piece(
                        t.key, index, e, a[e * r : (e + 1) * r], _b_rows(t, b[:, e::E]), scale, key
                    )
                    for e in range(E)
                ]
        H, I = t13.in_features, t2.in_features
        raise self.error(
            key,
            f"has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected gate_up "
            f"([r*{E}, {H}] / [{2 * I}, r*{E}]) or down ([r*{E}, {I}] / [{H}, r*{E}])",
        )

    def where(self, key: str) -> str:
        """How an error names module `key`: the key, or the stacked key it was made from."""
        return self.labels.get(key, repr(key))

    def error(self, key: str, what: str) -> AdapterError:
        return AdapterError(f"adapter {self.name!r}: key {self.where(key)} {what}")


def _b_rows(t: LoraTarget, b: torch.Tensor) -> torch.Tensor:
    """One expert's B [out, r] in the slot's row order: where the checkpoint alternates gate and
    up rows (GPT-OSS's gate_up_proj columns), the gate rows first, then the up rows."""
    if not t.gate_up_interleaved:
        return b
    return torch.cat([b[0::2], b[1::2]])


def _module_scale(cfg: dict, peft_key: str, r: int) -> float:
    alpha = cfg.get("lora_alpha", 8)
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", peft_key):
            alpha = value
            break
    return _scale(cfg, alpha, r)


def _scale(cfg: dict, alpha: float, r: int) -> float:
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _assemble(pieces, targets, rank, scaling, dtype) -> dict[str, ModuleLora]:
    """Tensors per target at the target's own rank (the largest of its pieces: rank_pattern
    may give q and k, or gate and up, different ranks), zero-padded there, module scaling
    folded into B."""
    modules: dict[str, ModuleLora] = {}
    own_rank: dict[str, int] = {}
    for p in pieces:
        own_rank[p.target] = max(own_rank.get(p.target, 0), p.a.shape[0])
    for p in pieces:
        t = targets[p.target]
        if p.target not in modules:
            experts = (t.num_experts,) if t.num_experts else ()
            r = own_rank[p.target]
            modules[p.target] = ModuleLora(
                # on the meta device when the pieces are (a folder checked by its header)
                torch.zeros(*experts, len(t.out_slices), r, t.in_features, device=p.a.device),
                torch.zeros(*experts, t.out_features, r, device=p.a.device),
            )
        if p.a.is_meta:
            continue  # no values to place: the layout is all a header gives
        m = modules[p.target]
        a = m.a if p.expert is None else m.a[p.expert]
        b = m.b if p.expert is None else m.b[p.expert]
        r = p.a.shape[0]
        slices = range(len(t.out_slices)) if p.slice_index is None else [p.slice_index]
        for i in slices:
            a[i, :r] = p.a.float()
        if p.slice_index is None:
            b[:, :r] = p.b.float() * (p.scale / scaling)
        else:
            start = sum(t.out_slices[: p.slice_index])
            stop = start + t.out_slices[p.slice_index]
            b[start:stop, :r] = p.b.float() * (p.scale / scaling)
    return {k: ModuleLora(m.a.to(dtype), m.b.to(dtype)) for k, m in modules.items()}


def _shared_factors(
    modules: dict[str, ModuleLora], targets: dict[str, LoraTarget]
) -> frozenset[tuple[str, str]]:
    """LoraAdapter.shared: the expert factors equal for every expert, whatever form the file
    had. The compare stops at the first expert that differs: a per-expert factor costs one."""
    shared = set()
    for key, m in modules.items():
        for factor, t in (("a", m.a), ("b", m.b)):
            # meta tensors (a folder checked without reading its data) have no values to compare
            if targets[key].num_experts < 2 or t.is_meta:
                continue
            if all(torch.equal(t[e], t[0]) for e in range(1, len(t))):
                shared.add((key, factor))
    return frozenset(shared)


def random_adapter(
    name: str,
    targets: dict[str, LoraTarget],
    *,
    rank: int,
    seed: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scaling: float = 2.0,
    store: torch.device | str | None = None,
) -> LoraAdapter:
    """An adapter with random weights of a sensible scale on every target (Engine.lora_targets),
    drawn on `device` and kept on `store` (default: `device`): what benchmarks register with
    Engine.add_adapter. A ~ N(0, 1/in), B ~ N(0, 0.01^2), so every delta is nonzero and small."""
    gen = torch.Generator(device=device).manual_seed(seed)
    store = device if store is None else store
    modules = {}
    for key, t in targets.items():
        experts = (t.num_experts,) if t.num_experts else ()
        a = torch.randn(
            *experts, len(t.out_slices), rank, t.in_features, generator=gen, device=device
        )
        b = torch.randn(*experts, t.out_features, rank, generator=gen, device=device)
        modules[key] = ModuleLora(
            (a / t.in_features**0.5).to(dtype).to(store), (b * 0.01).to(dtype).to(store)
        )
    return LoraAdapter(name, "<random>", rank, scaling, modules)
