"""loraplex: one frozen base model, thousands of LoRA adapters, continuous batching."""

from loraplex.engine.llm import LLM
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
