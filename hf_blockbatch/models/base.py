"""The forward contract every masked-diffusion model of this package offers the decoders.

* ``model(input_ids, attention_mask=None, cache=None, use_cache=False, cache_rows=None)``
  is the official full forward: logits for every position (Dream's unshifted, as its official
  forward returns them), and, with a :class:`BranchCache`, K/V of every position written into
  rows ``cache_rows`` (all rows when ``None``).
* ``model.forward_windows(input_ids, starts, ends, cache, rows=None)``: each row ``r`` asks for
  the logits that **predict** canvas positions ``[start_r, end_r)``. The queries use their true
  positions for RoPE, attend to the row's whole cache, and their K/V are written into the cache
  in place. For a shifted model (Dream, ``logit_shift = 1``) the logits predicting position ``p``
  come from the hidden state at ``p - 1``, so the query window is ``[start - 1, end)``: one extra
  query per row, whose K/V refresh is a bonus, and whose last hidden state is simply not sent
  through the head. The decoders never see the shift.
* Rows may be left-padded: padding is masked out of attention and does not shift positions.
* The full forward also takes a bool per-query mask (``[B, L, L]`` or ``[B, 1, L, L]``, transformers'
  custom 4D mask) with ``position_ids``, without a cache: queries that see different keys, such as a
  research decoder's leave-one-out checks (``benchmarks/commit_rules_probe.py``).
* Both forwards take an optional ``logits_mask`` (bool, over the rows of the logits they would
  return): only those hidden states go through the head, and the logits come back packed,
  ``[n, V]`` in row-major order. A decoder reads a fraction of the positions it queries (the
  still-masked ones), and on a small model the head is a large part of a forward (at vocabulary
  1024 and width 128 it costs as much as all four layers), as transformers' ``logits_to_keep``
  saves it in autoregressive decoding. The last layer, too, computes only those rows past its attention
  (output projection, residual, MLP; ``layers.keep_rows``; a forward hook on it then sees those rows, packed
  ``[n, C]``): every query's K/V still reach the cache, and on the tiny models a batch-32 decode took
  0.80-0.97x its time before (RESULTS §46). Optional in the contract: see ``supports_logits_mask``.
* ``model.forward_positions(input_ids, predict, refresh, cache, rows=None)`` (optional:
  ``supports_position_queries``): like a window forward, but each row's queries are any set of
  positions: those whose hidden states predict the ``predict`` positions (shifted by
  ``logit_shift``, as above), and the ``refresh`` positions, whose K/V are rewritten in the cache
  and whose logits are not needed. A decoder that knows which K/V are stale queries only those and
  the masks it reads (``window_queries="sparse"``).

Subclasses provide the embedding, the decoder layers and the head under the official names.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

from hf_blockbatch.attention.backends import AttentionBackend, get_backend
from hf_blockbatch.attention.metadata import WindowBatch, build_query_batch, build_window_batch, packed_index
from hf_blockbatch.cache import BranchCache, checked_padding_mask
from hf_blockbatch.checks import check_dropout, check_token_ids
from hf_blockbatch.models.layers import ForwardContext, RopeTable

logger = logging.getLogger(__name__)

__all__ = ["DiffusionLMOutput", "PositionOutput", "WindowOutput", "DiffusionLMMixin", "OwnModelTypeConfig"]


#: the (config class, field) pairs :meth:`OwnModelTypeConfig.__init__` has warned of: once each per process
_warned_dropouts: set[tuple[str, str]] = set()


class OwnModelTypeConfig:
    """A base for our model configs (before ``PreTrainedConfig``): ``from_dict``, which every ``from_pretrained``
    goes through, refuses a config.json of another ``model_type``. transformers only warns, then builds the class's
    config from the fields both formats share and the class's defaults for the rest. Ours default to the official
    7-8B geometries, so ``DreamModel.from_pretrained(<a LLaDA folder>)`` built a 7B Dream from the defaults (out of
    memory on a laptop, random weights otherwise), and ``LLaDAModelLM.from_pretrained(<a Dream folder>)`` failed
    inside transformers (``property 'hidden_size' of 'LLaDAConfig' object has no setter``). No ``model_type``: nothing
    to tell, accepted.

    A dropout the family does not have (``DreamConfig(residual_dropout=0.1)``, LLaDA's name on Dream, or a typo such
    as ``attn_dropout``) is kept, unused, as transformers keeps every unknown key; a warning names it, once."""

    #: the config fields holding dropout probabilities; each config class names its own
    dropout_fields: tuple[str, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        """transformers' ``__init__``, after a warning for each key of ``kwargs`` (those the class does not take)
        that names a dropout, set above 0: the model applies none of them, and the user thought dropout was on.
        Not refused: checkpoints with extra keys must still load."""
        for key, value in kwargs.items():
            if ("dropout" not in key and "pdrop" not in key) or key in self.dropout_fields:
                continue
            if value is None or (isinstance(value, (int, float)) and value == 0) or (type(self).__name__, key) in _warned_dropouts:
                continue
            _warned_dropouts.add((type(self).__name__, key))
            logger.warning(
                "%s has no %s (%r given): it is kept in the config, unused, and no dropout applies it. This "
                "family's dropout fields: %s.", type(self).__name__, key, value, ", ".join(self.dropout_fields),
            )
        super().__init__(**kwargs)  # type: ignore[call-arg]

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers' ``from_dict``, after refusing a ``config_dict`` of another ``model_type`` (see the class)."""
        given = config_dict.get("model_type")
        if given is not None and given != cls.model_type:
            raise ValueError(
                f"This config is of model_type {given!r}, and {cls.__name__} reads {cls.model_type!r} ones: "
                "load the checkpoint with AutoModel.from_pretrained (or hb.load_model), which picks the class from its "
                "model_type."
            )
        return super().from_dict(config_dict, **kwargs)  # type: ignore[misc]


def _check_forward_extras(kwargs: dict) -> None:
    """What ``forward``'s ``**kwargs`` (transformers' other forward arguments) must not pass in silence."""
    if kwargs.get("output_hidden_states"):
        raise NotImplementedError(
            "output_hidden_states: this forward returns logits (and the cache) only; register a forward hook on the "
            "decoder layers to read their hidden states."
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions: attention here is fused (SDPA / flash): no weights exist to return.")
    if kwargs.get("labels") is not None:
        warnings.warn(
            "labels are not used: a masked-diffusion loss needs the noised input and its masked positions, so no loss "
            "is computed here (as the official LLaDA code). hf_blockbatch.training.objective has apply_noise and "
            "sft_loss.",
            UserWarning,
            stacklevel=3,  # the forward (frame 2) is called by nn.Module: frame 3 is as near the caller as it gets
        )


@dataclass
class DiffusionLMOutput(ModelOutput):
    """Output of the full forward."""

    logits: torch.Tensor | None = None
    cache: BranchCache | None = None


@dataclass
class WindowOutput(ModelOutput):
    """Output of a window forward: packed logits ``[Σ(end - start), V]`` in row order, and the
    cumulative lengths ``[A + 1]`` that cut them back into rows."""

    logits: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None


@dataclass
class PositionOutput(ModelOutput):
    """Output of :meth:`DiffusionLMMixin.forward_positions`: packed logits ``[n, V]`` of the
    predicted positions in row-major order, and the ``[A, L]`` bool of the positions queried."""

    logits: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None


class DiffusionLMMixin:
    """Shared implementation of the forward contract (mixed into a ``PreTrainedModel``)."""

    #: 0: position i's logits predict token i (LLaDA); 1: they predict token i + 1 (Dream)
    logit_shift: int = 0
    #: both forwards accept ``logits_mask`` (a model without it gets dense logits and the decoder selects)
    supports_logits_mask: bool = True
    #: ``forward_positions`` is available (``window_queries="sparse"`` needs it)
    supports_position_queries: bool = True
    #: where a decoder layer keeps the cache slot it writes (set when built), and the config field counting the layers
    layer_idx_attr: str = "layer_idx"
    layer_count_field: str = "num_hidden_layers"

    # ---- where the forward runs ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this model computes on, where the decoders keep their state and the cache.

        transformers says the first parameter's device. That is right unless accelerate has offloaded
        the weights (``cpu_offload``, ``disk_offload``, or a ``device_map`` whose first module is
        offloaded): they then sit on ``meta`` between forwards, and a tensor made there has no data.
        The forward runs on its hooks' execution device, so that is the answer then."""
        return self._placement()[0]

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """``(device, dtype)`` from one parameter read: :attr:`device` and what the backend and the cache
        are built for (the backend is asked every forward)."""
        p = next(self.parameters())
        if p.device.type != "meta":
            return p.device, p.dtype
        return self._execution_device(), p.dtype

    def _execution_device(self) -> torch.device:
        """Where accelerate's hooks run the forward of weights offloaded to ``meta``."""
        for module in self.modules():
            hook = getattr(module, "_hf_hook", None)
            for h in getattr(hook, "hooks", (hook,)):  # accelerate's SequentialHook holds several
                if getattr(h, "execution_device", None) is not None:
                    return torch.device(h.execution_device)
        raise RuntimeError(
            f"{type(self).__name__}'s weights are on the meta device and no accelerate hook says where they "
            "compute: load them (from_pretrained without device_map='meta', or init_empty_weights followed by "
            "load_checkpoint_and_dispatch) before generating."
        )

    # ---- provided by the family classes --------------------------------------------------
    def _embed(self, input_ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: the embeddings of ``input_ids``, or ``embeds`` given for them (``inputs_embeds``)."""
        raise NotImplementedError

    def _decoder_layers(self) -> torch.nn.ModuleList:
        """The decoder layers in order, each called ``layer(hidden, ctx)`` (the last one with ``keep``)."""
        raise NotImplementedError

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the last layer's hidden states (final norm, then the LM head), any leading shape."""
        raise NotImplementedError

    def _rope(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        table = getattr(self, "_rope_table", None)
        if table is None or (table.head_dim, table.theta) != (cfg.head_dim_, cfg.rope_theta):
            table = self._rope_table = RopeTable(cfg.head_dim_, cfg.rope_theta)
        return table(positions, length)

    def _dropout(self, field: str) -> float:
        """``config.<field>``, a dropout probability, in training mode (checked: the config may have changed since
        the model was built); 0.0 in eval mode, where nothing is read, or where the family's official code has no
        such dropout (``config.dropout_fields`` names those it has)."""
        if not self.training or field not in self.config.dropout_fields:
            return 0.0
        return check_dropout(f"config.{field}", getattr(self.config, field))

    def _context(self, mode: str, positions: torch.Tensor, length: int, **kwargs: Any) -> ForwardContext:
        """What every layer of one forward shares (see ``ForwardContext``).

        Training runs the full forward (``dense``), where the attention weights' dropout applies, as in the
        official codes. A window forward (cached decoding) in training mode with ``attention_dropout`` on is
        refused: its backends (flash and torch varlen among them) take no dropout, and decoding with dropout on
        is a model left in training mode. So is a cached forward with gradients on in training mode while activation
        checkpointing is on (its recompute would read and write the cache as later forwards left it)."""
        if (self.training and torch.is_grad_enabled() and (mode == "window" or kwargs.get("cache") is not None)
                and any(getattr(layer, "gradient_checkpointing", False) for layer in self._decoder_layers())):
            # the recompute in backward would write stale K/V over the cache's later ones, and a window forward's
            # would attend to what the cache holds by then: wrong gradients, where without it autograd refuses
            raise ValueError(
                "Activation checkpointing is on and this forward writes or reads a cache with gradients on in training "
                "mode: the backward's recompute would see the cache as later forwards left it. Forward without a "
                "cache to train, decode under torch.no_grad() or model.eval(), or call gradient_checkpointing_disable()."
            )
        attention_dropout = self._dropout("attention_dropout")
        if attention_dropout and mode == "window":
            raise ValueError(
                f"This model is in training mode with config.attention_dropout={attention_dropout}, and a cached "
                "window forward (decoding) applies no dropout: call model.eval() before decoding."
            )
        cos, sin = self._rope(positions, length)
        return ForwardContext(mode=mode, backend=self.attention_backend, cos=cos, sin=sin,
                              rope_full_precision=self.config.rope_in_fp32, attention_dropout=attention_dropout,
                              residual_dropout=self._dropout("residual_dropout"), **kwargs)  # fmt: skip

    # ---- attention backend ---------------------------------------------------------------
    @property
    def attention_backend(self) -> AttentionBackend:
        """The backend for window forwards, chosen from ``config.window_attention`` on first use
        (``auto``: flash varlen, else torch varlen on CUDA, else SDPA grouped by window length) and logged once.

        transformers' spelling, ``from_pretrained(..., attn_implementation="flash_attention_2")``, asks
        for ``flash_varlen`` when ``window_attention`` is ``auto``: the user said flash, and a backend
        that cannot run here should say so rather than fall back in silence."""
        name = self.config.window_attention
        device, dtype = self._placement()
        if name == "auto" and getattr(self.config, "_attn_implementation", None) == "flash_attention_2":
            name = "flash_varlen"
        key = (name, device, dtype)
        if getattr(self, "_backend_key", None) != key:
            self._backend = get_backend(name, device, dtype)
            self._backend_key = key
            logger.info("%s: window attention backend %r on %s/%s", type(self).__name__, self._backend.name,
                        device, dtype)
        return self._backend

    def set_attention_backend(self, name: str) -> None:
        """Choose the window attention backend by name (``auto``, ``flash_varlen``,
        ``torch_varlen``, ``sdpa``, ``reference``); stored in the config so it saves and loads. A name refused here
        leaves the backend as it was (it stayed in the config, and every later forward failed on it)."""
        before = self.config.window_attention
        self.config.window_attention = name
        self._backend_key = None
        try:
            _ = self.attention_backend  # validate now, not at the first forward
        except ValueError:
            self.config.window_attention = before
            raise

    # ---- caches --------------------------------------------------------------------------
    def _check_layer_slots(self) -> None:
        """Each decoder layer writes the cache slot its ``layer_idx`` names, fixed when the model was built, and the
        cache counts a forward's writes at slot 0. After layer surgery (a layer removed, layers duplicated or
        reordered: pruning, depth up-scaling) the slots no longer follow the layers: a cached decode failed with
        ``IndexError`` in the cache, or, with layers duplicated, two layers wrote one slot and the tokens were
        silently wrong. Refused here with how to renumber; checked once per cache built (a Python read per layer)."""
        layers = self._decoder_layers()
        slots = [operator.attrgetter(self.layer_idx_attr)(layer) for layer in layers]
        count = self.config.kv_geometry()["num_layers"]
        if slots != list(range(len(layers))) or len(layers) > count:
            raise ValueError(
                f"The {len(layers)} decoder layers write cache slots {slots} (their {self.layer_idx_attr}) and the config "
                f"counts {count} layers; a cached decode needs each layer's slot to be its position: after removing, "
                f"duplicating or reordering layers, set layer.{self.layer_idx_attr} = i for each i, layer in "
                f"enumerate(layers), and config.{self.layer_count_field} = {len(layers)}."
            )

    def new_cache(self, num_rows: int, length: int, attention_mask: torch.Tensor | None = None) -> BranchCache:
        """An empty :class:`BranchCache` for this model's geometry, device and dtype (after
        :meth:`_check_layer_slots`)."""
        for name, value in (("num_rows", num_rows), ("length", length)):  # (torch said "negative dimension")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        limit = self.config.context_length
        if limit and length > limit:  # (the next forward would have failed)
            raise ValueError(f"length={length} exceeds the model's context of {limit} positions.")
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a [num_rows, length] tensor, got {type(attention_mask).__name__}.")
        placed = {str(d) for d in (getattr(self, "hf_device_map", None) or {}).values()} - {"cpu", "disk"}
        if len(placed) > 1:  # the storage, the masks and the step's metadata all live on one device
            raise NotImplementedError(
                f"This model is split over devices {sorted(placed)} (device_map), and the decoding cache lives on "
                "one device: decode it without a cache (VanillaDiffusionConfig, or FastDLLMConfig(cache='none')), or "
                "load it on one GPU (device='cuda'; LLaDA-8B and Dream-7B fit one GPU in bf16)."
            )
        self._check_layer_slots()
        device, dtype = self._placement()
        return BranchCache.for_model(self.config, num_rows, length, dtype=dtype, device=device,
                                     attention_mask=attention_mask)  # fmt: skip

    @staticmethod
    def _check_cache_type(cache: Any) -> None:
        """A cache is a :class:`BranchCache`: a transformers ``Cache`` (a left-to-right prefix, as PEFT's prefix tuning
        passes in ``past_key_values``) is refused by name, before the other arguments are read against it."""
        if not isinstance(cache, BranchCache):
            raise TypeError(
                f"the cache (cache= or past_key_values=) must be a hf_blockbatch.BranchCache (from model.new_cache), got "
                f"{type(cache).__name__}: a left-to-right cache (transformers' Cache, PEFT's prefix tuning) has no meaning "
                "for a masked-diffusion forward."
            )

    def _check_cache(self, cache: BranchCache, length: int) -> None:
        self._check_cache_type(cache)
        geometry = self.config.kv_geometry()
        layer = cache.layers[0].keys
        if (
            cache.model_type not in (None, self.config.model_type)
            or len(cache.layers) != geometry["num_layers"]
            or layer.shape[2] != geometry["num_kv_heads"]
            or layer.shape[3] != geometry["head_dim"]
        ):
            raise ValueError(
                f"This cache was built for another model ({cache!r}); build one with this model's new_cache()."
            )
        # a cache of another dtype or device: a full forward cast its K/V into it in silence, and the next window
        # forward failed inside the attention kernel ("Expected query, key, and value to have the same dtype").
        # Device types only: an accelerate hook may name "cuda" where the cache's tensors say "cuda:0"
        device, dtype = self._placement()
        if cache.dtype != dtype or cache.device.type != device.type:
            raise ValueError(
                f"This cache holds {cache.dtype} K/V on {cache.device}, and the model computes in {dtype} on {device}: "
                "build the cache with this model's new_cache() (after any model.to())."
            )
        if cache.length != length:
            raise ValueError(f"The cache holds canvases of length {cache.length}, but input_ids has length {length}.")

    @staticmethod
    def _check_id_dtype(input_ids: torch.Tensor) -> None:
        """Token ids are integers: float ids failed inside the embedding (no host read: the dtype alone)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            what = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor of token ids, got {what}.")

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [rows, length], got shape {tuple(input_ids.shape)}.")
        limit = self.config.context_length
        if limit and input_ids.shape[1] > limit:
            raise ValueError(
                f"The canvas has {input_ids.shape[1]} positions but the model's context is {limit} "
                "(config.max_sequence_length / max_position_embeddings): shorten the prompt or max_new_tokens."
            )

    def _check_window_inputs(self, input_ids: torch.Tensor, cache: BranchCache) -> None:
        """What the cached forwards (windows, positions) need: the canvas of every cache row."""
        self._check_id_dtype(input_ids)
        self._check_ids(input_ids)
        self._check_cache(cache, input_ids.shape[1])
        if input_ids.shape[0] != cache.num_rows:
            raise ValueError(
                f"input_ids has {input_ids.shape[0]} rows but the cache has {cache.num_rows}: pass the canvas of "
                "every cache row and select the active ones with `rows`."
            )

    # ---- the two forwards ----------------------------------------------------------------
    def _run(self, hidden: torch.Tensor, ctx: ForwardContext, keep: torch.Tensor | None = None) -> torch.Tensor:
        *body, last = self._decoder_layers()  # (slicing a ModuleList builds a new one: 11 µs a forward)
        for layer in body:
            hidden = layer(hidden, ctx)
        return last(hidden, ctx, keep)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: BranchCache | None = None,
        use_cache: bool | None = None,
        cache_rows: torch.Tensor | Sequence[int] | None = None,
        return_dict: bool | None = None,
        past_key_values: BranchCache | None = None,
        logits_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> DiffusionLMOutput | tuple:
        """Full bidirectional forward over every position of every row (see module docstring).

        ``past_key_values`` is accepted as the older name of ``cache`` (transformers 5 renamed it).
        ``inputs_embeds`` (``[B, L, hidden]``) stand for the embedding lookup of ``input_ids``, as in both official
        forwards (LLaDA's ``input_emb_norm`` scaling still applies): research on soft prompts or attributions feeds
        vectors, not ids. The decoders always pass ids.
        ``logits_mask`` (bool ``[B, L]``): return only those positions' logits, packed ``[n, V]``.
        ``attention_mask`` is the ``[B, L]`` padding mask, or a bool per-query mask ``[B, L, L]`` /
        ``[B, 1, L, L]`` (uncached; positions default to ``0..L-1``, see :meth:`_forward_custom_mask`).
        Other keyword arguments of transformers' forwards are accepted and unused, except those whose
        answer this forward does not give: ``output_hidden_states`` / ``output_attentions`` are refused,
        and ``labels`` gets the official LLaDA code's warning (no loss is computed here).
        """
        _check_forward_extras(kwargs)
        if cache is None:
            cache = past_key_values
        if cache is not None:  # (a transformers Cache with a wider attention_mask was refused for the mask's shape)
            self._check_cache_type(cache)
        embeds = self._checked_embeds(input_ids, inputs_embeds)
        if embeds is not None:
            input_ids = embeds[..., 0]  # [B, L]: the shape and device the checks below read
        else:  # ids outside the table failed inside the embedding; one host read (the decoders' full forwards are rare)
            self._check_id_dtype(input_ids)
            check_token_ids(self, input_ids)
        self._check_ids(input_ids)
        B, L = input_ids.shape
        if attention_mask is not None and attention_mask.dim() in (3, 4):
            return self._forward_custom_mask(input_ids, attention_mask, position_ids, cache, use_cache, logits_mask,
                                             return_dict, embeds)  # fmt: skip
        if attention_mask is not None:
            attention_mask = checked_padding_mask(attention_mask.to(input_ids.device))
            if attention_mask.shape != (B, L):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, L)} (padding), or "
                                 f"{(B, L, L)} / {(B, 1, L, L)} for a bool mask per query.")  # fmt: skip
        if use_cache and cache is None:
            cache = self.new_cache(B, L, attention_mask)
        if cache is not None:
            self._check_cache(cache, L)
            if cache_rows is not None:
                cache_rows = torch.as_tensor(cache_rows, device=cache.device, dtype=torch.long)
                if cache_rows.numel() != B:
                    raise ValueError(f"cache_rows names {cache_rows.numel()} rows but input_ids has {B}.")
            elif cache.num_rows != B:
                raise ValueError(
                    f"The cache has {cache.num_rows} rows but input_ids has {B}; pass cache_rows to fill a subset."
                )
            # The cache's padding mask is the one its K/V, RoPE positions and later window forwards
            # follow: a full forward into it must use the same one (it is the default).
            if attention_mask is None:
                if cache.has_padding:
                    attention_mask = cache.key_mask if cache_rows is None else cache.key_mask[cache_rows]
            else:
                cache_mask = cache.key_mask if cache_rows is None else cache.key_mask[cache_rows]
                if not torch.equal(attention_mask, cache_mask):
                    raise ValueError(
                        "attention_mask differs from the padding mask of the cache (rows cache_rows): build the "
                        "cache with model.new_cache(rows, length, attention_mask=...), or pass use_cache=True."
                    )
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_mask = attention_mask
        if position_ids is None:
            position_ids = (
                (key_mask.long().cumsum(-1) - 1).clamp_min(0)
                if key_mask is not None
                else torch.arange(L, device=input_ids.device).expand(B, L)
            )
        else:
            position_ids = _checked_positions(position_ids, B, L, input_ids.device)
            if cache is not None:  # window forwards rotate by the cache's positions: a full one must agree
                own = cache.position_ids if cache_rows is None else cache.position_ids[cache_rows]
                if not torch.equal(position_ids, own.to(position_ids.device)):
                    raise ValueError("position_ids differ from the cache's (its padding mask sets them, and later window "
                                     "forwards rotate by them): drop position_ids, or forward without a cache.")  # fmt: skip
        head_rows = _full_head_rows(logits_mask, B, L)
        ctx = self._context("dense", position_ids, L, cache=cache, rows=cache_rows, key_mask=key_mask)
        return self._full_output(self._run(self._embed(input_ids, embeds), ctx, head_rows), cache, return_dict)

    def _checked_embeds(self, input_ids: torch.Tensor | None, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """``inputs_embeds`` in the model's dtype, refused unless given instead of ``input_ids`` as ``[B, L, hidden]``."""
        if (input_ids is None) == (embeds is None):
            raise ValueError("Pass input_ids ([batch, length] token ids) or inputs_embeds ([batch, length, hidden]): "
                             "one of them.")  # fmt: skip
        if embeds is None:
            return None
        hidden = self.get_input_embeddings().embedding_dim
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.shape[-1] != hidden:
            shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise ValueError(f"inputs_embeds must be [batch, length, {hidden}] (this model's hidden size), got {shape}.")
        if not embeds.is_floating_point():
            raise ValueError(f"inputs_embeds must be floating point vectors, got {embeds.dtype}: token ids go in input_ids.")
        return embeds.to(self._placement()[1])

    def _full_output(self, hidden: torch.Tensor, cache: BranchCache | None,
                     return_dict: bool | None) -> DiffusionLMOutput | tuple:  # fmt: skip
        """A full forward's logits from the last layer's output, as ``forward`` returns them."""
        logits = self._head(hidden)
        if return_dict is False:
            return (logits, cache)
        return DiffusionLMOutput(logits=logits, cache=cache)

    def _forward_custom_mask(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: BranchCache | None,
        use_cache: bool | None,
        logits_mask: torch.Tensor | None,
        return_dict: bool | None,
        embeds: torch.Tensor | None = None,
    ) -> DiffusionLMOutput | tuple:
        """``forward`` with a per-query mask (bool ``[B, L, L]`` or ``[B, 1, L, L]``, a batch of 1 standing for
        every row; True where query ``i`` may attend to key ``j``), as transformers' models take a custom 4D
        mask. Why: research decoders ask questions one canvas cannot, e.g. shadow queries that must not see
        the position they check (``benchmarks/commit_rules_probe.py``). Uncached: a cache row records one
        key mask per row, which a per-query mask does not have."""
        B, L = input_ids.shape
        if cache is not None or use_cache:
            raise ValueError("A 3D/4D attention_mask (one per query) works without a cache: drop cache/use_cache, "
                             "or pass a [batch, length] padding mask.")  # fmt: skip
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                f"A 3D/4D attention_mask must be bool (True: the query may attend to the key), got "
                f"{attention_mask.dtype}: a 0/1 mask converts as `m.bool()`, an additive float one as `m == 0`."
            )
        mask = attention_mask.to(input_ids.device)
        if mask.dim() == 4:
            if mask.shape[1] != 1:
                raise ValueError(f"A 4D attention_mask must be [batch, 1, length, length] (one mask for all heads), "
                                 f"got {tuple(mask.shape)}.")  # fmt: skip
            mask = mask[:, 0]
        if mask.shape[0] not in (1, B) or tuple(mask.shape[1:]) != (L, L):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, L, L)} or "
                             f"{(B, 1, L, L)} for a per-query mask, or {(B, L)} for padding.")  # fmt: skip
        mask = mask.expand(B, L, L)
        if not bool(mask.any(-1).all()):
            raise ValueError("attention_mask leaves a query with no key to attend to: every row of the mask needs a True.")
        if position_ids is None:  # nothing to infer positions from: the canvas order (pass position_ids to repeat one)
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        else:
            position_ids = _checked_positions(position_ids, B, L, input_ids.device)
        head_rows = _full_head_rows(logits_mask, B, L)
        ctx = self._context("dense", position_ids, L, cache=None, rows=None, key_mask=mask)
        return self._full_output(self._run(self._embed(input_ids, embeds), ctx, head_rows), None, return_dict)

    def forward_windows(
        self,
        input_ids: torch.LongTensor,
        starts: torch.Tensor | Sequence[int],
        ends: torch.Tensor | Sequence[int],
        cache: BranchCache,
        rows: torch.Tensor | Sequence[int] | None = None,
        logits_mask: torch.Tensor | None = None,
    ) -> WindowOutput:
        """Logits predicting ``[starts[i], ends[i])`` of cache row ``rows[i]`` (see module docstring).

        ``input_ids`` is the canvas of every cache row, ``[R, L]`` (only the windows are read).
        ``logits_mask`` (bool ``[Σ(end - start)]``, over the packed predicted positions): return
        only those logits, packed ``[n, V]``; ``cu_seqlens`` still cuts the unmasked windows.
        """
        self._check_window_inputs(input_ids, cache)
        starts = torch.as_tensor(starts, device=cache.device, dtype=torch.long)
        ends = torch.as_tensor(ends, device=cache.device, dtype=torch.long)
        shift = self.logit_shift
        if shift and starts.shape == ends.shape:
            # check the windows as asked, before the shift (build_window_batch sees [start - 1, end),
            # which is not empty when start == end and would report shifted starts): one host sync
            before_one, bad = torch.stack(
                [(starts < shift).any(), ((ends <= starts) | (ends > cache.length)).any()]
            ).tolist()
            if bad:
                raise ValueError(
                    f"Every window must satisfy 0 <= start < end <= {cache.length} (the canvas length); got "
                    f"starts {starts.tolist()} and ends {ends.tolist()}."
                )
            if before_one:
                raise ValueError(
                    "A shifted model (Dream) cannot predict position 0: windows must start at 1 or later."
                )
        wb = build_window_batch(cache, starts - shift, ends, rows)
        # the last `shift` queries of each row predict past the window: the others are the windows'
        # predicted positions, of which logits_mask picks some
        keep = wb.token_pos < ends[wb.token_local] - shift if shift else None
        head_rows = None
        if logits_mask is not None:
            _check_bool_mask(logits_mask)
            predicted = wb.num_tokens - shift * wb.rows.shape[0]
            if tuple(logits_mask.shape) != (predicted,):
                raise ValueError(
                    f"logits_mask has shape {tuple(logits_mask.shape)}, expected ({predicted},): one entry per "
                    "predicted position of the windows, in row order."
                )
            head_rows = _head_rows(logits_mask) if keep is None else _head_rows(keep)[logits_mask]
        elif keep is not None:
            head_rows = _head_rows(keep)
        ctx = self._context("window", wb.rope_pos, input_ids.shape[1], cache=cache, wb=wb)
        hidden = self._run(self._embed(input_ids[wb.token_rows, wb.token_pos]), ctx, head_rows)
        cu = torch.zeros_like(wb.cu_seqlens)
        cu[1:] = (ends - starts).cumsum(0)
        return WindowOutput(logits=self._head(hidden), cu_seqlens=cu)

    def predicting_queries(self, predict: torch.Tensor) -> torch.Tensor:
        """``[A, L]`` bool: the query positions whose hidden states predict the ``predict`` positions
        (``p - logit_shift`` for each predicted ``p``)."""
        shift = self.logit_shift
        return predict if not shift else torch.cat([predict[:, shift:], predict.new_zeros(predict.shape[0], shift)], 1)

    def forward_positions(
        self,
        input_ids: torch.LongTensor,
        predict: torch.Tensor,
        refresh: torch.Tensor | None,
        cache: BranchCache,
        rows: torch.Tensor | Sequence[int] | None = None,
        echo: torch.Tensor | None = None,
    ) -> PositionOutput:
        """Logits predicting the ``predict`` positions of cache rows ``rows`` (see module docstring).

        ``predict`` and ``refresh`` are bool ``[A, L]`` over canvas positions. The queries are the
        positions ``p - logit_shift`` for every predicted ``p``, and every ``refresh`` position;
        they attend to the row's whole cache and their K/V are written into it in place. Returns
        the packed logits ``[Σ predict, V]`` in row-major order, and the query mask used (the
        positions whose K/V this forward wrote).

        ``echo`` (``[A, L]`` long, -1 for none): row ``i`` also receives at position ``p`` the K/V
        that row ``echo[i, p]`` (a local index) computes in this forward, layer by layer before
        attention, as if they had been cached; read only where that row queries ``p`` and row ``i``
        does not (a row's own queries keep their own K/V). A lookahead draft
        row so attends to exactly the cache its main row will hold after this forward.
        """
        self._check_window_inputs(input_ids, cache)
        shift = self.logit_shift
        if predict.dtype != torch.bool or predict.shape[-1] != cache.length or predict.dim() != 2:
            raise ValueError(f"predict must be a bool [rows, {cache.length}], got {predict.dtype} {tuple(predict.shape)}.")
        if refresh is not None and (refresh.dtype != torch.bool or refresh.shape != predict.shape):
            # (else a float one failed in torch's bitwise_or, and an integer one was refused as "query_mask")
            raise ValueError(f"refresh must be None or a bool of predict's shape {tuple(predict.shape)}, got "
                             f"{refresh.dtype} {tuple(refresh.shape)}.")  # fmt: skip
        if shift and bool(predict[:, :shift].any()):
            raise ValueError("A shifted model (Dream) cannot predict position 0: predict positions 1 or later.")
        heads = self.predicting_queries(predict)
        queries = heads if refresh is None else heads | refresh
        wb = build_query_batch(cache, queries, rows)
        if echo is not None:
            _add_echo(wb, queries, echo)
        head_rows = _head_rows(heads[queries])
        ctx = self._context("window", wb.rope_pos, input_ids.shape[1], cache=cache, wb=wb)
        hidden = self._run(self._embed(input_ids[wb.token_rows, wb.token_pos]), ctx, head_rows)
        return PositionOutput(logits=self._head(hidden), query_mask=queries)


def _checked_positions(position_ids: torch.Tensor, B: int, L: int, device: torch.device) -> torch.Tensor:
    """A caller's ``position_ids``: ``[B, L]`` (or ``[1, L]``, for every row) integers in ``[0, L)``. RoPE looks
    positions up in a table, where a negative one would silently read the table's far end."""
    pos = torch.as_tensor(position_ids, device=device)
    if pos.dim() != 2 or pos.shape[1] != L or pos.shape[0] not in (1, B):
        raise ValueError(f"position_ids has shape {tuple(pos.shape)}, expected {(B, L)}.")
    if pos.dtype.is_floating_point or pos.dtype == torch.bool or pos.is_complex():
        raise ValueError(f"position_ids must be integers, got {pos.dtype}.")
    if pos.numel() and not (int(pos.min()) >= 0 and int(pos.max()) < L):
        raise ValueError(f"position_ids must lie in [0, {L}) (the canvas length), got {int(pos.min())}..{int(pos.max())}.")
    return pos.long().expand(B, L)


def _check_bool_mask(logits_mask: torch.Tensor) -> None:
    """A 0/1 integer ``logits_mask`` indexed rows 0 and 1 (Dream's windows) where a bool one selects: the dtype only."""
    if not isinstance(logits_mask, torch.Tensor) or logits_mask.dtype != torch.bool:
        what = logits_mask.dtype if isinstance(logits_mask, torch.Tensor) else type(logits_mask).__name__
        raise ValueError(f"logits_mask must be a bool tensor (True: return that position's logits), got {what}.")


def _full_head_rows(logits_mask: torch.Tensor | None, B: int, L: int) -> torch.Tensor | None:
    """A full forward's ``logits_mask`` (bool ``[B, L]``) as :func:`_head_rows`, checked; ``None``: every row."""
    if logits_mask is None:
        return None
    _check_bool_mask(logits_mask)
    if tuple(logits_mask.shape) != (B, L):
        raise ValueError(f"logits_mask has shape {tuple(logits_mask.shape)}, expected {(B, L)}.")
    return _head_rows(logits_mask)


def _head_rows(keep: torch.Tensor) -> torch.Tensor:
    """The rows of a forward's packed (or flattened) hidden states that go through the head, from a
    bool over them. Built before the layers run: reading a mask's count stops a GPU's host until the
    device is idle, which costs nothing before the forward is queued, while a boolean selection after
    the layers would keep the host waiting for the whole forward instead of queueing the decoding
    policy's next operations behind it (``eval/forward_log.py`` counts such late syncs)."""
    return keep.reshape(-1).nonzero().squeeze(1)


def _add_echo(wb: WindowBatch, queries: torch.Tensor, echo: torch.Tensor) -> None:
    """Fill ``wb.write_src`` / ``write_slots`` (see :meth:`DiffusionLMMixin.forward_positions`): built
    once per forward, so that each layer writes its queries' K/V and the echoes in one scatter."""
    A, L = queries.shape
    if echo.shape != (A, L) or echo.dtype != torch.long:
        raise ValueError(f"echo must be a long [{A}, {L}] (a source row per position, -1 for none), got "
                         f"{echo.dtype} {tuple(echo.shape)}.")  # fmt: skip
    packed = packed_index(queries)  # packed token of each query
    source = echo.clamp_min(0)
    # an echo lands where its row does not query: never on a slot the queries write themselves
    i, p = ((echo >= 0) & ~queries & queries.gather(0, source)).nonzero(as_tuple=True)
    wb.write_src = torch.cat([torch.arange(wb.num_tokens, device=packed.device), packed[source[i, p], p]])
    wb.write_slots = torch.cat([wb.flat_slots, wb.rows[i] * L + p])
