"""moelora: serve Mixture-of-Experts models with many LoRA adapters in one batch."""

from moelora.engine.request import RequestOutput
from moelora.llm import LLM
from moelora.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
