"""The configs everything is built from: EngineConfig (what the user asks for, validated once and
resolved before anything is built) and ModelConfig (the architecture facts the shared layers
need, read once from a Hugging Face config by models/)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moelora.errors import ConfigError

# the delta-rule state is kept in float32 whatever the model's dtype, as transformers and
# fla keep it: a bfloat16 state would drift over a long sequence
STATE_DTYPE = torch.float32

# EngineConfig.projections: how the dense projections are computed on CUDA (kernels/linear.py)
PROJECTIONS = ("auto", "batch-invariant", "skinny", "cublas")
# EngineConfig.prefill_attention_backend: who attends long first prefill chunks on CUDA
PREFILL_ATTENTION_BACKENDS = ("cudnn", "triton")
# EngineConfig.mla_prefill: how an MLA model's prompts attend in their first chunk
MLA_PREFILL_FORMS = ("absorbed", "expanded")
# EngineConfig.linear_attention_prefill: how gated DeltaNet layers run a prefill chunk
LINEAR_ATTENTION_PREFILLS = ("recurrent", "chunked")
LOAD_FORMATS = ("auto", "dummy")
# EngineConfig.quantization: weights quantized at load (None: as the checkpoint stores them)
QUANTIZATIONS = ("fp8",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _flag(default: Any, help: str, **metadata: Any) -> Any:
    """A field the command line offers as --its-name: cli.py takes the flag's type and default
    from the field, its help (and choices, where given) from the metadata, each written once."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option and its default. LLM takes them by name; the CLI offers each field
    with a help text as a flag (a bool as a switch that sets it, the others with a value)."""

    model: str
    lora_modules: Mapping[str, str] = field(
        default_factory=dict, metadata={"help": "adapters to load at start"}
    )
    max_loras: int = _flag(
        4, "adapter slots on the GPU; more adapters may be registered, the rest wait in host memory"
    )
    max_lora_rank: int = _flag(
        64, "the largest adapter rank; on the GPU an adapter takes its modules' own ranks"
    )
    max_gpu_lora_gb: float | None = _flag(
        None,
        "GiB of GPU memory for resident adapters, each at its modules' own ranks; one out of "
        "its slot stays (taking a slot again costs no copy) until a fill needs room; default: "
        "max_loras adapters with every module at max_lora_rank",
    )
    max_cpu_loras: int | None = _flag(
        None,
        "adapters from folders kept in host memory (page-locked on CUDA), beside those in GPU "
        "slots: the least recently used is dropped and read again from its folder when a "
        "request needs it (vLLM's --max-cpu-loras); default: no bound",
    )
    max_cpu_lora_gb: float | None = _flag(
        None, "GiB of host memory those adapters may take (the same LRU); default: no bound"
    )
    enable_lora: bool = True
    # auto: bfloat16 on cuda, float32 on cpu
    dtype: str = _flag("auto", "auto, float32, bfloat16 or float16")
    # auto: cuda when available, else cpu
    device: str = _flag("auto", "auto, cpu, cuda or cuda:N")
    seed: int = _flag(
        0, "the engine's seed: requests that give none draw theirs from it, as do dummy weights"
    )
    max_model_len: int | None = _flag(
        None,
        "most tokens of a request, prompt and output; default: the model's max_position_embeddings",
    )
    max_num_seqs: int = _flag(256, "most requests running in one step")
    max_num_batched_tokens: int = _flag(2048, "prefill token budget of one step (chunked prefill)")
    page_size: int = _flag(16, "tokens per KV-cache page (vLLM's --block-size)")
    num_pages: int | None = _flag(
        None, "KV-cache pages; default: as many as --gpu-memory-utilization allows"
    )
    gpu_memory_utilization: float = _flag(
        0.9,
        "the share of the GPU's memory the engine may fill: the KV cache takes what the model "
        "leaves of it",
    )
    enforce_eager: bool = _flag(False, "run every step eagerly: capture no CUDA graphs")
    # off by default: Triton's in-process compiles from several threads (its private
    # AsyncCompileMode) are not known to be safe, and both start-up segfaults seen came from
    # builds whose kernels were compiling; serial warm-up only costs a cold start its seconds
    concurrent_warmup: bool = _flag(
        False,
        "before capture, run every graph size's first forward at once, a thread each, so their "
        "kernels compile side by side on a cold Triton cache (default: one size after another)",
    )
    async_scheduling: bool = _flag(
        True,
        "plan step N+1 on the host while the GPU runs step N; its input tokens stay on the "
        "device (vLLM's --async-scheduling; --no-async-scheduling: one step at a time)",
    )
    enable_prefix_caching: bool = _flag(
        True,
        "reuse the KV pages of prompt prefixes already computed, per adapter load, base and "
        "cache_salt (vLLM's --enable-prefix-caching)",
    )
    max_state_snapshots: int | None = _flag(
        None,
        "hybrid models' prefix caching: recurrent states kept at page boundaries of cached "
        "prefixes (each the size of a running request's state), least recently used evicted, "
        "beside the max_num_seqs states of running requests (SGLang's --max-mamba-cache-size "
        "counts both); 0: no prefix caching for hybrid models; default: max_num_seqs",
    )
    max_graph_bs: int = _flag(
        256, "largest batch size captured in a CUDA graph (SGLang's --cuda-graph-max-bs)"
    )
    # Steps with a prompt chunk (alone or with decodes) of up to this many tokens replay a
    # graph captured for their padded token count (runner/graph_runner.py): an eager prefill
    # step of a many-layer model is bound by its host launches, not its kernels, up to a few
    # thousand tokens. Capped by max_num_batched_tokens.
    max_prefill_graph_tokens: int = _flag(
        4096,
        "largest prefill step, in tokens, captured in a CUDA graph (like SGLang's "
        "--piecewise-cuda-graph-max-tokens; 0: prefill steps run eagerly)",
    )
    force_reference_kernels: bool = _flag(
        False, "run the torch reference kernels on the GPU too (debugging; implies eager)"
    )
    # How the dense projections are computed on CUDA (kernels/linear.py):
    # - "auto": "skinny" for 16-bit weights, "batch-invariant" with
    #   enable_deterministic_inference (the other kernels' tiles follow the token count outside
    #   that mode, so a row's bits follow its batch anyway);
    # - "batch-invariant": a tensor-core kernel whose rows do not depend on their batch-mates,
    #   and cuBLAS only where it gives the kernel's bits (from 128 rows, and between 17 and 127
    #   at the row counts a check on the device finds for each projection shape);
    # - "skinny": the batch-invariant kernels, but a GEMV at 1 to 8 rows where it fits, fastest
    #   at one token: a row's bf16 sums then differ by a rounding with its batch size;
    # - "cublas": cuBLAS throughout (it splits K at some decode sizes: not batch-invariant).
    projections: str = _flag(
        "auto",
        "dense projections on CUDA: auto (default: skinny for 16-bit weights, batch-invariant "
        "with --enable-deterministic-inference), batch-invariant (a request's projections do "
        "not depend on its batch-mates), skinny (a GEMV at 1-8 tokens: fastest at one token, "
        "but bf16 sums move by a rounding with the batch size), cublas",
        choices=PROJECTIONS,
    )
    # Long prompts' first chunks (no KV before them, at least paged_attention.DENSE_FROM
    # tokens) on CUDA: "cudnn" (torch's cuDNN attention, faster than the Triton kernel there)
    # or "triton" (the paged kernel for every row: a prompt's rows then have the same bits
    # whether it is prefilled whole or in chunks). SGLang's --prefill-attention-backend.
    prefill_attention_backend: str = _flag(
        "cudnn",
        "attention of long first prefill chunks on CUDA: cudnn (fastest) or triton (a prompt's "
        "rows get the same bits prefilled whole or in chunks)",
        choices=PREFILL_ATTENTION_BACKENDS,
    )
    # MLA models (DeepSeek): prefill chunks attend "expanded" (kv_b_proj and its LoRA give
    # the tokens' per-head keys and values, as transformers does: about a third of the latent
    # form's work at DeepSeek's sizes) where that is less work: a prompt's first chunk, and
    # outside the prefill graphs a long later chunk, its prefix read back from the cache; or
    # "absorbed" (in the latent space, as decode rows always are: a prompt's rows then get
    # the same bits prefilled whole or in chunks). Deterministic inference always takes
    # absorbed.
    mla_prefill: str = _flag(
        "expanded",
        "how an MLA model's prefill chunks attend: absorbed (in the latent space, as decode "
        "does) or expanded (per-head keys and values, where that is less work: first chunks, "
        "long later ones); --enable-deterministic-inference keeps absorbed",
        choices=MLA_PREFILL_FORMS,
    )
    # Hybrid models (Qwen3-Next, Qwen3.5): a gated DeltaNet layer runs a prefill chunk
    # "recurrent" (token by token, as decode does: a prompt's rows get the same bits however
    # it is chunked) or "chunked" (blocks of 64 tokens, a triangular solve in each: the serial
    # chain is the blocks, not the tokens). The CPU references and deterministic inference
    # always run recurrent.
    linear_attention_prefill: str = _flag(
        "chunked",
        "how gated DeltaNet layers (Qwen3-Next, Qwen3.5) run prefill chunks on CUDA: "
        "recurrent (token by token, the same bits however a prompt is chunked) or chunked "
        "(blocks of 64 tokens; less serial work); --enable-deterministic-inference keeps "
        "recurrent",
        choices=LINEAR_ATTENTION_PREFILLS,
    )
    # The kernels a request's numbers pass through choose no tile, split or path by what else
    # shares the step (kernels/ops.py: triton_ops): the same bits alone or batched, chunked or
    # not, cache hit or miss. SGLang's --enable-deterministic-inference.
    enable_deterministic_inference: bool = _flag(
        False,
        "the same output bits for a request whatever shares its steps: MoE tiles and decode "
        "attention fixed for every batch, long first chunks by the Triton kernel; needs "
        "--projections auto or batch-invariant (SGLang's --enable-deterministic-inference)",
    )
    load_format: str = _flag(
        "auto",
        "auto: the folder's safetensors; dummy: random weights made on the device, no checkpoint "
        "read (the folder needs only config.json)",
        choices=LOAD_FORMATS,
    )
    quantization: str | None = _flag(
        None,
        "fp8: quantize a bf16 or float32 checkpoint's experts and projections at load, "
        "block-wise as the FP8 releases are (e4m3, one scale per 128x128 block; vLLM's "
        "--quantization); a block-FP8 checkpoint needs no flag",
        choices=QUANTIZATIONS,
    )
    tensor_parallel_size: int = _flag(
        1,
        "ranks, one process each on one host (vLLM's --tensor-parallel-size): attention heads, "
        "MLPs, experts and the vocabulary are split over them; rank 0 schedules and samples",
    )
    enable_expert_parallel: bool = _flag(
        False,
        "with --tensor-parallel-size N, each rank holds E/N whole experts rather than 1/N of "
        "every expert (vLLM's --enable-expert-parallel)",
    )
    served_model_name: str | None = _flag(
        None, "the base model's name in the API (default: the model argument)"
    )

    def __post_init__(self) -> None:
        for name, valid, expected in _CHECKS:
            value = getattr(self, name)
            _check(valid(value), name, value, expected)
        _check(
            not self.enable_deterministic_inference
            or self.projections in ("auto", "batch-invariant"),
            "projections",
            self.projections,
            "'auto' or 'batch-invariant' with enable_deterministic_inference (the others' "
            "sums follow the token count)",
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
        if device.startswith("cuda"):
            first = int(device[5:]) if device.startswith("cuda:") else 0
            if first + self.tensor_parallel_size > torch.cuda.device_count():
                raise ConfigError(
                    f"tensor_parallel_size={self.tensor_parallel_size} on {device!r} needs CUDA "
                    f"devices cuda:{first} .. cuda:{first + self.tensor_parallel_size - 1}, but "
                    f"this machine has {torch.cuda.device_count()}"
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


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The decode batch sizes a CUDA graph is captured for under max_graph_bs = max_bs:
    [1, 2, 4, 8, 16, 24, 32, ..., max_bs], the largest first (capture order)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes), reverse=True)


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The prefill token counts a CUDA graph is captured for under max_prefill_graph_tokens =
    max_tokens: [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, ..., max_tokens], the largest
    first: powers of two, and from 256 on the midpoints too (a step padded by at most a third)."""
    sizes, size = {max_tokens} if max_tokens >= 2 else set(), 16
    while size < max_tokens:
        sizes.add(size)
        if size >= 256 and size * 3 // 2 < max_tokens:
            sizes.add(size * 3 // 2)
        size *= 2
    return sorted(sizes, reverse=True)


def _at_least_1(value: Any) -> bool:
    return value >= 1


def _at_least_0(value: Any) -> bool:
    return value >= 0


def _none_or_at_least_1(value: Any) -> bool:
    return value is None or value >= 1


_AT_LEAST_1 = "an integer >= 1"
_NONE_OR_AT_LEAST_1 = "None or an integer >= 1"
_AT_LEAST_0 = "an integer >= 0"
# EngineConfig's checks, (field, valid, expected), in the order they run: the first field that
# fails is the one the ConfigError names
_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("max_loras", _at_least_1, _AT_LEAST_1),
    ("projections", lambda v: v in PROJECTIONS, f"one of {', '.join(PROJECTIONS)}"),
    (
        "prefill_attention_backend",
        lambda v: v in PREFILL_ATTENTION_BACKENDS,
        f"one of {', '.join(PREFILL_ATTENTION_BACKENDS)}",
    ),
    ("mla_prefill", lambda v: v in MLA_PREFILL_FORMS, f"one of {', '.join(MLA_PREFILL_FORMS)}"),
    (
        "linear_attention_prefill",
        lambda v: v in LINEAR_ATTENTION_PREFILLS,
        f"one of {', '.join(LINEAR_ATTENTION_PREFILLS)}",
    ),
    ("max_lora_rank", _at_least_1, _AT_LEAST_1),
    ("max_cpu_loras", _none_or_at_least_1, _NONE_OR_AT_LEAST_1),
    ("max_cpu_lora_gb", lambda v: v is None or v > 0, "None or a number > 0"),
    ("max_gpu_lora_gb", lambda v: v is None or v > 0, "None or a number > 0"),
    ("dtype", lambda v: v == "auto" or v in _DTYPES, f"'auto' or one of {sorted(_DTYPES)}"),
    (
        "device",
        lambda v: v == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
        "'auto', 'cpu' or 'cuda[:N]'",
    ),
    ("max_model_len", _none_or_at_least_1, _NONE_OR_AT_LEAST_1),
    ("max_num_seqs", _at_least_1, _AT_LEAST_1),
    ("max_num_batched_tokens", _at_least_1, _AT_LEAST_1),
    ("page_size", _at_least_1, _AT_LEAST_1),
    ("num_pages", _none_or_at_least_1, _NONE_OR_AT_LEAST_1),
    ("gpu_memory_utilization", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("max_state_snapshots", lambda v: v is None or v >= 0, "None or an integer >= 0"),
    ("max_graph_bs", _at_least_1, _AT_LEAST_1),
    ("max_prefill_graph_tokens", _at_least_0, _AT_LEAST_0),
    ("load_format", lambda v: v in LOAD_FORMATS, "'auto' or 'dummy'"),
    ("quantization", lambda v: v is None or v in QUANTIZATIONS, "None or 'fp8'"),
    ("tensor_parallel_size", _at_least_1, _AT_LEAST_1),
)


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
    # What GPT-OSS adds; the common reading (models/common.py) turns all of it off.
    sliding_window: int  # keys within this many positions of the query; 0 = no window
    sliding_layers: tuple[bool, ...]  # per layer: attention limited to sliding_window
    attention_sinks: bool  # a learned logit per query head in the softmax's denominator
    o_bias: bool  # the attention's output projection has a bias
    router_bias: bool
    expert_bias: bool  # every expert's gate|up and down have biases
    # "silu": silu(gate) * up; "swiglu_oai": GPT-OSS's clamped form (reference.swiglu_oai)
    activation: str
    # the checkpoint's fused experts: "gate_up_rows" (gate_up_proj [E, 2I, H], gate rows then
    # up rows; down_proj [E, H, I]) or "interleaved_in_out" (GPT-OSS: gate_up_proj [E, H, 2I]
    # with gate and up in alternate columns; down_proj [E, I, H])
    experts_layout: str
    # the experts are held packed in MXFP4 (kernels/moe/mxfp4_layout.Mxfp4Weight): the checkpoint's
    # quantization_config says mxfp4 and the engine's kernels take them packed (the engine
    # resolves it to False on the reference kernels, which get them dequantized at load)
    experts_mxfp4: bool
    # block-FP8 weights (kernels/fp8_block.py): "none"; "checkpoint" (the quantization_config
    # says fp8: e4m3 codes with a weight_scale_inv per 128x128 block); "online" (a bf16 or
    # float32 checkpoint's experts and projections block-quantized at load, --quantization fp8).
    # The loader dequantizes them to the model's dtype, all but the experts where experts_fp8.
    weights_fp8: str
    # What the DeepSeek family and GLM-4.5 add (models/deepseek.py, models/glm4_moe.py); the
    # defaults are every other architecture's.
    mla: MlaConfig | None = None  # multi-head latent attention, in place of GQA
    routing: GroupedRouting | None = None  # grouped top-k with a scaling factor
    # rotary on the first rotary_dim dims of each head only (GLM-4.5); 0: on the whole head
    rotary_dim: int = 0
    shared_expert_gate: bool = True  # a sigmoid gate scales the shared expert (Qwen2-MoE)
    # multi-token-prediction layers a checkpoint holds after the decoder's: skipped at load
    mtp_layers: int = 0
    # What Qwen3-Next and Qwen3.5-MoE add (models/qwen3_next.py): gated DeltaNet layers with a
    # per-request recurrent state in place of attention on the layers it names, q_proj giving
    # each head's query and a sigmoid gate on the attention's output, and RMSNorms that scale
    # by 1 + w (the loader stores 1 + w: the same float32 products)
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    zero_centred_norm: bool = False
    # the experts of a weights_fp8 model are held as codes and block scales
    # (kernels/fp8_block.Fp8Weight): the engine sets it where its kernels take them so and one
    # rank holds them (engine/build.py), else they are dequantized at load like the rest
    experts_fp8: bool = False
    # attention's q/k/v/o (GQA, not MLA) of a weights_fp8 model are held as codes and block
    # scales (LoraLinear's weight and weight_scale_inv): set where the kernels take them so and
    # one rank holds them (engine/build.py), else they are dequantized at load like the rest
    projections_fp8: bool = False

    def __post_init__(self) -> None:
        assert self.activation in ("silu", "swiglu_oai"), self.activation
        assert not self.experts_fp8 or self.weights_fp8 != "none", self.weights_fp8
        assert not self.projections_fp8 or self.weights_fp8 != "none", self.weights_fp8
        assert self.experts_layout in ("gate_up_rows", "interleaved_in_out"), self.experts_layout
        assert len(self.sliding_layers) == self.num_layers, self.sliding_layers
        assert self.weights_fp8 in ("none", "checkpoint", "online"), self.weights_fp8

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a gated DeltaNet layer (a recurrent state, no KV pages)."""
        return self.linear_attention is not None and self.linear_attention.layers[layer]

    @property
    def num_paged_layers(self) -> int:
        """The layers that keep KV pages (all but the linear-attention ones)."""
        return sum(not self.is_linear(i) for i in range(self.num_layers))

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def state_slot_bytes(self, dtype: torch.dtype) -> int:
        """One recurrent-state slot across all linear layers: the conv window (in the model's
        dtype) and the delta-rule state (STATE_DTYPE); 0 without linear layers."""
        la = self.linear_attention
        if la is None:
            return 0
        per_layer = la.conv_dim * (la.conv_kernel - 1) * dtype.itemsize
        per_layer += la.num_v_heads * la.head_k_dim * la.head_v_dim * STATE_DTYPE.itemsize
        return sum(la.layers) * per_layer


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention. Each token's keys and values come from one
    latent of kv_lora_rank values and one rotary key of qk_rope_head_dim shared by all heads:
    the paged cache holds those two, kv_b_proj expands the latent into each head's no-rope key
    (qk_nope_head_dim) and value (v_head_dim)."""

    q_lora_rank: int  # q_a_proj's output; 0: q_proj reads the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # qk_head_dim ** -0.5, times mscale ** 2 where DeepSeek's YaRN sets mscale_all_dim
    softmax_scale: float
    # the checkpoint's rotary pairs are adjacent dims (x0, x1), (x2, x3), ... (DeepSeek), not
    # the two halves of the rotary dims
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_size(self) -> int:
        """Values a token keeps in the cache per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routing: the experts are split into n_group groups, each group scored
    (group_score), only the topk_group best groups' experts may be chosen; the chosen experts'
    weights are the scores (ModelConfig.scoring, renormalized as ModelConfig.renormalize says)
    times routed_scaling_factor. With correction_bias (DeepSeek-V3, GLM-4.5) a learned bias per
    expert is added to the scores for the choice only, never to the weights."""

    n_group: int
    topk_group: int
    group_score: str  # "max" (DeepSeek-V2) | "top2_sum" (of the biased scores: V3, GLM-4.5)
    routed_scaling_factor: float
    correction_bias: bool

    def __post_init__(self) -> None:
        assert self.group_score in ("max", "top2_sum"), self.group_score
        assert 1 <= self.topk_group <= self.n_group, (self.topk_group, self.n_group)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): each token's q|k|v pass a short causal conv of
    conv_kernel taps (per channel), then a delta rule with a per-head decay writes k -> v into
    a [head_k_dim, head_v_dim] state per value head, which q reads. A request keeps its conv
    window and its states between steps (engine/state_cache.py)."""

    layers: tuple[bool, ...]  # per layer: gated DeltaNet (True) or full attention
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each q/k head serves num_v_heads // it
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    # the checkpoint's input projections: in_proj_qkvz and in_proj_ba with each key head's
    # q, k, v, z (and b, a) side by side (Qwen3-Next); else in_proj_qkv, in_proj_z, in_proj_b,
    # in_proj_a, each whole (Qwen3.5)
    grouped_projections: bool

    def __post_init__(self) -> None:
        assert self.num_v_heads % self.num_k_heads == 0, (self.num_v_heads, self.num_k_heads)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim
