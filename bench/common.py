"""What the benchmarks share: the copy-bandwidth ceiling, CUDA-graph timing, where a run's result
goes and its header; a step planned but not run (plan_step: PlannedStep, what the engine
benchmarks time); the Qwen3-30B-A3B decode engine, a decode step's floor and its timing
(bench/decode.py, e2e.py, capture.py, profile_step.py); one MoE layer's LoRA pool and batch
info (bench/kernels.py, tune_moe.py, ncu_moe.py).

Each run writes its own dated result file, bench/results/<bench>-<device>-<date>-<commit>.md,
whose header says the command, the commit and the machine; bench/results/NOTES.md keeps the
short log of designs tried, with their figures and verdicts.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora import LLM
from moelora.config import EngineConfig, ModelConfig
from moelora.engine.engine import Engine
from moelora.kernels.fp8_block import fp8_block_bytes
from moelora.kernels.moe.mxfp4_layout import mxfp4_bytes
from moelora.lora.adapter import random_adapter
from moelora.models.shapes import (
    FP8_QUANTIZATION,
    MXFP4_QUANTIZATION,
    shape_config,
    write_config_folder,
)
from moelora.sampling_params import SamplingParams
from moelora.step.batch import HostBatch
from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights

DEV = "cuda"
DT = torch.bfloat16
RESULTS = Path(__file__).parent / "results"

# ---- timing -----------------------------------------------------------------------------


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    from triton.testing import do_bench

    src = torch.empty(gib << 29, dtype=torch.int16, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_flops_per_s(device: str) -> float:
    """bf16 FLOP/s of an 8192^3 torch.mm (on the CPU: fp32 of a 1024^3 one)."""
    if not device.startswith("cuda"):
        a = torch.randn(1024, 1024)
        start = time.perf_counter()
        for _ in range(3):
            a @ a
        return 3 * 2 * 1024**3 / (time.perf_counter() - start)
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def graph_replay_ms(fn: Callable[[], object], *, warmup: int, rep: int) -> float:
    """Median ms of one replay of a CUDA graph of fn, the L2 flushed before each (do_bench).
    fn runs once on a side stream first, so its kernels compile outside the capture."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    del graph
    return ms


def graph_ms(fn: Callable[[], object], layers: int) -> float:
    """Median ms of one layer: fn() runs all layers; replays of its CUDA graph, L2 flushed."""
    return graph_replay_ms(fn, warmup=10, rep=60) / layers


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- results ----------------------------------------------------------------------------


def commit() -> str:
    """The commit benchmarked: MOELORA_COMMIT when the tree travelled without .git."""
    if os.environ.get("MOELORA_COMMIT"):
        return os.environ["MOELORA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_slug() -> str:
    """The GPU's name as a file name: "NVIDIA H200" -> "h200"; "cpu" without one."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def result_path(bench: str) -> Path:
    """bench/results/<bench>-<device>-<UTC date>-<commit>.md; a second run of the same day and
    commit gets -2, -3, ...: one file a run."""
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{bench}-{device_slug()}-{now:%Y-%m-%d}-{commit()}"
    path, n = RESULTS / f"{stem}.md", 1
    while path.exists():
        n += 1
        path = RESULTS / f"{stem}-{n}.md"
    return path


def result_header(title: str, bandwidth: float | None, *, device: str = DEV) -> list[str]:
    import triton

    name = torch.cuda.get_device_name() if device == DEV else platform.processor() or device
    lines = [
        f"# {title}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit()}",
        f"- device: {name}, torch {torch.__version__}, triton {triton.__version__}",
        f"- command: `PYTHONPATH=. python {' '.join(sys.argv)}`",
    ]
    if bandwidth is not None:
        lines.append(f"- copy bandwidth (D2D, read + write): {bandwidth / 1e12:.2f} TB/s")
    return lines


def write_result(bench: str, lines: list[str], out: str | None, *, smoke: bool = False) -> Path:
    """Write a run's lines to `out`, or by default to its dated file (result_path); a smoke
    run's, by default, to a temporary file: its figures do not belong in bench/results."""
    if smoke and not out:
        out = str(Path(tempfile.mkdtemp(prefix=f"{bench}-smoke-")) / f"{bench}-smoke.md")
    path = Path(out) if out else result_path(bench)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}", flush=True)
    return path


# ---- a step planned but not run ---------------------------------------------------------


@dataclass(frozen=True)
class PlannedStep:
    """The next step as Engine.step() would run it, planned but not run (plan_step): its
    forward (a CUDA graph replay or eager) to call again and again, as benchmarks and
    profilers time it. Built from the engine's public parts; nothing is sampled or committed."""

    inputs: HostBatch  # the step's inputs as the runner laid them out
    request_ids: list[str]  # the requests of its chunks, in row order
    uses_graph: bool  # whether step() would replay a CUDA graph for it
    engine: Engine

    def forward_fn(self, *, eager: bool = False) -> Callable[[], torch.Tensor]:
        """The step's forward as a function of no arguments: the replay of the batch's CUDA
        graph, its static inputs written once here (it returns the padded rows [bs, H]), or with
        eager=True (or no graph that fits) the eager forward of the same inputs ([T, H]). With
        several ranks: eager on every rank, the inputs sent each call."""
        runner, host = self.engine.runner, self.inputs
        if runner.workers is not None:
            return lambda: runner.forward_rows(host, None, [])[0]
        if eager or not self.uses_graph:
            batch = runner.device_batch(host)
            return lambda: runner.forward(batch)
        return runner.graphs.replay_fn(host)

    def logits_fn(self, *, eager: bool = False) -> Callable[[], torch.Tensor]:
        """forward_fn, then the lm_head on the batch's T rows, as a step computes them (with
        several ranks the lm_head's gather is a collective too: every rank runs it)."""
        runner, T = self.engine.runner, self.inputs.num_tokens
        if runner.workers is not None:
            rows = [torch.arange(T)]
            return lambda: runner.forward_rows(self.inputs, None, rows)[1][0]
        forward = self.forward_fn(eager=eager)
        return lambda: runner.model.compute_logits(forward()[:T])

    @torch.inference_mode()
    def routed_experts(self) -> list[torch.Tensor]:
        """Each MoE layer's top-k expert ids [T, K] for the step, from one eager forward (one
        rank only: tensor_parallel_size=1)."""
        runner = self.engine.runner
        if runner.workers is not None:
            raise NotImplementedError(
                "routed_experts runs on one rank only: tensor_parallel_size=1"
            )
        trace: list[torch.Tensor] = []
        runner.forward(dataclasses.replace(runner.device_batch(self.inputs), routing_trace=trace))
        return trace


def plan_step(engine: Engine) -> PlannedStep:
    """The next step as engine.step() would run it, planned (its adapters in their slots) but
    not run. Its requests stay as they are: abort them when done."""
    with engine.on_device():
        engine.commit_in_flight()
        plan = engine.schedule()
        inputs = engine.runner.host_batch(plan)
    graphs = engine.runner.graphs
    return PlannedStep(
        inputs=inputs,
        request_ids=[c.request.request_id for c in plan.chunks],
        uses_graph=graphs is not None and graphs.can_run(inputs),
        engine=engine,
    )


# ---- the decode engine: a Qwen3-30B-A3B shape with random weights --------------------------

DECODE_BATCHES = (1, 8, 32, 64, 128)
CONTEXT = 256  # prompt tokens per sequence before the timed decode step
RANK = 16
MAX_LORAS = 8


def write_random_tokenizer(folder: str | Path, vocab_size: int, *, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of vocab_size tokens (tokenizer.json, tokenizer_config.json)
    into a model folder, for runs that need one (structured outputs read the vocabulary): the
    256 bytes, random merges of a token and a letter up to vocab_size - 2, then <|endoftext|>
    and <|im_end|> (the EOS). Tokens average a few letters, as a real vocabulary's do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    letters = [ch for ch in alphabet if ch.isalnum() and ch.isascii()] + ["Ġ"]  # Ġ: a space
    tokens, merges = list(alphabet), []
    gen = torch.Generator().manual_seed(seed)
    while len(vocab) < vocab_size - 2:
        left = tokens[int(torch.randint(0, len(tokens), (1,), generator=gen))]
        right = letters[int(torch.randint(0, len(letters), (1,), generator=gen))]
        if left + right not in vocab and len(left) < 12:
            vocab[left + right] = len(vocab)
            tokens.append(left + right)
            merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[-1]}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


SPECIALS = ("<|endoftext|>", "<|im_end|>")
# ChatML, written as chat_template.jinja beside a random tokenizer so that chat requests render
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def served_model_folder(shape: str = "qwen3-30b-a3b") -> str:
    """model_folder(None, shape) with a random tokenizer of the shape's vocabulary and a ChatML
    chat template: what `moelora serve FOLDER --load-format dummy` serves text and chats from."""
    folder = model_folder(None, shape)
    write_random_tokenizer(folder, int(shape_config(shape)["vocab_size"]))
    (Path(folder) / "chat_template.jinja").write_text(CHATML)
    return folder


def write_random_peft_adapter(folder: str | Path, config: dict, *, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder of random bf16 weights for a Qwen3-MoE config.json (a named shape's,
    shapes.shape_config): attention q/k/v/o, and every expert's gate|up and down as PEFT's
    target_parameters write the fused 3D expert weights (A [r*E, in], B [out, r*E]). A ~
    N(0, 1/in) and B ~ N(0, 0.01^2), as lora.adapter.random_adapter makes them: every delta is
    nonzero and small. What a server started with --lora-modules loads, as a trained one."""
    from safetensors.torch import save_file

    H, E, I = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def pair(r: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(r, d_in, generator=gen) * d_in**-0.5
        return a.to(DT), (torch.randn(d_out, r, generator=gen) * 0.01).to(DT)

    modules = {"self_attn.q_proj": (H, q), "self_attn.k_proj": (H, kv)}
    modules |= {"self_attn.v_proj": (H, kv), "self_attn.o_proj": (q, H)}
    modules |= {"mlp.experts.base_layer": (H, 2 * I), "mlp.experts": (I, H)}  # gate|up, down
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (d_in, d_out) in modules.items():
            r = rank * E if module.startswith("mlp.experts") else rank
            a, b = pair(r, d_in, d_out)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    adapter = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "bias": "none",
    }
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(adapter, indent=1))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def random_weights_llm(
    folder: str, *, lora: bool, rank: int, max_num_seqs: int, **options: object
) -> tuple[LLM, list[str]]:
    """An LLM of a model folder's random weights (load_format="dummy") whose decode graphs go
    up to max_num_seqs, and, with LoRA, MAX_LORAS random adapters of `rank` on every projection
    it can adapt (their names, a0 ..); options: the rest of its EngineConfig."""
    llm = LLM(
        model=folder,
        load_format="dummy",
        enable_lora=lora,
        max_loras=MAX_LORAS,
        max_lora_rank=rank,
        max_num_seqs=max_num_seqs,
        max_graph_bs=max_num_seqs,
        **options,
    )
    names = [f"a{i}" for i in range(MAX_LORAS)] if lora else []
    for seed, name in enumerate(names):
        llm.add_random_lora(name, rank=rank, seed=seed)
    return llm, names


def model_folder(
    layers: int | None, shape: str = "qwen3-30b-a3b", *, mxfp4: bool = False, fp8: bool = False
) -> str:
    """A model folder holding only the named shape's config.json (moelora.models.shapes), with
    `layers` layers (None: the shape's own): the engine fills the weights at random
    (load_format="dummy"). mxfp4: with the GPT-OSS release's quantization_config, so a CUDA
    engine makes the experts packed MXFP4; fp8: with the block-FP8 one, so an engine whose
    kernels keep FP8 experts makes them e4m3 codes and scales (experts_held says which)."""
    assert not (mxfp4 and fp8), "one format of the experts"
    config = shape_config(shape, num_layers=layers)
    if mxfp4:
        config["quantization_config"] = dict(MXFP4_QUANTIZATION)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION)
    return str(write_config_folder(config, tempfile.mkdtemp(prefix=f"moelora-{shape}-")))


def make_engine(
    folder: str,
    *,
    lora: bool,
    eager: bool = False,
    max_bs: int = max(DECODE_BATCHES),
    projections: str = "auto",
    context: int = CONTEXT,
    deterministic: bool = False,
) -> Engine:
    """An engine on the folder's dummy weights for decode steps of up to max_bs sequences of
    `context` prompt tokens (decode_batch prefills them); deterministic: with
    --enable-deterministic-inference."""
    cfg = EngineConfig(
        model=folder,
        load_format="dummy",
        dtype="bfloat16",
        enable_lora=lora,
        max_loras=MAX_LORAS,
        max_lora_rank=RANK if lora else 1,
        max_graph_bs=max_bs,
        max_num_seqs=max_bs,
        max_num_batched_tokens=max_bs * context,
        max_model_len=context + 64,
        num_pages=max_bs * (context + 64) // 16 + 16,
        enforce_eager=eager,
        projections=projections,
        enable_deterministic_inference=deterministic,
    )
    return Engine(cfg)


def capture_seconds(engine: Engine) -> tuple[float, float]:
    """(graph capture s, of it the warm-up s, where the kernels compile)."""
    stats = engine.stats()
    return stats.graph_capture_seconds, stats.graph_warm_up_seconds


def add_random_adapters(
    engine: Engine, count: int, *, without: str | None = None, prefix: str = "a"
) -> list[str]:
    """Register adapters a0, a1, ... (`prefix`) of rank RANK on every attention and expert
    projection, or every one but the targets named `without` (e.g. "kv_b": MLA's kv_b_proj)."""
    names = [f"{prefix}{i}" for i in range(count)]
    targets = {
        key: t
        for key, t in engine.lora_targets.items()
        if without is None or not key.endswith(f".{without}")
    }
    for seed, name in enumerate(names):
        adapter = random_adapter(name, targets, rank=RANK, seed=seed, dtype=DT, device=DEV)
        engine.add_adapter(adapter)
    return names


def decode_batch(
    engine: Engine, B: int, loras: list[str | None], context: int = CONTEXT
) -> PlannedStep:
    """Prefill B random prompts of `context` tokens, then plan the decode step that follows
    (not run: abort its requests when done). A hybrid model with prefix caching prefills in
    two chunks (the second starts at its state snapshot's page boundary): steps run until
    every request has its first token."""
    gen = torch.Generator().manual_seed(B)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    ids = [f"b{B}-{i}" for i in range(B)]
    for i, rid in enumerate(ids):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add_request(rid, prompt, params, loras[i])
    started: set[str] = set()
    for _ in range(6):  # a step's tokens come with the next step's answer
        started.update(out.request_id for out in engine.step() if out.token_ids)
        if len(started) == B:
            break
    step = plan_step(engine)
    assert len(step.request_ids) == B and step.inputs.num_tokens == B
    return step


def floor_bytes(engine: Engine, step: PlannedStep) -> tuple[int, int]:
    """(model + KV + state bytes, LoRA bytes) that one decode step must move at least once.

    Weights: weight_bytes, the experts touched counted from the batch's real routing. KV: each
    paged layer's keys and values (a sliding layer's window only; an MLA layer's latent and
    rotary key), read. State (gated DeltaNet layers): each sequence's slot, read and written.
    LoRA: per active slot each attention projection's A/B at the real rank (attention_shapes),
    and per distinct (slot, expert) pair that expert's A/B.
    """
    mc, elem, r = engine.model_config, 2, RANK
    H, I, E = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts
    routed = step.routed_experts()
    model, lora = weight_bytes(mc, [int(ids.unique().numel()) for ids in routed]), 0
    slots = step.inputs.slot_of_token.long()
    active = slots >= 0
    if engine.config.enable_lora:
        shapes = [shape for layer in range(mc.num_layers) for shape in attention_shapes(mc, layer)]
        n_slots = int(slots[active].unique().numel())
        lora += n_slots * sum(r * (n_in + n_out) * elem for n_in, n_out in shapes)
    for ids in routed if engine.config.enable_lora else ():
        on = active.to(ids.device)
        pairs = (slots.to(ids.device)[:, None] * E + ids.long())[on].unique().numel()
        lora += pairs * (2 * r * H + 2 * I * r + r * I + H * r) * elem
    return model + cache_bytes(mc, step.inputs.seq_lens.long()), lora


def cache_bytes(mc: ModelConfig, seq_lens: torch.Tensor) -> int:
    """What a decode step of sequences of seq_lens reads of the paged caches and moves of the
    recurrent states (read and written back), bf16 caches, float32 delta-rule states."""
    total, elem = 0, 2
    for layer, sliding in enumerate(mc.sliding_layers):
        if mc.is_linear(layer):
            continue
        kv_tokens = int((seq_lens.clamp(max=mc.sliding_window) if sliding else seq_lens).sum())
        per_token = mc.mla.cache_size if mc.mla is not None else 2 * mc.kv_size
        total += kv_tokens * per_token * elem
    return total + 2 * len(seq_lens) * mc.state_slot_bytes(torch.bfloat16)


def attention_shapes(mc: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(in, out) of each projection of `layer`'s attention (or gated DeltaNet) that a LoRA may
    target: GQA's q, k, v, o (q twice as wide with Qwen3-Next's output gate); MLA's q_a and
    q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o; gated DeltaNet's input projections
    (fused or apart, as the checkpoint has them) and out_proj."""
    H, la, mla = mc.hidden_size, mc.linear_attention, mc.mla
    if mc.is_linear(layer):
        kd, vd, nv = la.key_dim, la.value_dim, la.num_v_heads
        ins = (
            [(H, 2 * kd + 2 * vd), (H, 2 * nv)]
            if la.grouped_projections
            else [(H, la.conv_dim), (H, vd), (H, nv), (H, nv)]
        )
        return [*ins, (vd, H)]
    if mla is not None:
        heads = mc.num_heads
        q = [(H, mla.q_lora_rank), (mla.q_lora_rank, heads * mla.qk_head_dim)]
        q = q if mla.q_lora_rank else [(H, heads * mla.qk_head_dim)]
        kv_b = (mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        return [*q, (H, mla.cache_size), kv_b, (heads * mla.v_head_dim, H)]
    q_out = 2 * mc.q_size if mc.attn_output_gate else mc.q_size
    return [(H, q_out), (H, mc.kv_size), (H, mc.kv_size), (mc.q_size, H)]


def active_params(cfg: ModelConfig) -> int:
    """Non-embedding parameters one token goes through: each layer's attention projections
    (attention_shapes) and a gated DeltaNet layer's conv, then its dense MLP, or its router,
    top-k experts and shared expert."""
    H = cfg.hidden_size
    moe = H * cfg.num_experts + cfg.top_k * 3 * H * cfg.moe_intermediate_size
    moe += 3 * H * cfg.shared_expert_intermediate_size
    dense = 3 * H * cfg.intermediate_size
    total = 0
    for layer, sparse in enumerate(cfg.sparse_layers):
        total += sum(n_in * n_out for n_in, n_out in attention_shapes(cfg, layer))
        if cfg.is_linear(layer):
            total += cfg.linear_attention.conv_dim * cfg.linear_attention.conv_kernel
        total += moe if sparse else dense
    return total


def prefill_flops(cfg: ModelConfig, lengths: list[int]) -> float:
    """FLOPs of prefilling prompts of these lengths, each sampling one token: 2 x active_params
    a token, causal attention's two products on each attention layer (an MLA layer's over its
    expanded heads: q.k over qk_head_dim, p.v over v_head_dim), a gated DeltaNet layer's
    recurrence (a token reads, decays and writes each value head's [dk, dv] state: three
    products), the lm_head once a prompt."""
    per_pair, per_token = 0, 0
    for layer in range(cfg.num_layers):
        if cfg.is_linear(layer):
            la = cfg.linear_attention
            per_token += 3 * 2 * la.num_v_heads * la.head_k_dim * la.head_v_dim
        elif cfg.mla is not None:
            m = cfg.mla
            per_pair += 2 * cfg.num_heads * (m.qk_head_dim + m.v_head_dim)
        else:
            per_pair += 2 * 2 * cfg.q_size
    tokens = sum(lengths)
    attention = sum(per_pair * t * (t + 1) / 2 for t in lengths) + per_token * tokens
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size * len(lengths)
    return 2 * active_params(cfg) * tokens + attention + lm_head


def weight_bytes(mc: ModelConfig, experts_touched: list[int]) -> int:
    """Weight bytes a decode step reads at least once, experts_touched[j] distinct routed experts
    in the j-th MoE layer: the lm_head (the embedding reads B rows only), every layer's
    attention projections (attention_shapes; a gated DeltaNet layer's conv too), and a layer's
    dense MLP or its router, shared expert and those experts (expert_bytes). All but the routed
    experts and GQA's projections are bf16: a block-FP8 model dequantizes its other weights at
    load; those two are FP8 where the model keeps them so (experts_fp8, projections_fp8)."""
    H, elem = mc.hidden_size, 2
    assert len(experts_touched) == sum(mc.sparse_layers), (experts_touched, mc.sparse_layers)
    dense = 3 * H * mc.intermediate_size * elem
    router_and_shared = (mc.num_experts * H + 3 * H * mc.shared_expert_intermediate_size) * elem
    total = mc.vocab_size * H * elem
    for layer in range(mc.num_layers):
        total += attention_bytes(mc, layer)
        if mc.is_linear(layer):
            la = mc.linear_attention
            total += la.conv_dim * la.conv_kernel * elem
    total += (mc.num_layers - len(experts_touched)) * dense
    return total + sum(router_and_shared + n * expert_bytes(mc) for n in experts_touched)


def attention_bytes(mc: ModelConfig, layer: int) -> int:
    """Bytes of `layer`'s attention projections (attention_shapes) as the model holds them:
    block FP8 where it keeps them so (projections_fp8: all but MLA's kv_b_proj, which the
    absorption reads whole in bf16), else bf16."""
    shapes = attention_shapes(mc, layer)
    if not mc.projections_fp8 or mc.is_linear(layer):
        return 2 * sum(n_in * n_out for n_in, n_out in shapes)
    kv_b = len(shapes) - 2 if mc.mla is not None else -1  # attention_shapes' order
    return sum(
        2 * n_in * n_out if i == kv_b else fp8_block_bytes(n_out, n_in)
        for i, (n_in, n_out) in enumerate(shapes)
    )


def expert_bytes(mc: ModelConfig) -> int:
    """Bytes of one routed expert, w13 [2I, H] and w2 [H, I], as the model holds them: packed
    MXFP4 (codes and scales); block FP8 (a byte a code, a float32 scale per 128x128 block of
    w13's one grid and of w2's, as kernels/fp8_block.Fp8Weight holds them); else bf16."""
    H, I = mc.hidden_size, mc.moe_intermediate_size
    if mc.experts_mxfp4:
        return mxfp4_bytes(2 * I, H) + mxfp4_bytes(H, I)
    if mc.experts_fp8:
        return fp8_block_bytes(2 * I, H) + fp8_block_bytes(H, I)
    return 3 * H * I * 2


def experts_held(mc: ModelConfig) -> str:
    """How a built engine holds its routed experts (its resolved ModelConfig), for a result's
    title: read from the engine, so that a figure is never labelled FP8 where its kernels did
    not keep FP8 experts, or it ran on several ranks (it holds them in the model's dtype)."""
    if mc.experts_fp8:
        both = " and attention projections" if mc.projections_fp8 else ""
        return f"FP8 experts{both} (block 128x128)"
    if mc.experts_mxfp4:
        return "MXFP4 experts"
    if mc.weights_fp8 != "none":
        return "block-FP8 model, experts dequantized at load (not kept FP8)"
    return "bf16 experts"


def held_experts(held: set[str]) -> tuple[str, str]:
    """(how a run's engines held the experts, its title's weights) from their built_experts:
    "bf16 experts" and "random weights" when nothing was quantized."""
    joined = " / ".join(sorted(held)) or "bf16 experts"
    plain = joined == "bf16 experts"
    return joined, "random weights" if plain else f"random weights, {joined}"


def built_experts(mc: ModelConfig) -> str:
    """experts_held(mc) of an engine just built, printed as a note too where a block-FP8 model's
    experts were dequantized."""
    held = experts_held(mc)
    if mc.weights_fp8 != "none" and not mc.experts_fp8:
        print(
            f"note: {held}: the engine's kernels do not keep FP8 experts, or it runs on several "
            "ranks; its figures are those of experts in the model's dtype",
            flush=True,
        )
    return held


def time_step(step: PlannedStep, *, eager: bool, device: str = DEV) -> float:
    """Median ms of one decode forward and its logits (PlannedStep.logits_fn): the replay of
    the batch's graph, its static inputs written once beforehand, then the lm_head on the
    batch's rows as the runner does after a replay; or the eager model. The floor counts the
    lm_head's weight, so the timed part must run it too. On the CPU (bench/e2e.py --smoke):
    the median of a few eager calls, by the wall clock."""
    assert eager or step.uses_graph, "the batch has no graph: raise max_graph_bs"
    with torch.inference_mode():
        logits = step.logits_fn(eager=eager)
        if device == "cpu":
            return wall_median_ms(logits, reps=3)
        from triton.testing import do_bench

        return do_bench(logits, warmup=25, rep=200, return_mode="median")


def wall_median_ms(fn: Callable[[], object], *, reps: int) -> float:
    """Median ms of `reps` calls by the wall clock, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def adapters_of(case: str, names: list[str], B: int) -> list[str | None]:
    if case in ("disabled", "base-only"):
        return [None] * B
    if case == "1 adapter":
        return [names[0]] * B
    return [names[i % len(names)] for i in range(B)]


# ---- one MoE layer: (E, H, I, K, layers a graph holds) ------------------------------------

MOE_SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, 8),
    "mixtral": (8, 4096, 14336, 2, 4),
    # the routed experts of models/shapes.py's newer families (tune_moe.py's tables)
    "qwen3.5-moe-35b-a3b": (256, 2048, 512, 8, 8),
    "qwen3-next-80b-a3b": (512, 2048, 512, 10, 8),
    "moonlight-16b-a3b": (64, 2048, 1408, 6, 8),
    "glm-4.5-air": (128, 4096, 1408, 8, 4),
}
KERNEL_SHAPES = ("qwen3-30b-a3b", "mixtral")  # bench/kernels.py's default: the peers' A/B


def lora_pool(
    E: int, H: int, I: int, R: int, rank: int, *, device: str = DEV
) -> tuple[LoraWeights, LoraWeights]:
    """MAX_LORAS slots of pool rank R, each holding an adapter of the given real rank."""
    a13 = torch.zeros(MAX_LORAS, E, 2, R, H, dtype=DT, device=device)
    b13 = torch.zeros(MAX_LORAS, E, 2 * I, R, dtype=DT, device=device)
    a2 = torch.zeros(MAX_LORAS, E, 1, R, I, dtype=DT, device=device)
    b2 = torch.zeros(MAX_LORAS, E, H, R, dtype=DT, device=device)
    for t, scale in ((a13, H**-0.5), (a2, I**-0.5), (b13, 0.1), (b2, 0.1)):
        view = t[..., :rank, :] if t.dim() == 5 else t[..., :rank]
        view.copy_(torch.randn_like(view) * scale)
    return LoraWeights.dense(a13, b13, (I, I)), LoraWeights.dense(a2, b2, (H,))


def batch_info(M: int, case: str, rank: int, *, device: str = DEV) -> LoraBatchInfo:
    """M tokens: "none" on no slot, "one" all on slot 0, else ("distinct") token t on t % 8.
    Its rank tile is the adapters' rank, as an eager step's is (LoraBatchInfo.rank_tile; the
    engine's graphs keep the pool's)."""
    if case == "none":
        slots = torch.full((M,), NO_SLOT)
    elif case == "one":
        slots = torch.zeros(M, dtype=torch.long)
    else:
        slots = torch.arange(M) % MAX_LORAS
    enabled = torch.zeros(MAX_LORAS, dtype=torch.int32)
    enabled[slots[slots >= 0].unique()] = 1
    return LoraBatchInfo(
        slots.to(device, torch.int32),
        torch.full((MAX_LORAS,), rank, dtype=torch.int32, device=device),
        torch.full((MAX_LORAS,), 0.5, device=device),
        enabled.to(device),
        rank_tile=rank if case != "none" else 0,
    )
