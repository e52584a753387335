"""Both kernel tables keep the Ops contract: each kernel field is typed with a Protocol
(kernels/contracts.py), and the reference and the Triton entry both take the parameters its
__call__ declares, with the same names, kinds, defaults and annotations. A Triton entry may add
the tuning keywords TUNING names (keyword-only, with a default): no layer passes them."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable

import pytest
import torch

from moelora.config import PREFILL_ATTENTION_BACKENDS, PROJECTIONS
from moelora.kernels.contracts import RmsNormOp
from moelora.kernels.ops import REFERENCE_OPS, Ops, triton_ops

KERNELS = [f.name for f in dataclasses.fields(Ops) if callable(getattr(REFERENCE_OPS, f.name))]
# "deterministic": triton_ops binds it from EngineConfig.enable_deterministic_inference
TUNING = {
    "fused_moe": {"config", "deterministic"},  # MoeConfig tiles: tests and tune_moe sweep them
    "add_lora_": {"tiles"},  # bench/lora_tiles.py sweeps them
    "linear_fp8": {"config"},  # DotConfig tiles: its tests pick them
    # dense_from: triton_ops binds it from prefill_attention_backend
    "paged_attention": {"dense_from", "deterministic"},
    "paged_attention_o_shrink": {"dense_from", "deterministic"},
    "plan_attention": {"deterministic"},
    "gated_delta_rule": {"chunked"},  # make_ops binds it from linear_attention_prefill
}
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def contract_of(cls: type, field: str) -> type:
    return typing.get_type_hints(cls)[field]


def untyped_fields(cls: type, fields: list[str]) -> list[str]:
    """The fields of dataclass cls whose type is not a Protocol (a bare Callable, say)."""
    return [f for f in fields if typing.Protocol not in getattr(contract_of(cls, f), "__mro__", ())]


def breaches(fn: Callable, contract: type, tuning: set[str] = frozenset()) -> list[str]:
    """How fn's signature (a partial's after its bound keywords, an instance's __call__)
    differs from contract.__call__'s; fn may add the keyword-only, defaulted `tuning`."""
    want = list(inspect.signature(contract.__call__).parameters.values())[1:]  # less self
    have = inspect.signature(fn)
    found = []
    for p in want:
        q = have.parameters.get(p.name)
        if q is None:
            found.append(f"{p.name}: missing")
            continue
        for attr in ("kind", "default", "annotation"):
            if getattr(q, attr) != getattr(p, attr):
                found.append(f"{p.name}: {attr} {getattr(q, attr)!r}, not {getattr(p, attr)!r}")
    declared = {p.name for p in want}
    for q in have.parameters.values():
        keyword = q.kind is inspect.Parameter.KEYWORD_ONLY and q.default is not q.empty
        if q.name not in declared and not (q.name in tuning and keyword):
            found.append(f"{q.name}: not in the contract")
    order = [
        [p.name for p in ps if p.kind in POSITIONAL] for ps in (have.parameters.values(), want)
    ]
    if order[0] != order[1]:
        found.append(f"positional order {order[0]}, not {order[1]}")
    returns = inspect.signature(contract.__call__).return_annotation
    if have.return_annotation != returns:
        found.append(f"returns {have.return_annotation!r}, not {returns!r}")
    return found


def test_every_kernel_field_is_typed_with_a_protocol():
    assert KERNELS and untyped_fields(Ops, KERNELS) == []


@pytest.mark.parametrize("field", KERNELS)
def test_the_reference_keeps_the_contract(field):
    assert breaches(getattr(REFERENCE_OPS, field), contract_of(Ops, field)) == []


@pytest.mark.parametrize("backend", PREFILL_ATTENTION_BACKENDS)
@pytest.mark.parametrize("projections", PROJECTIONS)
@pytest.mark.parametrize("field", KERNELS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_triton_table_keeps_the_contract(field, projections, backend, deterministic):
    fn = getattr(triton_ops(projections, backend, deterministic=deterministic), field)
    assert breaches(fn, contract_of(Ops, field), TUNING.get(field, set())) == []


@pytest.mark.parametrize("field", sorted(TUNING))
def test_each_tuning_keyword_is_a_triton_one(field):
    """TUNING names no keyword the Triton entry has lost."""
    parameters = inspect.signature(getattr(triton_ops("batch-invariant"), field)).parameters
    assert TUNING[field] <= parameters.keys()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A function that keeps RmsNormOp's contract; BROKEN's variants each break it once."""
    return x, x


def variant(parameters: list[inspect.Parameter]) -> Callable:
    """rms_norm with other parameters (what inspect.signature reads)."""

    def fn(*args, **kwargs):
        return rms_norm(*args, **kwargs)

    fn.__signature__ = inspect.signature(rms_norm).replace(parameters=parameters)
    return fn


P = inspect.Parameter
X, WEIGHT, EPS, RESIDUAL, *SHARED = inspect.signature(rms_norm).parameters.values()
FUSED = P("fused", P.KEYWORD_ONLY, default=False, annotation="bool")
BROKEN = {
    "renamed": [X, WEIGHT, EPS, RESIDUAL.replace(name="res"), *SHARED],
    "dropped": [X, WEIGHT, EPS, *SHARED],
    "added": [X, WEIGHT, EPS, RESIDUAL, *SHARED, FUSED],
    "keyword-only": [X, WEIGHT, EPS, RESIDUAL.replace(kind=P.KEYWORD_ONLY), *SHARED],
    "other default": [X, WEIGHT, EPS, RESIDUAL.replace(default=0), *SHARED],
    "no default": [X, WEIGHT, EPS, RESIDUAL.replace(default=P.empty), *SHARED],
    "reordered": [WEIGHT, X, EPS, RESIDUAL, *SHARED],
    "retyped": [X, WEIGHT, EPS.replace(annotation="int"), RESIDUAL, *SHARED],
}


@pytest.mark.parametrize("parameters", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_signature_breaks_the_contract(parameters):
    assert breaches(rms_norm, RmsNormOp) == []
    assert breaches(variant(parameters), RmsNormOp) != []


def test_a_tuning_keyword_must_be_keyword_only_with_a_default():
    kept = [X, WEIGHT, EPS, RESIDUAL]
    assert breaches(variant([*kept, *SHARED, FUSED]), RmsNormOp, {"fused"}) == []
    no_default = FUSED.replace(default=P.empty)
    assert breaches(variant([*kept, no_default, *SHARED]), RmsNormOp, {"fused"}) != []
    positional = FUSED.replace(kind=P.POSITIONAL_OR_KEYWORD)
    assert breaches(variant([*kept, positional, *SHARED]), RmsNormOp, {"fused"}) != []


def test_a_bare_callable_field_is_untyped():
    @dataclasses.dataclass
    class Table:
        rms_norm: RmsNormOp
        linear: Callable

    assert untyped_fields(Table, ["rms_norm", "linear"]) == ["linear"]
