"""LLaDA (GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5): config and model under the official names.

The official checkpoints ship OLMo-style remote code (``model.transformer.blocks.N.q_proj`` ...).
This module re-implements that architecture natively, with the same config fields and the same
parameter names and shapes, so the official safetensors load as they are, and adds the forward
contract of :mod:`hf_blockbatch.models.base` (window forwards over a :class:`BranchCache`).

Supported: the ``llama`` block type with RMS norms, RoPE, SwiGLU (``activation_type`` ``silu``),
optional biases, optional weight tying, ``input_emb_norm`` and ``scale_logits``: every option the
released checkpoints use. Other OLMo options (ALiBi, the ``sequential`` block, QK norms) are
refused with a clear error rather than silently computed wrong.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_blockbatch.checks import check_dropout
from hf_blockbatch.generation.mixin import BlockBatchGenerationMixin
from hf_blockbatch.models.base import DiffusionLMMixin, OwnModelTypeConfig
from hf_blockbatch.models.layers import (
    ForwardContext,
    RMSNorm,
    dropout,
    init_weights,
    keep_rows,
    self_attention,
    swiglu,
)

__all__ = ["LLaDAConfig", "LLaDAModelLM"]


class LLaDAConfig(OwnModelTypeConfig, PreTrainedConfig):
    """The official LLaDA config fields; defaults are those of LLaDA-8B-Instruct.

    ``window_attention`` (ours) names the attention backend for window forwards (``auto``).
    ``eot_token_id`` (ours) is the end-of-turn token, which the official configs do not name:
    ``None`` means ``<|eot_id|>`` (126348) for the official 126,464-token vocabulary, else none.

    The dropouts apply in training mode only, where the official code applies them: ``embedding_dropout`` to the
    embeddings (after ``input_emb_norm``'s scaling), ``attention_dropout`` to the attention weights,
    ``residual_dropout`` to each block's attention and MLP outputs before they join the residual stream.
    """

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]
    #: the config fields holding dropout probabilities (``DiffusionLMMixin._dropout``)
    dropout_fields = ("embedding_dropout", "attention_dropout", "residual_dropout")

    def __init__(
        self,
        d_model: int = 4096,
        n_heads: int = 32,
        n_kv_heads: int | None = 32,
        n_layers: int = 32,
        mlp_ratio: int = 4,
        mlp_hidden_size: int | None = 12288,
        activation_type: str = "silu",
        block_type: str = "llama",
        block_group_size: int = 1,
        alibi: bool = False,
        alibi_bias_max: float = 8.0,
        rope: bool = True,
        rope_full_precision: bool = True,
        rope_theta: float = 500000.0,
        flash_attention: bool = False,
        attention_dropout: float = 0.0,
        multi_query_attention: bool | None = None,
        attention_layer_norm: bool = False,
        residual_dropout: float = 0.0,
        embedding_dropout: float = 0.0,
        input_emb_norm: bool = False,
        layer_norm_type: str = "rms",
        layer_norm_with_affine: bool = True,
        rms_norm_eps: float = 1e-5,
        attention_layer_norm_with_affine: bool = True,
        max_sequence_length: int = 4096,
        include_qkv_bias: bool | None = False,
        include_bias: bool = False,
        bias_for_layer_norm: bool | None = False,
        scale_logits: bool = False,
        vocab_size: int = 126464,
        embedding_size: int | None = 126464,
        weight_tying: bool = False,
        eos_token_id: int = 126081,
        pad_token_id: int = 126081,
        mask_token_id: int | None = 126336,
        eot_token_id: int | None = None,
        init_device: str | None = None,
        init_fn: str = "mitchell",
        init_std: float = 0.02,
        init_cutoff_factor: float | None = None,
        precision: str | None = None,
        use_cache: bool = False,
        window_attention: str = "auto",
        **kwargs: Any,
    ) -> None:
        """Store the fields, with transformers' generic ``tie_word_embeddings`` kept off (``weight_tying`` ties)."""
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_layers = n_layers
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_size = mlp_hidden_size
        self.activation_type = activation_type
        self.block_type = block_type
        self.block_group_size = block_group_size
        self.alibi = alibi
        self.alibi_bias_max = alibi_bias_max
        self.rope = rope
        self.rope_full_precision = rope_full_precision
        self.rope_theta = rope_theta
        self.flash_attention = flash_attention
        self.attention_dropout = attention_dropout
        self.multi_query_attention = multi_query_attention
        self.attention_layer_norm = attention_layer_norm
        self.residual_dropout = residual_dropout
        self.embedding_dropout = embedding_dropout
        self.input_emb_norm = input_emb_norm
        self.layer_norm_type = layer_norm_type
        self.layer_norm_with_affine = layer_norm_with_affine
        self.rms_norm_eps = rms_norm_eps
        self.attention_layer_norm_with_affine = attention_layer_norm_with_affine
        self.max_sequence_length = max_sequence_length
        self.include_qkv_bias = include_qkv_bias
        self.include_bias = include_bias
        self.bias_for_layer_norm = bias_for_layer_norm
        self.scale_logits = scale_logits
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.weight_tying = weight_tying
        self.mask_token_id = mask_token_id
        self.eot_token_id = 126348 if eot_token_id is None and vocab_size == 126464 else eot_token_id
        self.init_device = init_device
        self.init_fn = init_fn
        self.init_std = init_std
        self.init_cutoff_factor = init_cutoff_factor
        self.precision = precision
        self.use_cache = use_cache
        self.window_attention = window_attention
        kwargs.setdefault("architectures", ["LLaDAModelLM"])
        # weight tying is LLaDA's own field; keep transformers' generic tying off so it never
        # ties (or unties) behind our back
        kwargs["tie_word_embeddings"] = False
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    # ---- the names the rest of the package reads ------------------------------------------
    @property
    def effective_n_kv_heads(self) -> int:
        """``n_kv_heads``, or when it is None what the official code derives: 1 under ``multi_query_attention``,
        else ``n_heads``."""
        if self.n_kv_heads is None:
            return 1 if self.multi_query_attention else self.n_heads
        return self.n_kv_heads

    @property
    def effective_mlp_hidden_size(self) -> int:
        """The MLP's hidden width: ``mlp_hidden_size``, or when it is None ``mlp_ratio × d_model`` (the official rule)."""
        return self.mlp_hidden_size or self.mlp_ratio * self.d_model

    @property
    def head_dim_(self) -> int:
        """The width of one attention head, ``d_model // n_heads``; both configs name it so for the layers."""
        return self.d_model // self.n_heads

    @property
    def rope_in_fp32(self) -> bool:
        """Whether RoPE rotates with float32 ``cos``/``sin``: the official config's ``rope_full_precision``."""
        return bool(self.rope_full_precision)

    @property
    def context_length(self) -> int:
        """The longest canvas (prompt + generation) the model takes: ``new_cache`` and ``forward`` refuse longer."""
        return self.max_sequence_length

    @property
    def num_hidden_layers(self) -> int:
        """``n_layers`` under transformers' standard name, which transformers and the rest of the package read."""
        return self.n_layers

    @property
    def hidden_size(self) -> int:
        """``d_model`` under transformers' standard name, which transformers and the rest of the package read."""
        return self.d_model

    @property
    def num_attention_heads(self) -> int:
        """``n_heads`` under transformers' standard name, which transformers and the rest of the package read."""
        return self.n_heads

    def kv_geometry(self) -> dict[str, int]:
        """What a :class:`BranchCache` for this model holds: ``num_layers``, ``num_kv_heads``, ``head_dim``."""
        return {"num_layers": self.n_layers, "num_kv_heads": self.effective_n_kv_heads, "head_dim": self.head_dim_}

    def validate_supported(self) -> None:
        """Refuse architecture options this implementation does not compute (never guess), and dropout
        probabilities outside ``[0, 1)``."""
        for field in self.dropout_fields:
            check_dropout(field, getattr(self, field))
        problems = []
        if self.alibi or not self.rope:
            problems.append("only RoPE position encoding is supported (alibi=False, rope=True)")
        if self.block_type != "llama":
            problems.append(f"block_type {self.block_type!r} (only 'llama')")
        if self.layer_norm_type != "rms" or not self.layer_norm_with_affine:
            problems.append(f"layer_norm_type {self.layer_norm_type!r} (only affine 'rms')")
        # 'swiglu' halves the hidden width in the official code, whose llama block cannot run it
        if self.activation_type != "silu":
            problems.append(f"activation_type {self.activation_type!r} (only 'silu')")
        if self.attention_layer_norm:
            problems.append("attention_layer_norm (QK norms)")
        # the official norms carry a bias when bias_for_layer_norm is true, or None with include_bias
        if self.include_bias if self.bias_for_layer_norm is None else self.bias_for_layer_norm:
            problems.append("layer norm biases (bias_for_layer_norm, or include_bias with bias_for_layer_norm=None)")
        if self.block_group_size != 1:
            problems.append("block_group_size != 1")
        # both set and contradicting each other: the official config refuses it rather than let one win
        mqa = self.multi_query_attention
        if self.n_kv_heads is not None and mqa is not None and self.n_kv_heads != (1 if mqa else self.n_heads):
            problems.append(
                f"n_kv_heads={self.n_kv_heads} contradicts multi_query_attention={self.multi_query_attention} "
                "(set multi_query_attention to null)"
            )
        if self.d_model % self.n_heads or self.n_heads % self.effective_n_kv_heads:
            problems.append("d_model must divide by n_heads, n_heads by n_kv_heads")
        elif self.head_dim_ % 2:
            problems.append(f"head dim d_model/n_heads = {self.head_dim_} is odd (RoPE rotates pairs)")
        if self.embedding_size is not None and self.embedding_size < self.vocab_size:
            problems.append(f"embedding_size {self.embedding_size} < vocab_size {self.vocab_size}")
        if problems:
            raise NotImplementedError("This LLaDA config uses unsupported options: " + "; ".join(problems))


class LLaDALlamaBlock(GradientCheckpointingLayer):
    """One LLaDA block: pre-norm attention and SwiGLU MLP, with the official parameter names."""

    def __init__(self, config: LLaDAConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, hd, kvh = config.d_model, config.head_dim_, config.effective_n_kv_heads
        hidden = config.effective_mlp_hidden_size
        qkv_bias = bool(config.include_bias or config.include_qkv_bias)
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, kvh, hd
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kvh * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kvh * hd, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.up_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.ff_out = nn.Linear(hidden, d, bias=config.include_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: only these rows of the flattened output (the last layer's, :func:`keep_rows`)."""
        att = self_attention(
            self.attn_norm(x), self.q_proj, self.k_proj, self.v_proj, self.attn_out,
            self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim, ctx, keep,
        )  # fmt: skip
        x = keep_rows(x, keep) + dropout(att, ctx.residual_dropout)
        h = self.ff_norm(x)
        return x + dropout(self.ff_out(swiglu(self.ff_proj(h), self.up_proj(h))), ctx.residual_dropout)


class LLaDAModel(nn.Module):
    """The trunk, holding ``transformer.{wte, blocks, ln_f, ff_out}`` as the checkpoints name them."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        modules = {
            "wte": nn.Embedding(config.embedding_size or config.vocab_size, config.d_model),
            "blocks": nn.ModuleList(LLaDALlamaBlock(config, i) for i in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        }
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(
                config.d_model, config.embedding_size or config.vocab_size, bias=config.include_bias
            )
        self.transformer = nn.ModuleDict(modules)


class LLaDAPreTrainedModel(PreTrainedModel):
    """transformers' loading settings for LLaDA: the config class, the block never split across devices."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDALlamaBlock"]
    #: attn_implementation="flash_attention_2" selects the flash_varlen backend (DiffusionLMMixin.attention_backend)
    _supports_flash_attn = True
    #: activation_checkpointing_enable() (gradient_checkpointing_enable()) recomputes each layer in backward
    #: (GradientCheckpointingLayer: in training mode, with gradients on; decoding runs as before)
    supports_gradient_checkpointing = True

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.init_std)


class LLaDAModelLM(DiffusionLMMixin, BlockBatchGenerationMixin, LLaDAPreTrainedModel):
    """LLaDA masked-diffusion LM; position i's logits predict token i (``logit_shift = 0``)."""

    logit_shift = 0
    layer_count_field = "n_layers"

    def __init__(self, config: LLaDAConfig) -> None:
        """Refuse what this implementation does not compute (:meth:`LLaDAConfig.validate_supported`), then build
        the model."""
        config.validate_supported()
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """``model.transformer.wte`` (the official parameter names), for ``resize_token_embeddings`` and PEFT:
        transformers' default accessor looks for ``embed_tokens`` and raises ``NotImplementedError`` here."""
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace ``model.transformer.wte``: how ``resize_token_embeddings`` installs the resized table."""
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module:
        """The head's weight holder, as in the official code: ``wte`` when tied, else ``ff_out``.

        transformers' ``resize_token_embeddings`` resizes the head through this pair; without it an
        untied head kept the old vocabulary while the embedding grew.
        """
        t = self.model.transformer
        return t.wte if self.config.weight_tying else t.ff_out

    def set_output_embeddings(self, value: nn.Module) -> None:
        """Replace what :meth:`get_output_embeddings` returns (``wte`` when tied, else ``ff_out``): how
        ``resize_token_embeddings`` installs the resized head."""
        if self.config.weight_tying:
            self.model.transformer.wte = value
        else:
            self.model.transformer.ff_out = value

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize, keeping ``embedding_size`` (the row count ``from_pretrained`` builds the
        tables with) in step, so that a resized model saves and loads back."""
        out = super().resize_token_embeddings(*args, **kwargs)
        self.config.embedding_size = self.get_input_embeddings().weight.shape[0]
        return out

    def _embed(self, input_ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.model.transformer.wte(input_ids) if embeds is None else embeds  # the official order: then the norm
        if self.config.input_emb_norm:
            x = x * (self.config.d_model**0.5)
        return dropout(x, self._dropout("embedding_dropout"))  # (then the dropout, in training mode)

    def _decoder_layers(self) -> nn.ModuleList:
        return self.model.transformer.blocks

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.model.transformer.ln_f(hidden)
        if self.config.weight_tying:
            wte = self.model.transformer.wte
            if not isinstance(wte.weight, torch.Tensor):  # a quantized embedding's weight is a method, which failed below
                raise TypeError(
                    f"The LM head is tied to model.transformer.wte (config.weight_tying), here a "
                    f"{type(wte).__module__}.{type(wte).__qualname__}, whose weight is no tensor to project onto: quantize the Linear layers only, e.g. "
                    "torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)."
                )
            loaded = contextlib.nullcontext()
            if wte.weight.device.type == "meta":
                # Offloaded by accelerate: the tied weight is loaded only around the embedding's own forward,
                # and a linear with a meta weight returns uninitialised memory rather than an error.
                from accelerate.utils import align_module_device

                loaded = align_module_device(wte)
            with loaded:
                logits = F.linear(hidden, wte.weight)
        else:
            logits = self.model.transformer.ff_out(hidden)
        if self.config.scale_logits:
            logits = logits * (1 / math.sqrt(self.config.d_model))
        return logits
