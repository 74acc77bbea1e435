"""Decoding strategies (what gets committed when), model-agnostic, and ``generate``."""

from hf_blockbatch.generation.configs import (
    BlockBatchConfig,
    DiffusionGenerationConfig,
    FastDLLMConfig,
    VanillaDiffusionConfig,
    config_from_dict,
)
from hf_blockbatch.generation.mixin import (
    BlockBatchGenerationMixin,
    custom_generate,
    diffusion_generate,
    enable,
)
from hf_blockbatch.generation.outputs import DiffusionGenerateOutput, answer_texts, end_token_ids

__all__ = [
    "BlockBatchConfig",
    "BlockBatchGenerationMixin",
    "DiffusionGenerateOutput",
    "DiffusionGenerationConfig",
    "FastDLLMConfig",
    "VanillaDiffusionConfig",
    "answer_texts",
    "config_from_dict",
    "custom_generate",
    "diffusion_generate",
    "enable",
    "end_token_ids",
]
