"""loraplex: one frozen base model, thousands of LoRA adapters, continuous batching."""

from loraplex import threads

threads.set_wait_policy()  # before torch is imported: OpenMP threads that sleep when they wait

from loraplex.engine.llm import LLM  # noqa: E402
from loraplex.engine.request import RequestOutput  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
