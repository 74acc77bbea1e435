"""Dream (Dream-org/Dream-v0-Base-7B, Dream-v0-Instruct-7B): config and model, official names.

Dream is Qwen2.5 turned into a masked-diffusion model: Qwen2 parameter layout (``model.layers.N
.self_attn.q_proj`` ...), biases on q/k/v, grouped-query attention, bidirectional attention, and
**shifted logits**: the official forward's logits at position i predict token i + 1. ``forward``
returns them unshifted, exactly as the official code does; the shift is handled once, in
``forward_windows`` (``logit_shift = 1``), so decoders ask for "logits predicting [s, e)" on
both families alike.

The official remote code no longer imports on transformers 5 (it needs
``ROPE_INIT_FUNCTIONS['default']``); this implementation has no such dependency.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_blockbatch.checks import check_dropout
from hf_blockbatch.generation.mixin import BlockBatchGenerationMixin
from hf_blockbatch.models.base import DiffusionLMMixin, OwnModelTypeConfig
from hf_blockbatch.models.layers import (
    ForwardContext,
    RMSNorm,
    init_weights,
    keep_rows,
    self_attention,
    swiglu,
)

__all__ = ["DreamConfig", "DreamModel"]


class DreamConfig(OwnModelTypeConfig, PreTrainedConfig):
    """The official Dream config fields; defaults are those of Dream-v0-7B (Qwen2.5-7B geometry).

    ``window_attention`` (ours) names the attention backend for window forwards (``auto``).
    ``eot_token_id`` (ours) is the end-of-turn token, which the official configs do not name:
    ``None`` means ``<|im_end|>`` (151645) for the official 152,064-token Qwen2.5 vocabulary, else none.

    ``attention_dropout`` drops attention weights in training mode only, as Qwen2's attention does; Dream has no
    other dropout.
    """

    model_type = "Dream"
    keys_to_ignore_at_inference = ["past_key_values"]
    #: the config fields holding dropout probabilities (``DiffusionLMMixin._dropout``)
    dropout_fields = ("attention_dropout",)

    def __init__(
        self,
        vocab_size: int = 152064,
        hidden_size: int = 3584,
        intermediate_size: int = 18944,
        num_hidden_layers: int = 28,
        num_attention_heads: int = 28,
        num_key_value_heads: int | None = 4,
        hidden_act: str = "silu",
        max_position_embeddings: int = 131072,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1000000.0,
        rope_scaling: dict | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = 4096,
        max_window_layers: int = 28,
        attention_dropout: float = 0.0,
        mask_token_id: int = 151666,
        pad_token_id: int = 151643,
        bos_token_id: int | None = 151665,
        eos_token_id: int | None = 151643,
        eot_token_id: int | None = None,
        window_attention: str = "auto",
        **kwargs: Any,
    ) -> None:
        """Store the fields; ``num_key_value_heads`` None: every head; ``sliding_window`` only under
        ``use_sliding_window``; ``rope_scaling`` kept as transformers 5's ``rope_parameters``."""
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        if rope_scaling is not None:  # the official configs' name (they carry null); transformers 5 deprecates it:
            self.rope_parameters = rope_scaling  # its setter warned on every such config, and only stores it here
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window if use_sliding_window else None
        self.max_window_layers = max_window_layers
        self.attention_dropout = attention_dropout
        self.mask_token_id = mask_token_id
        self.eot_token_id = 151645 if eot_token_id is None and vocab_size == 152064 else eot_token_id
        self.window_attention = window_attention
        kwargs.setdefault("architectures", ["DreamModel"])
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim_(self) -> int:
        """The width of one attention head, ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_in_fp32(self) -> bool:
        """False: Dream, as Qwen2, casts RoPE's ``cos``/``sin`` to the activation dtype before rotating."""
        return False

    @property
    def context_length(self) -> int:
        """The longest canvas (prompt + generation) the model takes: ``new_cache`` and ``forward`` refuse longer."""
        return self.max_position_embeddings

    def kv_geometry(self) -> dict[str, int]:
        """What a :class:`BranchCache` for this model holds: ``num_layers``, ``num_kv_heads``, ``head_dim``."""
        return {
            "num_layers": self.num_hidden_layers,
            "num_kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim_,
        }

    def validate_supported(self) -> None:
        """Refuse architecture options this implementation does not compute (never guess), and a dropout
        probability outside ``[0, 1)``."""
        for field in self.dropout_fields:
            check_dropout(field, getattr(self, field))
        problems = []
        scaling = getattr(self, "rope_parameters", None) or {}  # what rope_scaling sets (transformers 5)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            problems.append(f"rope_scaling type {rope_type!r} (only the default RoPE)")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} (only 'silu')")
        if self.use_sliding_window:
            problems.append("use_sliding_window")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            problems.append("hidden_size must divide by the heads, heads by the KV heads")
        elif self.head_dim_ % 2:
            problems.append(f"head dim hidden_size/num_attention_heads = {self.head_dim_} is odd (RoPE rotates pairs)")
        if problems:
            raise NotImplementedError("This Dream config uses unsupported options: " + "; ".join(problems))


class DreamAttention(nn.Module):
    """Qwen2's attention parameters (biased q/k/v, grouped KV heads) under the checkpoints' names."""

    def __init__(self, config: DreamConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, hd = config.hidden_size, config.head_dim_
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self_attention(
            x, self.q_proj, self.k_proj, self.v_proj, self.o_proj,
            self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim, ctx, keep,
        )  # fmt: skip


class DreamMLP(nn.Module):
    """Qwen2's SwiGLU MLP under the checkpoints' names (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DreamDecoderLayer(GradientCheckpointingLayer):
    """One Qwen2 layer: pre-norm attention and MLP, as ``model.layers.N`` of the checkpoints."""

    def __init__(self, config: DreamConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DreamAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: only these rows of the flattened output (the last layer's, :func:`keep_rows`)."""
        x = keep_rows(x, keep) + self.self_attn(self.input_layernorm(x), ctx, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class DreamBaseModel(nn.Module):
    """The trunk, holding ``model.{embed_tokens, layers, norm}`` as the checkpoints name them."""

    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DreamPreTrainedModel(PreTrainedModel):
    """transformers' loading settings for Dream: the config class, the layer never split across devices."""

    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["DreamDecoderLayer"]
    #: attn_implementation="flash_attention_2" selects the flash_varlen backend (DiffusionLMMixin.attention_backend)
    _supports_flash_attn = True
    #: activation_checkpointing_enable() (gradient_checkpointing_enable()) recomputes each layer in backward
    #: (GradientCheckpointingLayer: in training mode, with gradients on; decoding runs as before)
    supports_gradient_checkpointing = True

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)


class DreamModel(DiffusionLMMixin, BlockBatchGenerationMixin, DreamPreTrainedModel):
    """Dream masked-diffusion LM; position i's logits predict token i + 1 (``logit_shift = 1``)."""

    logit_shift = 1
    layer_idx_attr = "self_attn.layer_idx"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DreamConfig) -> None:
        """Refuse what this implementation does not compute (:meth:`DreamConfig.validate_supported`), then build
        the layers and the LM head."""
        config.validate_supported()
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def diffusion_generate(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Dream's own sampler API (``alg`` = origin / maskgit_plus / topk_margin / entropy), which the
        Dream model card calls; this class replaces Dream's remote code, and it decodes through
        ``generate`` instead. Refused with what to call, rather than a bare ``AttributeError``."""
        raise NotImplementedError(
            "hf-blockbatch's DreamModel does not implement Dream's diffusion_generate (its `alg` samplers). Use "
            "model.generate(input_ids, attention_mask=..., generation_config=hf_blockbatch.VanillaDiffusionConfig("
            "max_new_tokens=..., steps=...)), FastDLLMConfig(...) or BlockBatchConfig(...)."
        )

    def get_input_embeddings(self) -> nn.Embedding:
        """``model.embed_tokens``, for transformers' ``resize_token_embeddings`` and PEFT (the table its default
        accessor would find too; named here so that the layout is stated once, beside the setter)."""
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace ``model.embed_tokens``: how ``resize_token_embeddings`` installs the resized table."""
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        """``lm_head``, which ``resize_token_embeddings`` resizes with the embedding (and ties to it again when
        ``tie_word_embeddings`` is set)."""
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        """Replace ``lm_head``: how ``resize_token_embeddings`` installs the resized head."""
        self.lm_head = value

    def _embed(self, input_ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) if embeds is None else embeds

    def _decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))
