"""What computes logits: LLaDA and Dream under their official names, one forward contract."""

from hf_blockbatch.models.base import DiffusionLMMixin, DiffusionLMOutput, WindowOutput
from hf_blockbatch.models.dream import DreamConfig, DreamModel
from hf_blockbatch.models.llada import LLaDAConfig, LLaDAModelLM

__all__ = [
    "DiffusionLMMixin",
    "DiffusionLMOutput",
    "DreamConfig",
    "DreamModel",
    "LLaDAConfig",
    "LLaDAModelLM",
    "WindowOutput",
]
