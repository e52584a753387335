"""moelora: serve Mixture-of-Experts models with many LoRA adapters in one batch."""

from moelora.llm import LLM
from moelora.sampling_params import SamplingParams, StructuredOutputsParams
from moelora.step.request import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
