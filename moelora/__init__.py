"""moelora: serve Mixture-of-Experts models with many LoRA adapters in one batch."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moelora.llm import LLM
    from moelora.sampling_params import SamplingParams, StructuredOutputsParams
    from moelora.step.request import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    """The public names, imported when first asked for: a process that imports one module of
    the package (a tensor-parallel worker) does not pay for the server's imports (xgrammar,
    transformers' generation)."""
    if name == "LLM":
        from moelora.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from moelora import sampling_params

        return getattr(sampling_params, name)
    if name == "RequestOutput":
        from moelora.step.request import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'moelora' has no attribute {name!r}")
