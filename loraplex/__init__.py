"""loraplex: multi-tenant LoRA serving on one shared base model."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__"]

if TYPE_CHECKING:
    from loraplex.engine.llm import LLM
    from loraplex.engine.lora_request import LoRARequest
    from loraplex.engine.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.sampling_params import SamplingParams

_LAZY = {
    "LLM": "loraplex.engine.llm",
    "SamplingParams": "loraplex.engine.sampling_params",
    "RequestOutput": "loraplex.engine.outputs",
    "CompletionOutput": "loraplex.engine.outputs",
    "LoRARequest": "loraplex.engine.lora_request",
}


def __getattr__(name: str):
    # Importing torch costs seconds; `loraplex --help` and the control plane's light paths should not pay it.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
