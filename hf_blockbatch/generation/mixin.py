"""``model.generate`` for masked-diffusion models: dispatch on the generation config.

:class:`BlockBatchGenerationMixin` is inherited by our LLaDA and Dream classes, as transformers'
own models inherit ``GenerationMixin``. :func:`diffusion_generate` is the same entry point as a
plain function, so the strategies run on any masked-diffusion model that implements the forward
contract of :mod:`hf_blockbatch.models.base` (``forward`` with a ``BranchCache``,
``forward_windows``, ``new_cache``, ``logit_shift``): call it, bind it with :func:`enable`, or,
on a model whose ``generate`` is transformers' own, load it as a Hub ``custom_generate``
(:func:`custom_generate`, served by this repository's ``custom_generate/generate.py``).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import sys
from typing import Any, NoReturn

import torch
from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from hf_blockbatch.cache import checked_padding_mask
from hf_blockbatch.checks import check_bool, check_token_ids, vocabulary_size
from hf_blockbatch.generation.configs import BlockBatchConfig, DiffusionGenerationConfig, config_from_dict
from hf_blockbatch.generation.engine import run_plan
from hf_blockbatch.generation.outputs import (
    DiffusionGenerateOutput,
    answer_lengths,
    as_token_ids,
    end_token_ids,
)
from hf_blockbatch.generation.plans import check_model, plan_from_config

logger = logging.getLogger(__name__)

__all__ = ["BlockBatchGenerationMixin", "custom_generate", "diffusion_generate", "enable"]

_CONTRACT = ("forward_windows", "new_cache", "logit_shift", "config", "device")


#: fields of a model's plain ``generation_config`` that mean here what they mean to transformers
_CARRIED = ("max_new_tokens", "num_return_sequences", "return_dict_in_generate", "bos_token_id", "eos_token_id",
            "pad_token_id", "mask_token_id")
#: and fields that do nothing either way (our checkpoints' generation_config.json sets use_cache false)
_INERT = ("use_cache", "transformers_version")
_warned_unused: set[tuple[str, ...]] = set()


def _from_model_defaults(own: GenerationConfig | None) -> DiffusionGenerationConfig:
    """The default decode (BlockBatch) for a model whose ``generation_config`` is transformers' plain class
    (a checkpoint's ``generation_config.json`` without a strategy): what that config sets which means the same
    here carries over, as transformers reads a model's generation defaults (``max_new_tokens``, the token ids,
    ``do_sample`` with its ``temperature``); anything else it sets is named in a warning once, since this decode
    cannot apply it (``top_p``, Dream's ``alg`` and ``steps``, ...). Before, the whole config was dropped."""
    if own is None:
        return BlockBatchConfig()
    # switches set off (output_attentions=False, do_sample=False) ask for nothing this decode would not do
    diff = {k: v for k, v in own.to_diff_dict().items()
            if not k.startswith("_") and k not in _INERT and v is not None and v is not False}  # fmt: skip
    carried = {k: diff.pop(k) for k in _CARRIED if k in diff}
    if diff.pop("do_sample", None) is True:  # transformers samples at its temperature (1.0 unless set)
        carried.update(do_sample=True, temperature=diff.pop("temperature", 1.0))
    unused = tuple(sorted(diff))
    if unused and unused not in _warned_unused:
        _warned_unused.add(unused)
        logger.warning(
            "model.generation_config sets %s, which masked-diffusion decoding does not use; pass a "
            "generation_config (hb.FastDLLMConfig, hb.BlockBatchConfig, ...) to choose the decode.",
            ", ".join(f"{k}={diff[k]!r}" for k in unused),
        )
    return BlockBatchConfig(**carried)


def _resolve_config(model: Any, generation_config: GenerationConfig | None,
                    kwargs: dict[str, Any]) -> DiffusionGenerationConfig:  # fmt: skip
    cfg = generation_config
    if cfg is None:
        own = getattr(model, "generation_config", None)
        if isinstance(own, DiffusionGenerationConfig) or getattr(own, "strategy", None):
            cfg = own  # ours, or ours read back as transformers' class (rebuilt below)
        else:
            cfg = _from_model_defaults(own)
    if isinstance(cfg, GenerationConfig) and not isinstance(cfg, DiffusionGenerationConfig) and getattr(cfg, "strategy", None):
        # one of ours read back as transformers' own class (GenerationConfig.from_pretrained of a saved config): its
        # strategy names the class, as when a model loads its generation_config.json (a new object: the caller's is kept)
        data = cfg.to_dict()
        if data.get("temperature") is None:  # a greedy config's file leaves out its temperature 0, which is our default
            data.pop("temperature", None)
        try:
            cfg = config_from_dict(data)
        except (TypeError, ValueError) as err:
            if generation_config is not None:  # the caller's own: its message is the whole story
                raise
            # the model's, which from_pretrained kept as transformers' class because it does not load (a file saved by
            # another version, or edited): the message named an option the caller never passed
            raise type(err)(
                f"model.generation_config (the checkpoint's generation_config.json) holds a {cfg.strategy!r} config that "
                f"does not load: {err} Pass a generation_config (hb.FastDLLMConfig, hb.BlockBatchConfig, ...), or set "
                "model.generation_config to one."
            ) from err
    if not isinstance(cfg, DiffusionGenerationConfig):
        raise TypeError(
            f"generation_config must be a VanillaDiffusionConfig, FastDLLMConfig or BlockBatchConfig, got "
            f"{type(cfg).__name__}: masked-diffusion models do not decode left to right."
        )
    if kwargs:  # options given to generate() override a copy; the caller's config is never changed
        cfg = copy.deepcopy(cfg)
    cfg.override(kwargs)  # an unknown option is refused by validate(), with a suggestion
    cfg.validate()
    return cfg


def check_context(model_config: Any, prompt_length: int, max_new_tokens: int) -> None:
    """Refuse a canvas (prompt + new tokens) longer than the model's context, saying what to change."""
    limit = getattr(model_config, "context_length", None)
    total = prompt_length + max_new_tokens
    if limit and total > limit:
        what = "shorten the prompt" if prompt_length >= limit else "shorten the prompt or lower max_new_tokens"
        raise ValueError(
            f"Prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's context of {limit} positions: {what}."
        )


def _token_ids(cfg: DiffusionGenerationConfig, config: Any) -> tuple[int, list[int], int]:
    """``(mask id, EOS ids, padding id)`` from the generation config, else the model config."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else getattr(config, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            "This model's config has no mask_token_id: set generation_config.mask_token_id to the id of the "
            "[MASK] token the model was trained with."
        )
    eos_ids = as_token_ids(cfg.eos_token_id) or as_token_ids(getattr(config, "eos_token_id", None))
    if not eos_ids:
        raise ValueError("No eos_token_id in the generation config or the model config: set one.")
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(config, "pad_token_id", None)
    mask_ids, pad_ids = as_token_ids(mask_id, "mask_token_id"), as_token_ids(pad_id, "pad_token_id")
    if len(mask_ids) != 1 or len(pad_ids) > 1:
        raise ValueError(f"mask_token_id and pad_token_id are one id each, got {mask_id!r} and {pad_id!r}.")
    return mask_ids[0], eos_ids, pad_ids[0] if pad_ids else eos_ids[0]


def _check_ids_in_vocabulary(model: Any, mask_id: int, eos_ids: list[int], pad_id: int) -> None:
    """The mask id is written into the canvas and embedded, the padding id written into the output: one
    outside the vocabulary failed deep in the embedding (or wrote a token no tokenizer reads)."""
    size = vocabulary_size(model)
    if not size:
        return
    for name, ids in (("mask_token_id", [mask_id]), ("eos_token_id", eos_ids), ("pad_token_id", [pad_id])):
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"{name}={bad[0]} is outside this model's vocabulary of {size} ids (0..{size - 1}).")


def _check_mask_id_distinct(mask_id: int, eos_ids: list[int], pad_id: int) -> None:
    """The decoders read every mask id on the canvas as a position still to decode: an EOS or padding id equal to it
    made each committed EOS, and the padding the decoders write (past a row's end, the column a shifted window reads),
    a mask again. BlockBatch failed deep in torch (``masked_scatter_``), the others decoded without the model's mask."""
    for name, ids in (("eos_token_id", eos_ids), ("pad_token_id", [pad_id])):
        if mask_id in ids:
            raise ValueError(
                f"mask_token_id={mask_id} is also the {name}: the decoders would read those tokens as masks to decode. "
                "Give each its own id (mask_token_id is the [MASK] id the model was trained with)."
            )


def _checked_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The batch's attention mask, refused unless it is left padding around non-empty prompts."""
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}.")
    am = checked_padding_mask(attention_mask)
    if bool((am[:, 1:] < am[:, :-1]).any()):
        raise ValueError("Prompts must be left-padded (tokenizer.padding_side = 'left').")
    empty = (~am.any(1)).nonzero().flatten().tolist()
    if empty:  # as for an empty prompt alone: nothing to condition on (and nothing to shift from, on Dream)
        raise ValueError(
            f"Prompt(s) {empty} of the batch are empty (attention_mask all 0): a masked-diffusion model needs at "
            "least one prompt token; drop them or give them one (e.g. the BOS token)."
        )
    return attention_mask


def _padding_without_a_mask(input_ids: torch.Tensor, pad_id: int, eos_ids: list[int]) -> torch.Tensor | None:
    """Prompts that start with the padding id but came without an ``attention_mask``: left padding,
    most likely (``tokenizer(texts, padding=True)`` without passing its mask on). As transformers'
    ``generate``: when the padding id is not an EOS id, the mask is inferred from each row's leading run
    of it; when it is (LLaDA and Dream: pad = EOS), it cannot be told from text, so a warning says to
    pass the mask, since padding read as prompt changes the answer. Rows of a batch that *end* with it
    get transformers' right-padding warning. One host read per call."""
    leading, trailing = (torch.stack([input_ids[:, 0], input_ids[:, -1]]) == pad_id).tolist()
    if any(trailing) and input_ids.shape[0] > 1:  # transformers' check for decoder-only models, for the same reason
        logger.warning(
            "No attention_mask, and prompt row(s) %s end with the padding id %d: right padding would be read as "
            "prompt text. Set tokenizer.padding_side = 'left' and pass attention_mask.",
            [i for i, t in enumerate(trailing) if t], pad_id,
        )  # fmt: skip
    if not any(leading):
        return None
    rows = [i for i, t in enumerate(leading) if t]
    if pad_id not in eos_ids:
        logger.info("no attention_mask: rows %s start with the padding id %d, masked as left padding", rows, pad_id)
        return ((input_ids != pad_id).cumsum(1) > 0).long()
    logger.warning(
        "No attention_mask, and prompt row(s) %s start with the padding id %d, which is also the EOS id: if they are "
        "left-padded, pass attention_mask (tokenizer(..., return_tensors='pt') returns it), or the padding is "
        "decoded as prompt text.", rows, pad_id,
    )  # fmt: skip
    return None


def _checked_inputs(model: Any, cfg: DiffusionGenerationConfig, input_ids: Any, attention_mask: torch.Tensor | None,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The prompts and their mask on the model's device, refused before any forward when they
    cannot be decoded (shape, empty prompt, ids outside the vocabulary, context, padding side)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_length].")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: a masked-diffusion model needs at least one prompt token.")
    check_token_ids(model, input_ids)
    mask_id, eos_ids, pad_id = _token_ids(cfg, model.config)  # a missing mask or EOS id is said before the context check
    _check_ids_in_vocabulary(model, mask_id, eos_ids, pad_id)
    _check_mask_id_distinct(mask_id, eos_ids, pad_id)
    if attention_mask is None:
        attention_mask = _padding_without_a_mask(input_ids, pad_id, eos_ids)
    check_context(model.config, input_ids.shape[1], cfg.max_new_tokens)
    device = model.device
    if generator is not None and cfg.seed is not None:
        raise ValueError(
            f"seed={cfg.seed} hashes the sampling noise, so the generator would be ignored: pass one of them "
            "(seed for the same samples alone or in any batch, generator for the official samplers' stream)."
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}: to seed the noise, pass seed=.")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError("attention_mask must be a tensor of shape [batch, prompt_length], as the tokenizer returns it.")
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"The generator is on {generator.device.type} but the model on {device.type}: make it with "
            f"torch.Generator(device={device.type!r})."
        )
    input_ids = input_ids.to(device)
    if attention_mask is not None:
        attention_mask = _checked_mask(attention_mask.to(device), input_ids)
    return input_ids, attention_mask


def _answer_end_ids(eos_ids: list[int], eot_ids: list[int], config: Any, tokenizer: Any, streamer: Any) -> list[int]:
    """Where an answer ends, as ``answer_texts(tokenizer, ..., end_token_ids(tokenizer, config))``
    cuts it: EOS, the config's end of turn, and the end-of-turn tokens of the tokenizer the caller
    decodes with (given, or the streamer's)."""
    end_ids = set(eos_ids) | set(eot_ids)
    for tok in (tokenizer, getattr(streamer, "tokenizer", None)):
        if tok is not None and hasattr(tok, "get_vocab"):
            end_ids.update(end_token_ids(tok, config))
    return sorted(end_ids)


@torch.no_grad()
def diffusion_generate(
    model: Any,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    streamer: Any = None,
    generator: torch.Generator | None = None,
    return_dict_in_generate: bool | None = None,
    pad_after_end: bool = False,
    tokenizer: Any = None,
    **kwargs: Any,
) -> torch.LongTensor | DiffusionGenerateOutput:
    """Decode with vanilla, Fast-dLLM or BlockBatch, chosen by the config's class.

    Args:
        input_ids: ``[B, Lp]`` prompts, left-padded when of different lengths.
        attention_mask: ``[B, Lp]``, 0 on left padding; required when prompts are padded.
        generation_config: the strategy and its settings (default: the model's; a plain transformers
            ``GenerationConfig`` there gives BlockBatch with what it sets that means the same here). One of
            ours read back as transformers' class (``GenerationConfig.from_pretrained``) decodes as saved.
        streamer: a transformers streamer (``put``/``end``); receives request 0's prompt, then its
            text as its agreed left-to-right prefix grows, and the rest of its answer as soon as
            request 0 finishes (a batch's other requests may decode on). ``end()`` is called once,
            when this call returns, as transformers' ``generate`` calls it: a consumer that leaves
            a ``TextIteratorStreamer``'s loop can read the output at once. It is called too when
            this call raises (the error then propagates unchanged), so that a consumer in another
            thread is never left waiting.
        generator: a ``torch.Generator`` for sampling (temperature > 0, random remasking).
        pad_after_end: replace every token after each row's first end token (EOS or end of turn)
            by the pad id, as transformers' autoregressive and DiffusionGemma ``generate`` return
            them, so that ``tokenizer.batch_decode(..., skip_special_tokens=True)`` is the answer.
            Off by default: the canvas after the end token is what the official codes return
            (Fast-dLLM without early stop decodes it); :func:`hf_blockbatch.answer_texts` cuts
            either way. transformers' ``pipeline`` gets it on, since it decodes the whole canvas.
        tokenizer: only read for its end-of-turn tokens (:func:`hf_blockbatch.end_token_ids`), so that
            the streamer and ``pad_after_end`` end where ``answer_texts`` does (a streamer's own
            tokenizer is read too).
        kwargs: overrides of config fields, e.g. ``max_new_tokens=64``.
    Returns:
        prompt + new tokens ``[B * num_return_sequences, Lp + max_new_tokens]`` (each prompt's
        samples consecutive, as transformers), or a :class:`DiffusionGenerateOutput`.
    """
    _check_no_step_inputs(model)
    # a streamer without put/end failed with an AttributeError at the first agreed token, after forwards had run
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        raise TypeError(f"streamer must have put(token_ids) and end() methods, as transformers' TextStreamer has, got "
                        f"{type(streamer).__name__}.")  # fmt: skip
    try:
        out = _generate(model, input_ids, attention_mask, generation_config, streamer, generator, return_dict_in_generate,
                        pad_after_end, tokenizer, kwargs)  # fmt: skip
    except BaseException:
        if streamer is not None:
            _end_after_error(streamer)
        raise
    if streamer is not None:
        streamer.end()
    return out


def _check_no_step_inputs(model: Any) -> None:
    """Refuse a model whose ``prepare_inputs_for_generation`` a wrapper replaced on the instance: it expects a
    left-to-right loop to call it at each step, which this decode never does. PEFT's prompt-learning adapters
    (prompt tuning, prefix tuning, P-tuning) add their virtual tokens through it, so a decode here gave the base
    model's tokens, the adapter silently ignored. (PEFT's LoRA-type adapters replace it on their own wrapper, not
    on the model, and act inside the layers: they decode.)"""
    if "prepare_inputs_for_generation" in getattr(model, "__dict__", {}):
        raise NotImplementedError(
            f"{type(model).__name__}.prepare_inputs_for_generation was replaced on this model (PEFT's prompt tuning, "
            "prefix tuning and P-tuning do so, to add their virtual tokens at each left-to-right step), and masked-"
            "diffusion decoding never calls it: the adapter would be ignored. Use an adapter that acts in the layers "
            "(LoRA, IA3, ...), or delete the replacement to decode the base model."
        )


def _end_after_error(streamer: Any) -> None:
    """End the stream of a call that raised. Without it a consumer in another thread (a ``TextIteratorStreamer``'s
    loop, transformers' documented pattern) waited forever for the end of a decode that had failed; an ``end()`` that
    raises in turn is logged, so that the caller gets the decode's own error."""
    try:
        streamer.end()
    except Exception:
        logger.warning("streamer.end() raised after generate() failed; the decode's error follows", exc_info=True)


def _generate(model: Any, input_ids: Any, attention_mask: torch.Tensor | None,
              generation_config: GenerationConfig | None, streamer: Any, generator: torch.Generator | None,
              return_dict_in_generate: bool | None, pad_after_end: bool, tokenizer: Any,
              kwargs: dict[str, Any]) -> torch.LongTensor | DiffusionGenerateOutput:  # fmt: skip
    """:func:`diffusion_generate`'s decode, which ends neither way the streamer it fills."""
    # every entry point comes through here: transformers' arguments with no meaning here are refused by name
    input_ids = _front_door(input_ids, kwargs)
    if input_ids is None:
        raise ValueError("Pass the prompts as input_ids ([batch, prompt_length]).")
    cfg = _resolve_config(model, generation_config, kwargs)
    check_bool("pad_after_end", pad_after_end)
    if return_dict_in_generate is not None:  # before any forward, as every bad input
        check_bool("return_dict_in_generate", return_dict_in_generate)
    input_ids, attention_mask = _checked_inputs(model, cfg, input_ids, attention_mask, generator)
    config = model.config
    mask_id, eos_ids, pad_id = _token_ids(cfg, config)
    n = cfg.num_return_sequences or 1
    if n > 1:  # as transformers: each prompt's n samples are consecutive rows of the output
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids, attention_mask = input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
    eot_ids = as_token_ids(getattr(config, "eot_token_id", None))
    plan = plan_from_config(cfg, eos_ids, eot_ids)
    check_model(plan, model)
    logger.debug("diffusion_generate: %s", plan)
    plan.end_ids = end_ids = _answer_end_ids(eos_ids, eot_ids, config, tokenizer, streamer)
    result = run_plan(model, input_ids, attention_mask, plan, mask_id, eos_ids, pad_id, generator, streamer)
    if pad_after_end:
        new = result.sequences[:, input_ids.shape[1] :]
        after = torch.arange(new.shape[1], device=new.device) > answer_lengths(new, end_ids)[:, None]
        result.sequences[:, input_ids.shape[1] :] = new.masked_fill(after, pad_id)
    return_dict = cfg.return_dict_in_generate if return_dict_in_generate is None else return_dict_in_generate
    if return_dict:
        return DiffusionGenerateOutput(sequences=result.sequences, nfe=result.nfe, stats=result.stats)
    return result.sequences


# transformers' generate() hands a Hub custom_generate its whole argument list. These act on left-to-right
# decoding steps and have no meaning for a masked canvas: refused when given, rather than ignored.
_LEFT_TO_RIGHT_ONLY = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                       "negative_prompt_ids", "negative_prompt_attention_mask", "assistant_tokenizer")  # fmt: skip
_NOT_USED = ("synced_gpus",)  # distributed lockstep (each process decodes its own batch)


def _asks_nothing(value: Any) -> bool:
    """None, or an empty ``LogitsProcessorList`` / ``StoppingCriteriaList``."""
    return value is None or (isinstance(value, (list, tuple)) and not value)


#: arguments of a left-to-right ``generate`` that a masked canvas builds for itself from ``input_ids``
_BUILT_FROM_INPUT_IDS = ("inputs_embeds", "past_key_values", "position_ids", "cache_position")


def _front_door(input_ids: Any, kwargs: dict[str, Any]) -> Any:
    """The prompts, from ``input_ids`` or transformers' name for them, ``inputs``; and the arguments of
    transformers' ``generate`` that have no meaning here refused with what to do, rather than
    reported as unknown config options or ignored. :func:`diffusion_generate`, where every entry point
    arrives, calls it first."""
    inputs = kwargs.pop("inputs", None)
    if inputs is not None:
        if input_ids is not None:
            raise ValueError("The prompts were given twice (input_ids and inputs): pass one of them.")
        input_ids = inputs
    given = [k for k in _LEFT_TO_RIGHT_ONLY if not _asks_nothing(kwargs.pop(k, None))]
    if given:
        raise ValueError(
            f"Masked-diffusion decoding does not use {', '.join(given)}: "
            f"{'it acts' if len(given) == 1 else 'they act'} on left-to-right steps, one token at a time, and "
            "a diffusion step commits many positions at once. Remove "
            f"{'it' if len(given) == 1 else 'them'} (EOS ends an answer: early_stop; sampling: temperature)."
        )
    built = [k for k in _BUILT_FROM_INPUT_IDS if kwargs.pop(k, None) is not None]
    if built:
        raise ValueError(
            f"generate() builds the canvas, its positions and its cache from input_ids: remove {', '.join(built)}"
            + (" and pass the prompts as token ids (input_ids)." if "inputs_embeds" in built else ".")
        )
    for key in _NOT_USED:
        kwargs.pop(key, None)
    types = kwargs.pop("token_type_ids", None)  # some tokenizers return them: generate(**tokenizer(...))
    if types is not None and bool(torch.as_tensor(types).ne(0).any()):
        raise ValueError(
            "token_type_ids holds a segment other than 0: these models have no token types. Encode the prompt as one "
            "segment (tokenizer(..., return_token_type_ids=False)) and pass input_ids and attention_mask."
        )
    return input_ids


def custom_generate(inputs: torch.LongTensor | None = None, *, model: Any,
                    **kwargs: Any) -> torch.LongTensor | DiffusionGenerateOutput:  # fmt: skip
    """These strategies as a transformers Hub ``custom_generate``.

    ``model.generate(input_ids, generation_config=hb.BlockBatchConfig(), custom_generate=<repo>,
    trust_remote_code=True)`` on a model whose ``generate`` is transformers' own loads the repo's
    ``custom_generate/generate.py`` (this repository ships one that exports this function) and
    calls it with ``model=`` and every ``generate`` argument (or, from a model repo loaded with
    ``trust_remote_code=True``, binds it as ``generate`` with ``model=``); the model must implement
    the forward contract. The rest is :func:`diffusion_generate`.
    """
    return diffusion_generate(model, kwargs.pop("input_ids", None), inputs=inputs, **kwargs)  # the front door picks


def enable(model: Any) -> Any:
    """Give any model that implements the forward contract a ``generate`` running these strategies.

    The contract (see :mod:`hf_blockbatch.models.base`): ``model(input_ids, attention_mask=...,
    cache=..., cache_rows=...)`` returning ``.logits``, ``model.forward_windows(...)``,
    ``model.new_cache(rows, length, attention_mask)``, ``model.logit_shift`` (0 or 1),
    ``model.device``, and ``model.config.mask_token_id``/``eos_token_id``; optionally
    ``supports_logits_mask = True`` when both forwards take ``logits_mask`` (else the decoder selects
    from dense logits). The method is bound to the instance, as transformers binds a
    ``custom_generate``; the class is left untouched. Returns ``model`` itself.
    """
    missing = [name for name in _CONTRACT if not hasattr(model, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not implement the forward contract (missing: {', '.join(missing)}); "
            "see hf_blockbatch.models.base."
        )

    def generate(input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.LongTensor | DiffusionGenerateOutput:  # fmt: skip
        kwargs.update(_pipeline_options(kwargs))
        return diffusion_generate(model, input_ids, attention_mask, **kwargs)

    model.generate = generate
    return model


def _pipeline_options(kwargs: dict[str, Any], depth: int = 2) -> dict[str, Any]:
    """``pad_after_end`` and the pipeline's tokenizer when transformers' ``Pipeline`` is the caller.

    Why: ``pipeline("text-generation")`` decodes every new token of ``sequences``; an
    autoregressive ``generate`` pads after EOS, but a masked canvas holds text there (Fast-dLLM
    without early stop decodes it), which the pipeline would return as part of the answer. The
    pipeline passes nothing that says it is calling, so its frame (``self`` of the caller of
    ``generate``) is read; an explicit ``pad_after_end`` or ``tokenizer`` wins. A model wrapped in another module
    whose own ``generate`` calls ours (PEFT's ``PeftModel``) puts that frame between: the caller is then the first
    frame up whose ``self`` is not a module (before, the pipeline of a PEFT model returned the canvas past the end).
    """
    try:
        from transformers import Pipeline
    except ImportError:  # pragma: no cover - transformers always exports it
        return {}
    try:
        frame = sys._getframe(depth)
    except ValueError:  # called from the top of the stack: no pipeline
        return {}
    caller = frame.f_locals.get("self")
    while isinstance(caller, torch.nn.Module) and frame.f_back is not None:  # a wrapper's generate: its caller
        frame = frame.f_back
        caller = frame.f_locals.get("self")
    if not isinstance(caller, Pipeline):
        return {}
    return {"pad_after_end": kwargs.get("pad_after_end", True), "tokenizer": kwargs.get("tokenizer") or caller.tokenizer}


def _generate_with_hub_arguments(model: Any, input_ids: torch.LongTensor | None, attention_mask: torch.Tensor | None,
                                 kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """``generate(..., custom_generate=..., trust_remote_code=...)`` on our classes, with the meaning
    transformers gives these arguments: ``custom_generate="<repo or folder>"`` loads that repo's
    ``custom_generate/generate.py`` (only with ``trust_remote_code=True``, as transformers asks) and
    runs it with ``model=`` and the other arguments (this repository's folder runs these same
    strategies); ``trust_remote_code`` alone allows nothing more and is dropped. Returns what the repo's
    function returns (``Any``: it is the repo's code)."""
    custom = kwargs.pop("custom_generate", None)
    trust = kwargs.pop("trust_remote_code", None)
    if custom is None:
        return diffusion_generate(model, input_ids, attention_mask, **kwargs)
    if not isinstance(custom, str):
        raise ValueError(
            f"custom_generate={custom!r}: a callable replaces transformers' left-to-right decoding loop, which "
            f"{type(model).__name__} does not run. Pass a generation_config (VanillaDiffusionConfig, FastDLLMConfig, "
            "BlockBatchConfig), or a Hub repo / folder holding custom_generate/generate.py."
        )
    from transformers import GenerationMixin

    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    function = GenerationMixin.load_custom_generate(model, custom, trust_remote_code=trust, **hub)
    return function(model=model, input_ids=input_ids, attention_mask=attention_mask, **kwargs)


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


class BlockBatchGenerationMixin:
    """Gives a masked-diffusion model ``generate`` with the three strategies of this package."""

    def generate(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.LongTensor | DiffusionGenerateOutput:  # fmt: skip
        """transformers' ``model.generate``, decoding with :func:`diffusion_generate` (its arguments); with
        ``custom_generate="<repo or folder>"`` and ``trust_remote_code=True``, that repo's function instead, whose
        result it returns, as transformers does."""
        kwargs.update(_pipeline_options(kwargs))
        if kwargs.get("custom_generate") is not None or "trust_remote_code" in kwargs:
            return _generate_with_hub_arguments(self, input_ids, attention_mask, kwargs)
        return diffusion_generate(self, input_ids, attention_mask, **kwargs)

    def can_generate(self) -> bool:
        """``True``: transformers asks before it loads a checkpoint's generation config."""
        return True

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> NoReturn:
        """transformers' hook for the inputs of one left-to-right step, which ``generate`` here never calls (it
        builds the canvas, its positions and its cache from ``input_ids``). Defined because wrappers read it when
        they wrap a generative model: PEFT's ``get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", ...))``
        keeps a reference at construction, and failed with ``AttributeError`` on these classes, whose generation
        mixin is not transformers' ``GenerationMixin``. A call is refused with what to call instead."""
        raise NotImplementedError(
            f"{type(self).__name__} decodes by masked diffusion: generate() builds its canvas from input_ids and "
            "has no per-step inputs to prepare. Call model.generate(input_ids, attention_mask=..., "
            "generation_config=...) or model(input_ids) instead."
        )

    _HUB_KWARGS = _HUB_KWARGS

    def adjust_generation_fn(self, generation_config: GenerationConfig | None, from_auto_class: bool,
                             from_pipeline: str | None, pretrained_model_name_or_path: str | os.PathLike | None,
                             **kwargs: Any) -> None:  # fmt: skip
        """Called by ``from_pretrained``, as on transformers' generative models: load the checkpoint's
        ``generation_config.json``. A strategy config saved with the model (``model.generation_config
        = BlockBatchConfig(...)``, then ``save_pretrained``) comes back as its own class, so a
        reloaded model decodes as it was saved; any other file stays a plain ``GenerationConfig``
        (``generate`` then defaults to BlockBatch). A ``custom_generate/`` folder in the checkpoint
        becomes ``generate`` with ``trust_remote_code=True``, as on transformers' models."""
        if pretrained_model_name_or_path is not None and kwargs.get("trust_remote_code"):
            self._bind_checkpoint_generate(pretrained_model_name_or_path, kwargs)
        elif pretrained_model_name_or_path is not None and os.path.isfile(
            os.path.join(str(pretrained_model_name_or_path), "custom_generate", "generate.py")
        ):  # a local checkpoint's folder: said, not silently skipped (a Hub repo would need a request to tell)
            logger.warning("%s holds custom_generate/generate.py, which is not used: pass trust_remote_code=True to "
                           "from_pretrained to make it this model's generate().", pretrained_model_name_or_path)  # fmt: skip
        if generation_config is not None:  # from_pretrained(..., generation_config=cfg)
            self.generation_config = generation_config
            return
        if pretrained_model_name_or_path is None:
            return
        hub = {k: kwargs[k] for k in self._HUB_KWARGS if kwargs.get(k) is not None}
        path = cached_file(pretrained_model_name_or_path, GENERATION_CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub)  # fmt: skip
        if path is None:  # no file: keep the config transformers built from the model config
            return
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("strategy"):
            try:
                self.generation_config = config_from_dict(data)
                return
            except (TypeError, ValueError) as err:  # e.g. saved by another version: load the model anyway
                logger.warning("The %r config saved in %s does not load (%s): generate() refuses to decode until given a "
                               "generation_config (or model.generation_config is set to one).", data["strategy"], path,
                               err)  # fmt: skip
        self.generation_config = GenerationConfig.from_dict(data)

    def _bind_checkpoint_generate(self, pretrained_model_name_or_path: str, kwargs: dict[str, Any]) -> None:
        """As transformers' models do with ``trust_remote_code=True``: a checkpoint holding
        ``custom_generate/generate.py`` gets that function as this instance's ``generate``. Without
        ``trust_remote_code`` the folder is not run (as in transformers), and a log line says so."""
        from transformers import GenerationMixin

        hub = {k: kwargs[k] for k in self._HUB_KWARGS if kwargs.get(k) is not None}
        try:
            function = GenerationMixin.load_custom_generate(self, pretrained_model_name_or_path, trust_remote_code=True,
                                                            **hub)  # fmt: skip
        except OSError:  # no custom_generate/ folder
            return
        logger.info("%s: generate() is the checkpoint's custom_generate/generate.py", pretrained_model_name_or_path)
        self.generate = functools.partial(function, model=self)
