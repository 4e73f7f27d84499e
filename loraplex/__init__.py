"""loraplex: one frozen base model, thousands of LoRA adapters, continuous batching."""

from loraplex import isa, threads

threads.set_wait_policy()  # before torch is imported: OpenMP threads that sleep when they wait
isa.apply()  # LORAPLEX_CPU_ISA=avx2: PyTorch and oneDNN on their AVX2 code, set before torch loads

from loraplex.engine.llm import LLM  # noqa: E402
from loraplex.engine.request import RequestOutput  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
