"""hf-blockbatch: BlockBatch, Fast-dLLM and vanilla decoding for diffusion LLMs in transformers.

Importing the package registers :class:`LLaDAConfig`/:class:`LLaDAModelLM` (``model_type``
``llada``) and :class:`DreamConfig`/:class:`DreamModel` (``Dream``) with transformers' Auto
classes. Explicitly registered classes win over a checkpoint's ``auto_map``, even with
``trust_remote_code=True``, so ``AutoModel.from_pretrained("GSAI-ML/LLaDA-8B-Instruct",
trust_remote_code=True)`` returns our implementation.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation import (
    BlockBatchConfig,
    BlockBatchGenerationMixin,
    DiffusionGenerateOutput,
    FastDLLMConfig,
    VanillaDiffusionConfig,
    answer_texts,
    custom_generate,
    diffusion_generate,
    enable,
    end_token_ids,
)
from hf_blockbatch.hub import TINY_DREAM, TINY_LLADA, load_model
from hf_blockbatch.models import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM

# the one place the version is written: pyproject.toml reads this literal (keep it a plain string)
__version__ = "0.1.0"


def _register() -> None:
    for config_cls, model_cls in ((LLaDAConfig, LLaDAModelLM), (DreamConfig, DreamModel)):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
        # the official LLaDA auto_map names AutoModelForCausalLM too; users write either
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


_register()

__all__ = [
    "BlockBatchConfig",
    "BlockBatchGenerationMixin",
    "BranchCache",
    "DiffusionGenerateOutput",
    "DreamConfig",
    "DreamModel",
    "FastDLLMConfig",
    "LLaDAConfig",
    "LLaDAModelLM",
    "TINY_DREAM",
    "TINY_LLADA",
    "VanillaDiffusionConfig",
    "__version__",
    "answer_texts",
    "custom_generate",
    "diffusion_generate",
    "enable",
    "end_token_ids",
    "load_model",
]
