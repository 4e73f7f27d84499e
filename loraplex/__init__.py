"""loraplex: one frozen base model, thousands of LoRA adapters, continuous batching."""

from loraplex import isa, threads

threads.set_wait_policy()  # before torch is imported: OpenMP threads that sleep when they wait
if isa.cap() and not isa.apply():  # LORAPLEX_CPU_ISA=avx2: PyTorch, oneDNN, MKL on AVX2, before torch loads
    import warnings

    warnings.warn("LORAPLEX_CPU_ISA=avx2 came after torch was imported: PyTorch's, oneDNN's and MKL's kernels "
                  "keep their own dispatch; only loraplex's are held", stacklevel=2)

from loraplex.engine.llm import LLM  # noqa: E402
from loraplex.engine.request import RequestOutput  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
