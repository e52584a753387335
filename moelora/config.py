"""The configs everything is built from: EngineConfig (what the user asks for, validated once and
resolved before anything is built) and ModelConfig (the architecture facts the shared layers
need, read once from a Hugging Face config by models/)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from moelora.errors import ConfigError

# EngineConfig.projections: how the dense projections are computed on CUDA (kernels/linear.py)
PROJECTIONS = ("batch-invariant", "skinny", "cublas")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 64
    enable_lora: bool = True
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # prefill token budget of one step (chunked prefill)
    page_size: int = 16
    num_pages: int | None = None  # None: from gpu_memory_utilization (or a CPU budget)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_graph_bs: int = 256
    force_reference_kernels: bool = False  # run the torch references on CUDA too (debugging)
    # How the dense projections are computed on CUDA (kernels/linear.py):
    # - "batch-invariant": a request's logits do not depend on its batch-mates (a tensor-core
    #   kernel, and cuBLAS where it was measured to give the same bits: from 128 rows, and
    #   between 17 and 127 per projection shape);
    # - "skinny": a GEMV at 1 to 8 rows, fastest at one token, but a request's bf16 logits then
    #   move by a rounding with its batch size, which can flip a near-tied expert choice;
    # - "cublas": cuBLAS throughout (it splits K at some decode sizes: not batch-invariant).
    projections: str = "batch-invariant"
    load_format: str = "auto"  # "dummy": random weights built on the device, no checkpoint read
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, "max_loras", self.max_loras, "an integer >= 1")
        _check(
            self.projections in PROJECTIONS,
            "projections",
            self.projections,
            f"one of {', '.join(PROJECTIONS)}",
        )
        _check(self.max_lora_rank >= 1, "max_lora_rank", self.max_lora_rank, "an integer >= 1")
        _check(
            self.dtype == "auto" or self.dtype in _DTYPES,
            "dtype",
            self.dtype,
            f"'auto' or one of {sorted(_DTYPES)}",
        )
        _check(
            self.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            self.device,
            "'auto', 'cpu' or 'cuda[:N]'",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            self.max_model_len,
            "None or an integer >= 1",
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "an integer >= 1")
        _check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "an integer >= 1",
        )
        _check(self.page_size >= 1, "page_size", self.page_size, "an integer >= 1")
        _check(
            self.num_pages is None or self.num_pages >= 1,
            "num_pages",
            self.num_pages,
            "None or an integer >= 1",
        )
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "a number in (0, 1]",
        )
        _check(self.max_graph_bs >= 1, "max_graph_bs", self.max_graph_bs, "an integer >= 1")
        _check(
            self.load_format in ("auto", "dummy"),
            "load_format",
            self.load_format,
            "'auto' or 'dummy'",
        )
        for name in self.lora_modules:
            _check(
                bool(name) and name != self.model_name,
                "lora_modules name",
                name,
                "a non-empty name that differs from the base model's",
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def resolved(self) -> EngineConfig:
        """'auto' replaced by concrete values; called once before the engine is built."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available on this machine")
        if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
            raise ConfigError(
                f"device={device!r} is invalid: this machine has {torch.cuda.device_count()} "
                f"CUDA devices, expected cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
            )
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        return dataclasses.replace(self, device=device, dtype=dtype)

    @property
    def torch_device(self) -> torch.device:
        assert self.device != "auto", "resolve the config first"
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype != "auto", "resolve the config first"
        return _DTYPES[self.dtype]


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: str  # "none" | "head" (per-head RMSNorm, Qwen3) | "full" (over all heads, OLMoE)
    clip_qkv: float | None
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool
    scoring: str  # "softmax" | "sigmoid"
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    intermediate_size: int  # of dense layers
    shared_expert_intermediate_size: int  # 0 = no shared expert
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
