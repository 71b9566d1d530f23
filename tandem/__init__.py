"""tandem: LLM inference serving in Python."""

from tandem import cpu_isa

cpu_isa.apply_to_torch()  # TANDEM_CPU_ISA caps torch's kernels too, before torch loads

from tandem.core.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.2.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]


def __getattr__(name: str):
    # The engine imports torch; keep `import tandem` (and tandem.core) light.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from tandem.lora.request import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from tandem.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
