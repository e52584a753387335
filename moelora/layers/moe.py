"""The MLP of a decoder layer: sparse MoE (+ optional shared expert) or a dense SwiGLU MLP.

Legend: T = tokens, H = hidden, I = expert intermediate, E = experts, K = top-k.

With tensor parallelism (ops.shard) a dense MLP and a shared expert hold their slice of the
intermediate dimension; the experts hold theirs too (TP) or E/N whole experts (EP). Either way
each rank's output (its LoRA's partial expands included: down's A is split by input, B whole)
is a partial sum, all-reduced once per MLP. Routers are replicated.

With a shared expert, the three products of the MoE's input (the router, the shared expert's
gate|up, its gate) become one product of one weight once loaded (SparseMoE.fuse_inputs): one
launch a step.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.config import ModelConfig
from moelora.kernels.fp8_block import FP8_DTYPE, Fp8Weight, fp8_scale_shape
from moelora.kernels.moe.mxfp4_layout import MXFP4_GROUP, Mxfp4Weight
from moelora.kernels.ops import Ops
from moelora.layers.linear import LoraLinear
from moelora.layers.norm import Joined
from moelora.step.batch import ForwardBatch
from moelora.step.lora import FoldedLora, LoraWeights


class DenseMLP(nn.Module):
    """SwiGLU with fused gate|up; used for dense layers and for the shared expert."""

    def __init__(self, hidden: int, intermediate: int, ops: Ops, *, reduce: bool = True, **kw):
        """reduce=False: the output stays this rank's partial sum (a shared expert, which its
        MoE reduces with the experts)."""
        super().__init__()
        intermediate = ops.shard.intermediate(intermediate)
        self.shard = ops.shard if reduce else None
        self.ops = ops
        self.gate_up_proj = LoraLinear(hidden, (intermediate, intermediate), ops, **kw)
        self.down_proj = LoraLinear(intermediate, (hidden,), ops, **kw)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, folded: FoldedLora | None = None
    ) -> torch.Tensor | Joined:
        """The MLP's output [T, H]; with folded (gate_up_proj's LoRA, shrunk by the norm before:
        layers/mlp_lora.py) Joined, carrying down_proj's LoRA for the next norm to expand."""
        if folded is not None:
            out, down = self.finish_folded(self.gate_up_proj(x, None), batch, folded)
            return Joined(out, None, None, down)
        return self.finish(self.gate_up_proj(x, batch.lora), batch)

    def finish_folded(
        self, gate_up: torch.Tensor, batch: ForwardBatch, folded: FoldedLora
    ) -> tuple[torch.Tensor, FoldedLora]:
        """(down_proj's base output [T, H], its LoRA shrunk) from gate_up_proj's base output,
        its LoRA expanded in the SwiGLU's launch (one rank: layers/mlp_lora.py)."""
        h, down = self.ops.silu_and_mul_lora(
            gate_up, batch.lora, expand=folded, shrink=self.down_proj.lora
        )
        return self.down_proj(h, None), down

    def finish(self, gate_up: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The MLP from gate_up_proj's output [T, 2I] on (its LoRA included; a view of a wider
        product may come: SparseMoE's)."""
        out = self.down_proj(self.ops.silu_and_mul(gate_up), batch.lora)
        return out if self.shard is None else self.shard.all_reduce(out)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        shard = ops.shard
        H, E_all = cfg.hidden_size, cfg.num_experts
        E, I = shard.experts(E_all), shard.expert_intermediate(cfg.moe_intermediate_size)
        kw = dict(dtype=dtype, device=device)
        self.num_local_experts = E
        self.gate = nn.Parameter(torch.empty(E_all, H, **kw), requires_grad=False)  # router
        self.w13: nn.Parameter | Mxfp4Weight | Fp8Weight
        self.w2: nn.Parameter | Mxfp4Weight | Fp8Weight
        if cfg.experts_mxfp4:
            self.w13 = self._packed("w13", (E, 2 * I, H), device)
            self.w2 = self._packed("w2", (E, H, I), device)
        elif cfg.experts_fp8:
            self.w13 = self._fp8("w13", (E, 2 * I, H), device)
            self.w2 = self._fp8("w2", (E, H, I), device)
        else:
            self.w13 = nn.Parameter(torch.empty(E, 2 * I, H, **kw), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(E, H, I, **kw), requires_grad=False)
        self.gate_bias = self.w13_bias = self.w2_bias = None
        if cfg.router_bias:
            self.gate_bias = nn.Parameter(torch.empty(E_all, **kw), requires_grad=False)
        self.e_score_correction_bias = None
        if cfg.routing is not None and cfg.routing.correction_bias:
            # float32 whatever the model's dtype, as transformers keeps it: it moves the choice
            bias = torch.empty(E_all, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        if cfg.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(E, 2 * I, **kw), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(E, H, **kw), requires_grad=False)
        self.lora13: LoraWeights | None = None  # set by the slot pool when LoRA is enabled
        self.lora2: LoraWeights | None = None
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(
                H, cfg.shared_expert_intermediate_size, ops, reduce=False, **kw
            )
            if cfg.shared_expert_gate:
                gate = torch.empty(1, H, **kw)
                self.shared_expert_gate = nn.Parameter(gate, requires_grad=False)
        # the router | shared gate | shared gate_up weight, once loaded (fuse_inputs)
        self.w_in: torch.Tensor | None = None

    def _packed(self, name: str, shape: tuple[int, int, int], device) -> Mxfp4Weight:
        """MXFP4 experts of `shape` [E, N, K]: parameters NAME_blocks and NAME_scales (what the
        loader fills and counts), held together as the Mxfp4Weight the fused MoE takes."""
        E, N, K = shape
        kw = dict(dtype=torch.uint8, device=device)
        blocks = nn.Parameter(torch.empty(E, N, K // 2, **kw), requires_grad=False)
        scales = nn.Parameter(torch.empty(E, N, K // MXFP4_GROUP, **kw), requires_grad=False)
        self.register_parameter(f"{name}_blocks", blocks)
        self.register_parameter(f"{name}_scales", scales)
        return Mxfp4Weight(blocks, scales)

    def _fp8(self, name: str, shape: tuple[int, int, int], device) -> Fp8Weight:
        """Block-FP8 experts of `shape` [E, N, K]: parameters NAME_codes and NAME_scale_inv
        (what the loader fills and counts), held together as the Fp8Weight the fused MoE takes.
        One grid of scales covers w13's [2I, H], gate's rows then up's (kernels/moe/fp8.py)."""
        codes = torch.empty(shape, dtype=FP8_DTYPE, device=device)
        scales = torch.empty(fp8_scale_shape(shape), dtype=torch.float32, device=device)
        codes = nn.Parameter(codes, requires_grad=False)
        scales = nn.Parameter(scales, requires_grad=False)
        self.register_parameter(f"{name}_codes", codes)
        self.register_parameter(f"{name}_scale_inv", scales)
        return Fp8Weight(codes, scales)

    def fuse_inputs(self) -> None:
        """Once the weights are loaded, with a shared expert: one weight for the three products
        of the MoE's input, so that a step computes them in one launch: the router's rows
        [E, H], the shared expert's gate|up [2I, H], its sigmoid gate [1, H] where it has one,
        and zero rows to a multiple of 8 (each part's columns of the product then start, and
        its rows stride, at 16 bytes). The parameters become views of its rows (the same
        Parameter objects)."""
        if self.shared_expert is None or self.w_in is not None:
            return
        # no architecture has both a router bias and a shared expert, which w_in would need
        assert self.gate_bias is None, self.cfg.arch
        parts = [self.gate, self.shared_expert.gate_up_proj.weight, self.shared_expert_gate]
        parts = [p for p in parts if p is not None]
        rows = [p.shape[0] for p in parts]
        pad = parts[0].new_zeros(-sum(rows) % 8, parts[0].shape[1])
        self.w_in = torch.cat([*(p.data for p in parts), pad])
        for p, view in zip(parts, self.w_in.split([*rows, pad.shape[0]]), strict=False):
            p.data = view

    def settle_packed(self) -> None:
        """Once the MXFP4 bytes are loaded: record whether their scales are small enough for
        the fused MoE's bit-placement expansion (Mxfp4Weight.small_scales), and where its
        bfloat16 kernels will read them, rewrite the codes in place into their GPU layout
        (Mxfp4Weight.swizzle_: 11 instructions for 8 values where the release's take 16)."""
        if not isinstance(self.w13, Mxfp4Weight):
            return
        self.w13 = self.w13.with_small_scales()
        self.w2 = self.w2.with_small_scales()
        gpu = self.ops.keeps_mxfp4 and self.w13.blocks.is_cuda
        if gpu and self.gate.dtype == torch.bfloat16:
            for name in ("w13", "w2"):
                w = getattr(self, name)
                if w.small_scales and not w.swizzled:
                    w = w.swizzle_()
                    setattr(self, name, w)
                    getattr(self, f"{name}_scales").data = w.scales  # the padded rows' view

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, folded: FoldedLora | None = None
    ) -> torch.Tensor | Joined:
        """[T, H], or its top-k rows [T, K, H] for the next norm to add (reference.sum_rows),
        with a shared expert on one rank Joined, which the next norm joins too. folded: the
        shared expert's gate_up_proj LoRA, shrunk by the norm before (layers/mlp_lora.py)."""
        lora = batch.lora
        shared_in = None
        if self.w_in is not None:  # router | shared gate|up | shared gate | padding
            router_logits, *shared_in = self.ops.linear(x, self.w_in).split(self._in_sizes(), -1)
        else:
            router_logits = self.ops.linear(x, self.gate, self.gate_bias)  # [T, E]
        weights, ids = self._route(router_logits)
        if batch.routing_trace is not None:
            batch.routing_trace.append(ids.clone())
        shard = self.ops.shard
        weights, ids = shard.localize_experts(weights, ids, self.num_local_experts)
        out = self.ops.fused_moe(
            x,
            self.w13,
            self.w2,
            weights,
            ids,
            lora13=self.lora13 if lora is not None else None,
            lora2=self.lora2 if lora is not None else None,
            info=lora,
            # the top-k rows are added by the next norm, or with the shared expert; summed here
            # with several ranks, whose all-reduce would move K times the rows
            sum_topk=shard.size > 1,
            **self._expert_options(),
        )  # [T, H] or its top-k rows [T, K, H]
        if self.shared_expert is not None:
            out = self._add_shared(out, x, batch, shared_in, folded)
        return out if isinstance(out, Joined) else shard.all_reduce(out)  # Joined: one rank

    def _in_sizes(self) -> list[int]:
        """The columns of w_in's product: router logits, the shared expert's gate|up, its gate's
        logit (where it has one), the padding."""
        rows = [self.gate.shape[0], self.shared_expert.gate_up_proj.weight.shape[0]]
        rows += [] if self.shared_expert_gate is None else [1]
        return [*rows, self.w_in.shape[0] - sum(rows)]

    def _add_shared(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        batch: ForwardBatch,
        shared_in: list[torch.Tensor] | None,
        folded: FoldedLora | None = None,
    ) -> torch.Tensor | Joined:
        """The routed experts' output with the shared expert's, gated where it has a gate:
        joined here with several ranks, else by the next norm (Joined; with folded, carrying
        down_proj's LoRA shrunk).
        shared_in: w_in's product past the router (gate|up [T, 2I], [gate logit [T, 1],]
        padding); None before fuse_inputs, which then computes each on its own."""
        expert, gate = self.shared_expert, self.shared_expert_gate
        if folded is not None:
            assert shared_in is not None, "folded: layers/mlp_lora.py"
            shared, down = expert.finish_folded(shared_in[0], batch, folded)
            return Joined(out, shared, None if gate is None else shared_in[1], down)
        if shared_in is None:
            shared = expert(x, batch)
            gate_logits = None if gate is None else self.ops.linear(x, gate)  # [T, 1]
        else:
            shared = expert.finish(
                expert.gate_up_proj.add_lora_(shared_in[0], x, batch.lora), batch
            )
            gate_logits = None if gate is None else shared_in[1]
        if self.ops.shard.size > 1:  # joined before the all-reduce
            return self.ops.add_shared_expert(out, shared, gate_logits)
        return Joined(out, shared, gate_logits)

    def _route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] float32, expert ids [T, K] int32) of router_logits [T, E]."""
        cfg = self.cfg
        return self.ops.route_topk(
            router_logits,
            cfg.top_k,
            scoring=cfg.scoring,
            renormalize=cfg.renormalize,
            grouped=cfg.routing,
            correction_bias=self.e_score_correction_bias,
        )

    def _expert_options(self) -> dict:
        """fused_moe's options where this MoE differs from the plain SwiGLU without biases:
        none at all for the architectures that need none, so their launches stay as they are."""
        if self.w13_bias is None and self.cfg.activation == "silu":
            return {}
        return dict(b13=self.w13_bias, b2=self.w2_bias, activation=self.cfg.activation)
