"""Generation configs for the three strategies: ``GenerationConfig`` subclasses that save and load.

Each config validates itself before any forward (``validate``), and its ``strategy`` field tells
``model.generate`` which decoder to run. All three share ``max_new_tokens``, ``temperature``,
``remasking`` and ``mask_token_id`` (taken from the model's config when left ``None``).

Block sizes that do not divide ``max_new_tokens`` are **supported**: the last block of a branch is
shorter (``[start, min(start + b, end))``). The official codes assert divisibility instead; we
allow it because BlockBatch's 128-token branch must coexist with any generation length, and the
shorter last block is what a user would expect. With divisible sizes the behaviour is identical.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from numbers import Real
from typing import Any

from transformers import GenerationConfig

from hf_blockbatch.checks import (
    check_bool,
    check_not_numpy_int,
    check_positive_int,
    check_positive_real,
    check_real,
)

__all__ = [
    "DiffusionGenerationConfig",
    "VanillaDiffusionConfig",
    "FastDLLMConfig",
    "BlockBatchConfig",
    "DRAFTED",
    "DRAFTED_CONTAINED",
    "LEAN",
    "LEAN_GUARDS",
    "config_from_dict",
]

_REMASKING = ("low_confidence", "random")
# the transfer rules a Fast-dLLM / BlockBatch config chooses between (threshold is the default)
_RULES = ("threshold", "factor", "steps")

# Every field of transformers' GenerationConfig.
_STANDARD = frozenset(GenerationConfig().to_dict())
# Standard fields these strategies honour (``do_sample`` and ``num_return_sequences`` as transformers
# defines them, see ``DiffusionGenerationConfig.validate``), or that cannot change what is generated here:
# compile switches, ``use_cache`` (for transformers a speed switch; here the cache is part of the strategy,
# ``FastDLLMConfig.cache``, and model configs carry ``use_cache=False``), and settings that act only
# with an assistant model, which these strategies never take.
_HONOURED = frozenset({
    "max_new_tokens", "temperature", "do_sample", "num_return_sequences", "eos_token_id", "pad_token_id",
    "bos_token_id", "decoder_start_token_id", "return_dict_in_generate", "transformers_version", "disable_compile",
    "compile_config", "low_memory", "use_cache", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "assistant_early_exit",
})  # fmt: skip
# Values of the other standard fields that ask for nothing (None, an off flag and an empty container do
# neither). Not transformers' fill-in defaults: ``max_length=20`` or ``top_k=50`` would act there.
_NEUTRAL: dict[str, Any] = {
    "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "length_penalty": 1.0, "min_length": 0, "min_new_tokens": 0, "guidance_scale": 1.0,
}  # fmt: skip
# What to do instead, for the standard fields users most often carry over from autoregressive generate().
_MIN_LENGTH = "the canvas length is max_new_tokens, and a request ends early only at EOS (early_stop)"
_TRUNCATION = "sampling is Gumbel-max over the whole distribution at `temperature`, as LLaDA's sampler"
_INSTEAD = {
    "max_length": "the answer canvas has a fixed length, set max_new_tokens (max_length minus the prompt length)",
    "min_length": _MIN_LENGTH,
    "min_new_tokens": _MIN_LENGTH,
    "top_k": _TRUNCATION,
    "top_p": _TRUNCATION,
    "num_beams": "there is no beam search over a masked canvas; num_return_sequences with temperature > 0 samples",
}

#: the official codes' names for what these configs spell otherwise, or do not do (LLaDA's generate(), Dream's
#: diffusion_generate()): said for an unknown option of that name instead of a near spelling of ours
_OFFICIAL_NAMES = {
    "gen_length": "LLaDA's name for max_new_tokens",
    "cfg_scale": "LLaDA's classifier-free guidance, which is not implemented: remove it",
    "alg": "Dream's sampler choice, whose samplers are not implemented: remasking='low_confidence' is LLaDA's",
    "alg_temp": "a parameter of Dream's samplers, which are not implemented: remove it",
    "eps": "Dream's timestep floor, which these samplers do not use: remove it",
    "output_history": "Dream's per-step history: output_trace=True records each step's commits in stats",
}


def _is_neutral(name: str, value: Any) -> bool:
    """Whether a standard field's value asks for nothing (unset, off, empty, or its no-op value)."""
    if value is None or value is False:
        return True
    if isinstance(value, (dict, list, tuple)) and not value:
        return True
    return name in _NEUTRAL and value == _NEUTRAL[name]


def _check_threshold(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not (0.0 < check_real(name, value) <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}.")


#: the transfer rules' own options, shared by the Fast-dLLM and BlockBatch configs
_RULE_OPTIONS = ("rule", "relaxed_threshold", "leap_radius", "entropy_bound", "many_masks_threshold", "many_masks")


def _pop_rule_options(cfg: Any, kwargs: dict[str, Any]) -> None:
    for name in _RULE_OPTIONS:
        setattr(cfg, name, kwargs.pop(name, None))


def _check_rule(cfg: Any) -> None:
    """``rule="localleap"`` (LocalLeap: anchors at ``threshold``, ``relaxed_threshold`` within
    ``leap_radius`` positions of one), ``rule="entropy"`` (entropy-bounded commits within
    ``entropy_bound`` nats, instead of the threshold) or unset (threshold, factor or steps name the rule)."""
    if cfg.entropy_bound is not None and cfg.rule != "entropy":
        raise ValueError("entropy_bound is the entropy rule's budget: set rule='entropy', or remove it.")
    _check_many_masks(cfg)
    if cfg.rule is None:
        given = [n for n in ("relaxed_threshold", "leap_radius") if getattr(cfg, n) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'are LocalLeap options' if len(given) > 1 else 'is a LocalLeap option'}: set rule='localleap', or remove {'them' if len(given) > 1 else 'it'}.")
        return
    if cfg.rule == "entropy":
        if cfg.entropy_bound is None or check_real("entropy_bound", cfg.entropy_bound) < 0:
            raise ValueError(f"rule='entropy' commits within `entropy_bound` nats: give a number >= 0 (0.2 is where "
                             f"RESULTS §32 starts), got {cfg.entropy_bound!r}.")  # fmt: skip
        if cfg.factor is not None or getattr(cfg, "steps", None) is not None:
            raise ValueError("rule='entropy' replaces the threshold, factor and steps rules: remove factor / steps.")
        return
    if cfg.rule != "localleap":
        raise ValueError(f"rule must be 'localleap', 'entropy' or unset (threshold, factor and steps choose the others), "
                         f"got {cfg.rule!r}.")  # fmt: skip
    if cfg.threshold is None:
        raise ValueError("rule='localleap' commits anchors at `threshold`: give threshold (e.g. 0.9), not factor or steps.")
    from hf_blockbatch.generation.rules.localleap import LocalLeapRule

    LocalLeapRule.from_config(cfg).validate(names={"anchor_threshold": "threshold", "radius": "leap_radius"})


def _check_many_masks(cfg: Any) -> None:
    """``many_masks_threshold``: the threshold rule's threshold while a window has more than ``many_masks``
    masks left (``rules.threshold``, RESULTS §48)."""
    if cfg.many_masks_threshold is None:
        if cfg.many_masks is not None:
            raise ValueError("many_masks says above how many masks left `many_masks_threshold` applies: set "
                             "many_masks_threshold (e.g. 0.85) too, or remove many_masks.")  # fmt: skip
        return
    _check_threshold("many_masks_threshold", cfg.many_masks_threshold)
    check_not_numpy_int("many_masks", cfg.many_masks)
    if cfg.many_masks is not None and (isinstance(cfg.many_masks, bool) or not isinstance(cfg.many_masks, int)
                                       or cfg.many_masks < 0):  # fmt: skip
        raise ValueError(f"many_masks must be a whole number of masks >= 0, got {cfg.many_masks!r}.")
    if cfg.rule is not None or cfg.threshold is None:
        rule = f"rule={cfg.rule!r}" if cfg.rule is not None else "factor or steps"
        raise ValueError(f"many_masks_threshold lowers the threshold rule's threshold while many masks are left: it "
                         f"needs threshold (and no rule), not {rule}. Remove many_masks_threshold, or use the "
                         "threshold rule.")  # fmt: skip


#: sparse window queries re-query the decoded positions within this many of a read slot (chosen on
#: training items: benchmarks/results/beyond_paper/README.md, "Sparse window queries")
_REQUERY_RADIUS = 3


def _check_window_queries(cfg: Any, cache: str) -> None:
    """``window_queries``: ``"all"`` (every window position, each block step: Fast-dLLM's dual
    cache) or ``"sparse"`` (the masks the step reads and the positions decoded since their K/V were
    written; docs/algorithm.md, "Sparse window queries")."""
    if cfg.window_queries not in ("all", "sparse"):
        raise ValueError(f"window_queries must be 'all' or 'sparse', got {cfg.window_queries!r}.")
    if cfg.window_queries == "sparse" and cache != "dual":
        raise ValueError("window_queries='sparse' reuses the dual cache's K/V of decoded positions: it needs "
                         f"cache='dual' (got cache={cache!r}), or set window_queries='all'.")  # fmt: skip
    r = cfg.requery_radius
    check_not_numpy_int("requery_radius", r)
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise ValueError(f"requery_radius must be an integer >= 0 (positions either side), got {r!r}.")
    if r != _REQUERY_RADIUS and cfg.window_queries != "sparse":
        raise ValueError("requery_radius chooses what a sparse block step re-queries: it needs "
                         f"window_queries='sparse' (or set requery_radius={_REQUERY_RADIUS}, its default).")  # fmt: skip


class DiffusionGenerationConfig(GenerationConfig):
    """Fields shared by every masked-diffusion strategy.

    Args:
        max_new_tokens: length of the masked answer canvas.
        temperature: 0 decodes greedily; > 0 samples with float64 Gumbel-max noise (as LLaDA).
        remasking: ``"low_confidence"`` (commit the most confident positions first) or
            ``"random"`` (random order, as LLaDA's ablation).
        mask_token_id: the ``[MASK]`` id; ``None`` takes ``model.config.mask_token_id``.
        eos_token_id: the stop token(s) of early stop; ``None`` takes the model config's. The model
            config's ``eot_token_id`` (end of turn) joins them for ``confidence_eos_eot_inf``
            and in :func:`hf_blockbatch.answer_texts`.
        output_trace: record a per-step trace (commits, merges, syncs, refreshes) in ``stats``.
        seed: when sampling (``temperature`` > 0 or ``remasking="random"``), hash each random number from
            (seed, the request's prompt, its branch, its step, the position, the token id) instead of drawing it
            from a generator (:mod:`hf_blockbatch.generation.noise`): a request then decodes the same tokens
            alone or in any batch, at any padding, and with exact drafts (sparse steps) as without them, sample
            for sample. Identical prompts in one batch draw apart (the k-th copy as the k-th copy), so
            ``num_return_sequences`` still samples. ``None`` (the default): the generator's stream, as the
            official samplers draw it. A decode with a seed takes no ``generator``.

    Standard ``GenerationConfig`` fields kept: ``do_sample`` (follows the temperature when not
    given, and must agree with it when given), ``num_return_sequences`` (samples per prompt, with
    sampling), the token ids and ``return_dict_in_generate``. Any other standard field set to a
    value that would act in transformers is refused (see :meth:`validate`).
    """

    strategy: str = ""
    _ours = ("strategy", "remasking", "mask_token_id", "output_trace", "seed")

    def __init__(self, **kwargs: Any) -> None:
        """Pop the shared fields (``max_new_tokens`` 128 and a greedy ``temperature`` 0 unless given), refuse a
        ``strategy`` other than the class's, pass the rest to ``GenerationConfig`` and set ``do_sample`` from the
        temperature when unset (:meth:`follow_temperature`)."""
        kwargs.setdefault("max_new_tokens", 128)
        kwargs.setdefault("temperature", 0.0)
        given = kwargs.pop("strategy", None)
        if given not in (None, type(self).strategy):
            # a saved dict carries its own strategy back; any other would be silently dropped
            raise ValueError(
                f"strategy={given!r} given to {type(self).__name__}, which decodes {type(self).strategy!r}: use the "
                f"config class of {given!r} (hf_blockbatch.config_from_dict picks it from the strategy), or drop strategy."
            )
        self.remasking = kwargs.pop("remasking", "low_confidence")
        self.mask_token_id = kwargs.pop("mask_token_id", None)
        self.output_trace = kwargs.pop("output_trace", False)
        self.seed = kwargs.pop("seed", None)
        super().__init__(**kwargs)
        self.strategy = type(self).strategy
        if self.do_sample is None:  # stated, not left unset: transformers' pipelines add do_sample=True then
            self.follow_temperature()

    @classmethod
    def from_model_config(cls, model_config: Any, **kwargs: Any) -> DiffusionGenerationConfig:
        """This strategy's defaults with the model's token ids (mask, EOS, padding, BOS).

        transformers' version copies every field of the model config into the generation config,
        and then compares the result with a base ``GenerationConfig`` field by field: for these
        classes that fails (``d_model`` is no option of ours, and the base class has no
        ``block_sizes``). A model config holds no decoding settings for a masked canvas, so only
        its token ids carry over; ``kwargs`` set the strategy's options.
        """
        data = model_config if isinstance(model_config, dict) else model_config.to_dict()
        ids = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")
        return cls(**{k: data[k] for k in ids if data.get(k) is not None and k not in kwargs}, **kwargs)

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = True,
                     keys_to_pop: list[str] | None = None) -> None:  # fmt: skip
        """Write the config as ``save_pretrained`` does, leaving out a greedy decode's ``temperature=0``: this
        class's default, so it loads back the same, while transformers' own ``GenerationConfig``, which reads the
        file when ``GenerationConfig.from_pretrained`` or a transformers model's ``from_pretrained`` loads it, logged
        "The following generation flags are not valid and may be ignored: ['temperature']" (a temperature with
        ``do_sample=False``) on every load of every greedy config. ``to_dict`` and ``to_diff_dict`` keep it."""
        if use_diff and not self.do_sample and self.temperature == 0:
            keys_to_pop = [*(keys_to_pop or ()), "temperature"]
        super().to_json_file(json_file_path, use_diff=use_diff, keys_to_pop=keys_to_pop)

    @classmethod
    def _read_keywords(cls, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with what naming them means, for options that change a config already set (a preset's or a
        saved one): naming another transfer rule (``factor``, ``steps``) without a ``threshold`` drops the config's
        threshold, default or not (the call names its rule), and another rule (those, or ``rule=``) without
        ``many_masks_threshold``/``many_masks`` drops those too (they lower the threshold); fewer than three drafts
        (``lookahead``) without ``lookahead_runner_up`` turn the runner-up drafts off (no row is spare); a
        ``temperature`` without ``do_sample`` unsets ``do_sample``, which then follows the temperature
        (:meth:`follow_temperature`). ``generate()``'s keywords, ``update``, ``from_pretrained``/``from_dict``'s
        keywords and the presets' (``FastDLLMConfig.drafted``) all read them so."""
        implied: dict[str, Any] = {}
        other_rule = any(options.get(r) is not None for r in _RULES[1:])
        if "threshold" in cls._ours and "threshold" not in options and other_rule:
            implied["threshold"] = None
        if ("many_masks" in cls._ours and (other_rule or options.get("rule") is not None)
                and not {"many_masks_threshold", "many_masks"} & set(options)):  # fmt: skip
            implied.update(many_masks_threshold=None, many_masks=None)
        k = options.get("lookahead")
        if "lookahead_runner_up" in cls._ours and isinstance(k, int) and k < 3 and "lookahead_runner_up" not in options:
            implied["lookahead_runner_up"] = False
        if "temperature" in options and "do_sample" not in options:
            implied["do_sample"] = None
        return {**options, **implied}

    def override(self, options: dict[str, Any]) -> None:
        """Set ``generate()``'s keyword options, as the constructor would have (:meth:`_read_keywords`). Unknown
        names are kept, so that :meth:`validate` refuses them with a suggestion."""
        for key, value in self._read_keywords(options).items():
            setattr(self, key, value)
        if self.do_sample is None:
            self.follow_temperature()

    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any) -> dict[str, Any]:
        """transformers' ``update``, reading its keywords as ``generate()`` does (:meth:`override`), and leaving the
        config as it was when it refuses them. It refused ``update(factor=1.0)`` on a config with the default
        threshold and ``update(temperature=0.7)`` on a greedy one, which ``generate(..., factor=1.0)`` and the
        constructor take, and the refused values stayed set: every later ``generate`` refused the config. Returns the
        keywords not used, as transformers' does."""
        used = {k: v for k, v in kwargs.items()
                if (hasattr(self, k) or allow_custom_entries) and not (defaults_only and getattr(self, k, None) is not None)}  # fmt: skip
        before = dict(vars(self))
        try:
            self.override(used)
            self.validate()
        except (TypeError, ValueError):
            vars(self).clear()
            vars(self).update(before)
            raise
        return {k: v for k, v in kwargs.items() if k not in used}

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers' ``from_dict`` (which ``from_pretrained`` calls), its keywords read as ``generate()`` reads
        them: ``from_pretrained(folder, factor=1.0)`` of a saved threshold config was refused for naming two rules."""
        return super().from_dict(config_dict, **cls._read_keywords(kwargs))

    def follow_temperature(self) -> None:
        """Set ``do_sample`` from the temperature (sampling when > 0), as ``generate`` does when a call
        changes only the temperature. Any real number counts, a NumPy scalar too (``np.linspace`` gives ``np.float64``,
        whose comparison is a ``np.bool_`` that ``validate`` refused as do_sample; a ``np.float32`` was skipped, and a
        default ``do_sample=False`` then refused its temperature). Such a scalar is kept as a Python float: a
        ``np.float32`` broke ``repr``, ``to_json_string`` and ``save_pretrained`` (not JSON serialisable). A bool or a
        non-number is ``validate``'s to refuse."""
        if isinstance(self.temperature, Real) and not isinstance(self.temperature, bool):
            if type(self.temperature) not in (int, float):
                self.temperature = float(self.temperature)
            self.do_sample = bool(self.temperature > 0)

    def validate(self, **kwargs: Any) -> None:
        """Check every field before any forward; a wrong value fails here with what to change.

        Options these strategies would ignore fail too, since ignoring them decodes something
        other than what was asked: a misspelt option (``block_size=32`` for ``block_sizes``), or a
        standard ``GenerationConfig`` field with no meaning here (``top_p``, ``num_beams``,
        ``max_length``, ...) unless its value does nothing (``top_p=1.0``, ``num_beams=1``).
        """
        if self.strategy != type(self).strategy:  # set after construction (generate(strategy=...)): it would only relabel
            raise ValueError(
                f"strategy={self.strategy!r} is set on a {type(self).__name__}, which decodes {type(self).strategy!r}: "
                "pass the config class of that strategy as generation_config instead."
            )
        self._check_options()
        check_positive_int("max_new_tokens", self.max_new_tokens)
        if self.temperature is None or check_real("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
        check_bool("output_trace", self.output_trace)
        for name in ("return_dict_in_generate", "do_sample"):  # None: unset (do_sample then follows the temperature)
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        check_not_numpy_int("seed", self.seed)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):  # fmt: skip
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}.")
        if self.remasking not in _REMASKING:
            raise ValueError(f"remasking must be one of {_REMASKING}, got {self.remasking!r}.")
        sampling = float(self.temperature) > 0
        if self.do_sample is True and not sampling:
            raise ValueError("do_sample=True samples at `temperature`, which is 0 (greedy): set temperature > 0, e.g. 0.7.")
        if self.do_sample is False and sampling:
            raise ValueError(
                f"do_sample=False asks for greedy decoding, but temperature={self.temperature} samples: set "
                "temperature=0, or do_sample=True."
            )
        if self.num_return_sequences is not None:
            check_positive_int("num_return_sequences", self.num_return_sequences)
            if self.num_return_sequences > 1 and not (sampling or self.remasking == "random"):
                raise ValueError(
                    f"num_return_sequences={self.num_return_sequences} needs sampling (temperature > 0 or "
                    "remasking='random'): greedy decoding would return identical copies."
                )

    def _check_options(self) -> None:
        name = type(self).__name__
        ours = set(self._ours) | {"max_new_tokens", "temperature"}
        unknown = sorted(k for k in vars(self) if not k.startswith("_") and k not in _STANDARD and k not in ours)
        if unknown:
            options = sorted(ours - {"strategy"})
            hints, elsewhere = [], {}
            for k in unknown:
                # another strategy's option (LLaDA's steps / block_length on the default BlockBatchConfig), an
                # official code's name, then a near spelling of ours
                owners = tuple(c.__name__ for c in DiffusionGenerationConfig.__subclasses__() if c is not type(self)
                               and k in c._ours)  # fmt: skip
                close = difflib.get_close_matches(k, options, n=1)
                if owners:
                    elsewhere.setdefault(owners, []).append(repr(k))
                elif k in _OFFICIAL_NAMES:
                    hints.append(f"{k!r} is {_OFFICIAL_NAMES[k]}.")
                elif close:
                    hints.append(f"Did you mean {close[0]!r} instead of {k!r}?")
            for owners, names in elsewhere.items():
                are = "is an option" if len(names) == 1 else "are options"
                hints.insert(0, f"{' and '.join(names)} {are} of {' and '.join(owners)}: pass "
                                f"generation_config={owners[0]}(...).")  # fmt: skip
            hint = " ".join(hints)
            raise TypeError(
                f"Unknown option(s) for {name}: {', '.join(unknown)}. " + (hint + " " if hint else "")
                + f"Its options: {', '.join(options)}."
            )
        unsupported = sorted(
            k for k in _STANDARD if k not in _HONOURED and not k.startswith("_") and not _is_neutral(k, getattr(self, k, None))
        )  # fmt: skip
        if unsupported:
            what = " ".join(f"{k}={getattr(self, k)!r}" + (f": {_INSTEAD[k]}." if k in _INSTEAD else ".") for k in unsupported)
            raise ValueError(f"{name} does not use {what} Remove {'it' if len(unsupported) == 1 else 'them'}.")


def _check_steps(steps: int, max_new_tokens: int, block: int) -> None:
    """LLaDA's per-block schedule, which vanilla and Fast-dLLM's ``steps`` rule share: ``steps`` spread evenly over
    the blocks, at most a block's tokens each (``block``, or ``max_new_tokens`` when that is shorter). Why the bound:
    a step commits at least one token and a block is left once it has no mask (as in the official loops), so the
    steps asked beyond it never ran: Fast-dLLM's ``steps=64`` on 32 tokens in blocks of 8 ran 32 forwards, and
    ``steps=32`` on 8 tokens in a block of 32 ran 8, vanilla's too, in silence. (A shorter last block may still get
    fewer tokens than steps: the bench's default rounds steps up to a multiple of the blocks.)"""
    num_blocks = -(-max_new_tokens // block)
    if steps % num_blocks:
        raise ValueError(
            f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks} blocks of {block} in "
            f"{max_new_tokens} tokens)."
        )
    name, most = ("block_length", block) if block <= max_new_tokens else ("max_new_tokens", max_new_tokens)
    if steps // num_blocks > most:
        raise ValueError(
            f"steps per block ({steps // num_blocks}) cannot exceed {name} ({most}): a step commits at least one "
            f"token, so give steps <= {num_blocks * most}."
        )


class VanillaDiffusionConfig(DiffusionGenerationConfig):
    """LLaDA's original sampler: ``steps`` full forwards (no cache), a fixed number of tokens per
    step, spread evenly over the blocks of ``block_length``.

    ``logits_eos_inf`` sets the EOS logit to -inf; ``confidence_eos_eot_inf`` gives positions
    predicted as EOS or end-of-turn the lowest confidence, so they are committed last (LLaDA
    appendix B.4). Note: LLaDA's code sets the *logit* of EoT to -inf for the confidence softmax;
    we implement the stated intent (confidence of EOS/EoT predictions), which agrees whenever EoT
    is not the top token.
    """

    strategy = "vanilla"
    _ours = DiffusionGenerationConfig._ours + ("steps", "block_length", "logits_eos_inf", "confidence_eos_eot_inf")

    def __init__(self, **kwargs: Any) -> None:
        """Pop vanilla's fields (unset ``steps``/``block_length``: :meth:`resolved`), then the shared ones."""
        self.steps = kwargs.pop("steps", None)
        self.block_length = kwargs.pop("block_length", None)
        self.logits_eos_inf = kwargs.pop("logits_eos_inf", False)
        self.confidence_eos_eot_inf = kwargs.pop("confidence_eos_eot_inf", False)
        super().__init__(**kwargs)

    def resolved(self) -> tuple[int, int]:
        """(steps, block_length) with defaults: one step per token, one block. With a block length that does not
        divide max_new_tokens, LLaDA's sampler needs steps to be a multiple of the number of blocks: the default is
        then the smallest such multiple >= max_new_tokens (one token a step on average). It was max_new_tokens, which
        validate refused for steps the caller never set; the bench took this rounding already."""
        block = self.block_length or self.max_new_tokens
        blocks = -(-self.max_new_tokens // block)
        steps = self.steps or blocks * -(-self.max_new_tokens // blocks)
        return steps, block

    def validate(self, **kwargs: Any) -> None:
        """The shared checks, then vanilla's: ``steps`` a multiple of the number of blocks, at most
        ``block_length`` per block (``kwargs``, transformers' ``strict``, change nothing)."""
        super().validate()
        for name in ("steps", "block_length"):  # None takes the default; 0 must not (it did, silently)
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        for flag in ("logits_eos_inf", "confidence_eos_eot_inf"):
            check_bool(flag, getattr(self, flag))
        steps, block = self.resolved()
        check_positive_int("steps", steps)
        check_positive_int("block_length", block)
        _check_steps(steps, self.max_new_tokens, block)


class FastDLLMConfig(DiffusionGenerationConfig):
    """Fast-dLLM: block-wise decoding with parallel (threshold or factor) commits and a KV cache.

    Args:
        cache: ``"none"`` (full forward every step), ``"prefix"`` (block + suffix queried against
            the cached prefix) or ``"dual"`` (only the block queried, whole canvas cached).
        threshold: commit every masked position with top-1 probability ≥ threshold (default 0.9).
        many_masks_threshold / many_masks: commit at ``many_masks_threshold`` instead while a window still has
            more than ``many_masks`` masks left (16 when unset; ``None``, the default: ``threshold``
            everywhere). Each row counts its own masks, so drafts stay exact and padded batches decode as
            alone. A lower threshold loses accuracy among a window's last masks, not while many are left:
            0.85 above 16 masks saves 2-7 % of the forwards at no accuracy cost on training items, where
            0.85 everywhere loses up to 1.5 points (RESULTS §48). In ``drafted(exact=False)``.
        factor: instead of a threshold, commit the largest n with (n + 1)(1 − c_n) < factor.
        steps: with neither threshold nor factor, a fixed quota of tokens per step: ``steps`` spread evenly
            over the blocks (a multiple of their number), at most ``block_length`` a block.
        rule / entropy_bound: ``rule="entropy"`` replaces the threshold with entropy-bounded commits
            (EB-sampler): the masks by confidence, as many as keep their predictive entropies' sum
            within ``entropy_bound`` nats of the largest (RESULTS §32: ahead of the threshold on lists
            and tiny-dream code, behind on arith). ``rule="localleap"``: LocalLeap (docs/localleap.md).
        block_length: block size (default 32).
        early_stop: end a request once a fully decoded block holds EOS (as dInfer does); off by
            default, like the official code, so the benchmark can isolate its effect.
        skip_completed_block_step: the official code runs one more forward on a block that its
            block-start forward already completed (it commits nothing); ``True`` skips that
            forward. Default ``False`` reproduces the official NFE exactly.
        window_queries: ``"all"`` (default, the official dual cache: every block step queries the
            whole block) or ``"sparse"`` (a block step queries only the block's masks and the
            positions committed since the previous step, whose K/V are recomputed once with their
            token; the K/V of earlier commits are reused from the cache). Needs ``cache="dual"``.
        requery_radius: with sparse queries, also re-query the decoded positions within this many
            positions of a mask the step reads (3): the masks attend to them most, and their K/V
            predate their neighbours' latest commits. ``0``: only the stale ones.
        lookahead: ``K`` draft rows per request (0: none, the default). Each block step also
            queries K drafts of the request's next state (its canvas plus the commit its next step
            is likely to make); when the step's own commit shows a draft was exact, the request
            takes the draft's result and skips a forward. Decodes the same tokens as without
            drafts, in fewer forwards, for K windows' more query tokens per step (1 to 6; the
            measured trade is in benchmarks/RESULTS.md §12–13). With ``window_queries="sparse"``
            a draft queries only what the next sparse step would (its K/V are its main row's after
            the forward), and the tokens are sparse Fast-dLLM's. Sampled (``temperature`` > 0): the
            same *distribution* of outputs as without drafts, not the same sample for a generator (a
            draft's commit draws its own noise, independent of the main row's that chose it;
            RESULTS §38); with ``seed`` and sparse steps, the same samples too (§39). Needs
            ``cache="dual"``, ``low_confidence`` remasking and a threshold, factor, entropy or
            LocalLeap rule: what makes a draft exact.
        lookahead_max_masks: draft only while the request's window has at most this many masks left
            (``None``, the default: at every block step). A window with many masks left mostly
            commits several tokens next, which a draft of one or two rarely matches: at 8, lookahead
            1–3 spends 1–26 % fewer query tokens for 0–7 % more forwards (RESULTS §12).
        lookahead_accept: which drafts are adopted. ``"exact"`` (default): a draft whose canvas is the
            request's next canvas, so the tokens are those without drafts. ``"contained"``: also a draft
            whose tokens the step committed along with others; the request keeps its own commit and
            takes the draft's commits where it left masks (docs/algorithm.md, "Contained acceptance";
            measured in benchmarks/RESULTS.md §16). Fewer forwards, not the same tokens.
        lookahead_draft_radius: with sparse window queries and contained acceptance, a greedy decode's
            draft re-queries the decoded neighbours of its masks within this radius only (``None``, the
            default: the ``requery_radius``, as the next sparse step would); beyond it, where its main row
            re-queries one in the same forward, the draft reads that fresh K/V. Fewer query tokens per
            draft, for neighbours one step staler (RESULTS §16). A sampled decode (``temperature`` > 0)
            re-queries at the ``requery_radius`` whatever this says: a step whose one commit is forced samples
            it from the draft's logits, and with staler neighbours those spliced forms (``max(b, b)``;
            tiny-dream code at T 0.5 −1.6 points at radius 2, −0.2 at the main radius: RESULTS §40).
        lookahead_query_budget: a request's step with drafts may query about this many of its windows'
            widths in all (``None``, the default: no limit). Drafts are admitted in order while they fit,
            estimated before the step as a sparse step queries (the masks and the decoded positions within
            the re-query radius of them; a draft at its own radius; a dense step: one window per row).
            Cheap drafts ride, expensive ones wait until fewer masks are left (RESULTS §17).
        lookahead_runner_up: a draft row whose shape needs more masks than the window has left (with
            ``lookahead=3``, the chained ``(0, 1)`` draft once 2 masks are left) drafts, instead of being parked, the
            runner-up token of a mask: the most probable token after the one the other drafts guess, at the mask
            where that token is likeliest. When the step then commits that token alone, the draft stands for the
            next step as any draft does (exact with ``lookahead_accept="exact"``). ``False`` (default): such rows are
            parked. Needs ``lookahead >= 3`` (with fewer drafts every shape rides whenever a draft can). On 1,000
            training items per suite, 0.010-0.012x of the tuned forwards off on code and 0.005-0.009x elsewhere, for
            0.004-0.021x more query tokens and about 8 % more policy operations per forward (RESULTS §49).
        refresh_after_commits: with a cache, a request whose canvas gained this many tokens since its
            cache was last written by a full forward takes a full forward as its next step (a refresh,
            which commits as a block step does), besides the one at each block start (``None``, the
            default: only those, as Fast-dLLM). The cached prompt and suffix keys were computed over
            masks that are now tokens; the block-start forward commits the most (often a whole tail of
            end tokens), so the prompt's keys are stalest right after it. About the same forwards, more
            query tokens (a full forward queries the prompt too). It recovers what entropy-bounded
            commits lose to the dual cache, not what the threshold does not lose (RESULTS §33). A row whose
            window has no mask left is not refreshed so: its next block starts with a full forward anyway
            (RESULTS §54). Not with ``lookahead``: a refresh is a step no draft stands in for.

    On Dream, the official Fast-dLLM commits the block's first position unconditionally at each
    block start (its in-block logit shift cannot predict it later). Our window forward predicts
    every position exactly, so block starts follow the same transfer rule as LLaDA: a deliberate,
    documented difference.
    """

    strategy = "fast_dllm"
    _ours = DiffusionGenerationConfig._ours + (
        "cache", "threshold", "factor", "steps", "block_length", "early_stop", "skip_completed_block_step",
        *_RULE_OPTIONS, "window_queries", "requery_radius", "lookahead",
        "lookahead_max_masks", "lookahead_accept", "lookahead_draft_radius", "lookahead_query_budget",
        "lookahead_runner_up", "refresh_after_commits",
    )  # fmt: skip

    def __init__(self, **kwargs: Any) -> None:
        """Pop Fast-dLLM's fields with their defaults (``threshold`` 0.9 unless ``factor`` or ``steps`` is given),
        then the shared ones."""
        self.cache = kwargs.pop("cache", "dual")
        self.lookahead = kwargs.pop("lookahead", 0)
        self.lookahead_max_masks = kwargs.pop("lookahead_max_masks", None)
        self.lookahead_accept = kwargs.pop("lookahead_accept", "exact")
        self.lookahead_draft_radius = kwargs.pop("lookahead_draft_radius", None)
        self.lookahead_query_budget = kwargs.pop("lookahead_query_budget", None)
        self.lookahead_runner_up = kwargs.pop("lookahead_runner_up", False)
        self.window_queries = kwargs.pop("window_queries", "all")
        self.requery_radius = kwargs.pop("requery_radius", _REQUERY_RADIUS)
        self.threshold = kwargs.pop("threshold", None if any(r in kwargs for r in _RULES[1:]) else 0.9)
        self.factor = kwargs.pop("factor", None)
        self.steps = kwargs.pop("steps", None)
        self.block_length = kwargs.pop("block_length", 32)
        self.early_stop = kwargs.pop("early_stop", False)
        self.skip_completed_block_step = kwargs.pop("skip_completed_block_step", False)
        self.refresh_after_commits = kwargs.pop("refresh_after_commits", None)
        _pop_rule_options(self, kwargs)
        super().__init__(**kwargs)

    @classmethod
    def drafted(cls, exact: bool = True, **kwargs: Any) -> FastDLLMConfig:
        """The lookahead point of issue 16: :data:`DRAFTED` (early stop, sparse window queries at
        radius 6, three exact draft rows of the next sparse step, drafted while at most 8 masks are
        left; with two left, the third drafts a mask's runner-up token: ``lookahead_runner_up``, RESULTS §49),
        with ``kwargs`` on top (``FastDLLMConfig.drafted(max_new_tokens=256, block_length=64)``:
        keep the block size you tuned). ``exact=False`` is :data:`DRAFTED_CONTAINED`: drafts are also
        adopted when the step committed their tokens and more (``lookahead_accept="contained"``),
        drafted while at most 16 masks are left, re-query their masks' neighbours within 2 positions
        when greedy (``lookahead_draft_radius=2``; sampled, within 6), and ride only while the request's
        step fits about two windows of query tokens (``lookahead_query_budget=2.0``); while more than 16 masks
        are left, where no draft rides, it commits at 0.85 (``many_masks_threshold``, RESULTS §48): fewer
        forwards, but no longer sparse Fast-dLLM's tokens (RESULTS §48: on the test splits at the tuned block,
        −0.8 to +0.8 points from the tuned dense Fast-dLLM at 0.68-0.80x its forwards and 0.61-0.83x its query
        tokens).
        ``drafted(exact=False, lookahead=6)`` needs 0.01-0.03x fewer forwards for 0.05-0.11x more query
        tokens, and more CPU time at every batch size measured (RESULTS §17).

        Why a preset rather than the defaults: its tokens are sparse Fast-dLLM's, which are not the
        official decoder's, and it was chosen on 500 training items per suite (``benchmarks/RESULTS.md``
        §13). On the test splits, at the tuned block, it is within 1 point of a tuned dense Fast-dLLM on
        every suite at 0.75-0.83x its forwards and 0.74-0.94x its query tokens (1.10x on one suite).
        ``drafted(lookahead=2)`` spends 0.05-0.09x fewer query tokens for 0.00-0.02x more forwards, and
        less CPU time: 0.86-1.03x the tuned baseline's at batch 1 and 32, against 0.91-1.08x (§14, §15).

        Memory: every draft row holds a whole cache row, so a request keeps ``1 + lookahead`` rows of
        K/V resident (4 here, against Fast-dLLM's 1): at LLaDA-8B and a 1024-position canvas 2.1 GB a
        request, which caps an H200's batch at about 58 against 232 (RESULTS §28; Dream-7B's grouped
        heads make both 9x smaller). ``lookahead=2`` or ``1`` keeps 3 or 2 rows (and no runner-up drafts: with fewer
        than three drafts no row is spare).

        Another transfer rule (``rule="localleap"`` or ``"entropy"``, ``factor``) replaces the threshold that
        ``exact=False`` lowers while many masks are left, so ``many_masks_threshold`` / ``many_masks`` are dropped
        with it unless given (``drafted(exact=False, rule="localleap", relaxed_threshold=0.8, leap_radius=4)``, the
        README's LocalLeap drafts of RESULTS §23, raised since §48 added them)."""
        # the keywords narrow the preset as generate()'s narrow a config (a wrong value is validate()'s to explain)
        return cls(**{**(DRAFTED if exact else DRAFTED_CONTAINED), **cls._read_keywords(kwargs)})

    def validate(self, **kwargs: Any) -> None:
        """The shared checks, then Fast-dLLM's: exactly one of threshold, factor or steps, the cache mode, and
        lookahead and ``refresh_after_commits`` with what they combine with (``kwargs`` change nothing)."""
        super().validate()
        _check_rule(self)
        if self.cache not in ("none", "prefix", "dual"):
            raise ValueError(f"cache must be 'none', 'prefix' or 'dual', got {self.cache!r}.")
        _check_window_queries(self, self.cache)
        check_positive_int("block_length", self.block_length)
        for flag in ("early_stop", "skip_completed_block_step"):
            check_bool(flag, getattr(self, flag))
        chosen = [n for n in _RULES if getattr(self, n) is not None]
        if len(chosen) != 1:
            raise ValueError(f"Give exactly one of threshold, factor or steps (got {chosen or 'none'}).")
        _check_threshold("threshold", self.threshold, allow_none=True)
        if self.factor is not None:
            check_positive_real("factor", self.factor)
        if self.steps is not None:
            check_positive_int("steps", self.steps)
            _check_steps(self.steps, self.max_new_tokens, self.block_length)
        _check_lookahead(self)
        k = self.refresh_after_commits
        if k is not None:
            check_not_numpy_int("refresh_after_commits", k)
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"refresh_after_commits must be an integer >= 1 (tokens committed since the last full "
                                 f"forward) or None, got {k!r}.")  # fmt: skip
            if self.cache == "none":
                raise ValueError("refresh_after_commits refreshes a cache: with cache='none' every step is already a full "
                                 "forward. Use cache='dual' or 'prefix', or leave it None.")  # fmt: skip
            if self.lookahead:
                raise ValueError("refresh_after_commits does not combine with lookahead: a refresh is a step no draft can "
                                 "stand in for, and an adopted draft skips the step after which a refresh would fall, so "
                                 "the drafts would no longer decode the same tokens (RESULTS §33). Drop one of the two.")  # fmt: skip


def _check_lookahead(cfg: FastDLLMConfig) -> None:
    """``lookahead``: an integer 0..6, and the settings under which a draft's forward is exactly the
    next block step (policies/lookahead.py)."""
    from hf_blockbatch.generation.policies.lookahead import DRAFT_SHAPES

    k = cfg.lookahead
    check_not_numpy_int("lookahead", k)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= len(DRAFT_SHAPES):
        raise ValueError(f"lookahead must be an integer from 0 to {len(DRAFT_SHAPES)} (draft rows per request), got {k!r}.")
    m = cfg.lookahead_max_masks
    check_not_numpy_int("lookahead_max_masks", m)
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 2):
        raise ValueError(f"lookahead_max_masks must be an integer >= 2 (masks left in the window) or None, got {m!r}.")
    accept = cfg.lookahead_accept
    if accept not in ("exact", "contained"):
        raise ValueError(f"lookahead_accept must be 'exact' or 'contained', got {accept!r}.")
    rd = cfg.lookahead_draft_radius
    check_not_numpy_int("lookahead_draft_radius", rd)
    if rd is not None and (not isinstance(rd, int) or isinstance(rd, bool) or rd < 0):
        raise ValueError(f"lookahead_draft_radius must be an integer >= 0 or None, got {rd!r}.")
    qb = cfg.lookahead_query_budget
    if qb is not None:
        try:
            positive = check_real("lookahead_query_budget", qb) > 0
        except ValueError:  # one message for every wrong value: it says what a budget is
            positive = False
        if not positive:
            raise ValueError(f"lookahead_query_budget must be a positive number of windows (e.g. 2.0) or None, got {qb!r}.")
    check_bool("lookahead_runner_up", cfg.lookahead_runner_up)
    if cfg.lookahead_runner_up and k < 3:
        raise ValueError(f"lookahead_runner_up drafts in rows whose shape cannot ride, and with lookahead={k} every shape "
                         "rides whenever a draft can: set lookahead >= 3, or lookahead_runner_up=False.")  # fmt: skip
    if not k:
        # all at once, with the values to set: a preset (drafted()) sets several, which one message each, saying
        # "leave it None" of a value the caller never set, left to find one by one
        drafting = {name: default for name, value, default in (
            ("lookahead_max_masks", m, None), ("lookahead_accept", accept, "exact"),
            ("lookahead_draft_radius", rd, None), ("lookahead_query_budget", qb, None)) if value != default}  # fmt: skip
        if drafting:
            says, needs = ("says", "it needs") if len(drafting) == 1 else ("say", "they need")
            raise ValueError(f"{', '.join(drafting)} {says} how to draft: {needs} lookahead >= 1 (or set "
                             + ", ".join(f"{name}={default!r}" for name, default in drafting.items()) + ").")
        return
    if rd is not None and (accept != "contained" or cfg.window_queries != "sparse"):
        raise ValueError("lookahead_draft_radius makes a draft's forward differ from the next sparse step: it needs "
                         "window_queries='sparse' and lookahead_accept='contained' (or set lookahead_draft_radius=None).")
    wrong = [
        why for bad, why in (
            (cfg.cache != "dual", f"cache='dual' (got {cfg.cache!r})"),
            (cfg.remasking != "low_confidence", f"remasking='low_confidence' (got {cfg.remasking!r})"),
            (cfg.steps is not None, "a threshold, factor, LocalLeap or entropy rule (steps= keeps a per-block schedule)"),
        ) if bad
    ]  # fmt: skip
    if wrong:
        raise ValueError(f"lookahead={k} needs " + "; ".join(wrong) + ", or set lookahead=0.")


# ---- BlockBatch options beyond the paper (issue 16): one compact block, each off by default
_BEYOND_DEFAULTS: dict[str, Any] = {"prune_after_syncs": None, "merge_agreement": 0, "eos_prefer_widest": False,
                                    "window_queries": "all", "requery_radius": _REQUERY_RADIUS,
                                    "merge_source_confidence": None}  # fmt: skip
_BEYOND = tuple(_BEYOND_DEFAULTS)

#: the merge and branch guards of the beyond-the-paper Pareto point (benchmarks/RESULTS.md §11): a
#: merge takes a token only where both rows agree within 2 positions and the source holds it at
#: >= 0.7, the widest EOS hitter wins, a branch retires once synced to its leader
LEAN_GUARDS: dict[str, Any] = {"merge_agreement": 2, "merge_source_confidence": 0.7, "eos_prefer_widest": True,
                               "prune_after_syncs": 1}  # fmt: skip
#: that point whole: three branches and sparse window queries at re-query radius 6, with the guards
LEAN: dict[str, Any] = {"block_sizes": [4, 16, 64], "window_queries": "sparse", "requery_radius": 6, **LEAN_GUARDS}
#: the lookahead point (benchmarks/RESULTS.md §13; ``FastDLLMConfig.drafted``): Fast-dLLM with early
#: stop and sparse window queries at radius 6, three exact draft rows of its next sparse step, drafted
#: while the window has at most 8 masks left; with two masks left, the third row drafts a mask's runner-up
#: token (§49: 0.005-0.012x fewer forwards on 1,000 training items per suite, the same tokens)
DRAFTED: dict[str, Any] = {"early_stop": True, "window_queries": "sparse", "requery_radius": 6, "lookahead": 3,
                           "lookahead_max_masks": 8, "lookahead_runner_up": True}  # fmt: skip
#: the fewest-forwards lookahead point (benchmarks/RESULTS.md §16; ``FastDLLMConfig.drafted(exact=False)``):
#: the same drafts, also adopted when the step committed their tokens and more, drafted while the
#: window has at most 16 masks left, each re-querying its masks' neighbours within 2 positions only, as
#: many of them as fit a step of about two windows' query tokens per request (chosen on 500 training
#: items per suite; the budget binds in 32-wide windows, where a sparse step is most of a window)
DRAFTED_CONTAINED: dict[str, Any] = {**DRAFTED, "lookahead_max_masks": 16, "lookahead_accept": "contained",
                                     "lookahead_draft_radius": 2, "lookahead_query_budget": 2.0}  # fmt: skip
#: and a threshold of 0.85 in the steps where no draft can ride, above the drafts' mask gate (RESULTS §48)
DRAFTED_CONTAINED.update(many_masks_threshold=0.85, many_masks=DRAFTED_CONTAINED["lookahead_max_masks"])


def _as_block_sizes(sizes: Any) -> Any:
    """BlockBatch's ``block_sizes`` as a list: one size is one branch (``--set blockbatch.block_sizes=8``), a tuple
    is its sizes. Anything else is kept as given, for ``validate`` to refuse with the field's name."""
    if isinstance(sizes, int) and not isinstance(sizes, bool):
        return [sizes]
    return list(sizes) if isinstance(sizes, (list, tuple)) else sizes


def _check_beyond(cfg: Any) -> None:
    """The issue-16 options: types, ranges, and the parts they need."""
    k = cfg.prune_after_syncs
    if k is not None:
        check_positive_int("prune_after_syncs", k)
        if not cfg.sync or len(cfg.block_sizes) < 2:
            raise ValueError("prune_after_syncs prunes branches that were synced: it needs sync=True and at least two "
                             "block_sizes (or set prune_after_syncs=None).")  # fmt: skip
    r = cfg.merge_agreement
    check_not_numpy_int("merge_agreement", r)
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise ValueError(f"merge_agreement must be an integer >= 0 (positions either side), got {r!r}.")
    if r and not cfg.merge:
        raise ValueError("merge_agreement guards merges: it needs merge=True (or set merge_agreement=0).")
    if cfg.merge_source_confidence is not None:
        _check_threshold("merge_source_confidence", cfg.merge_source_confidence)
        if not cfg.merge:
            raise ValueError("merge_source_confidence guards merges: it needs merge=True (or set it to None).")
    if not isinstance(cfg.eos_prefer_widest, bool):
        raise ValueError(f"eos_prefer_widest must be True or False, got {cfg.eos_prefer_widest!r}.")
    if cfg.eos_prefer_widest and not cfg.early_stop:
        raise ValueError("eos_prefer_widest ranks the branches that hit EOS: it needs early_stop=True.")
    _check_window_queries(cfg, "dual")


class BlockBatchConfig(DiffusionGenerationConfig):
    """BlockBatch: one branch per block size, decoded together in one packed forward per step.

    Each branch is a row of its own, with its own cache row: a request keeps ``len(block_sizes)`` rows
    of K/V resident (6 by default, against Fast-dLLM's 1; RESULTS §28).

    Args:
        block_sizes: the branches (paper: 4, 8, 16, 32, 64, 128).
        threshold / factor: the transfer rule of every branch (threshold 0.9 by default);
            ``rule="entropy"`` with ``entropy_bound`` or ``rule="localleap"`` as in :class:`FastDLLMConfig`;
            ``many_masks_threshold`` / ``many_masks`` too (each branch counts its own window's masks).
        merge: confidence-gated merging between compatible branches (``merge.py``).
        merge_threshold: a destination commits a source's token only if its own probability for
            it is above this (0.5).
        sync: leader sync (``sync.py``); sync_threshold: how many decoded tokens a branch may lag
            the leader before it copies the leader's canvas and cache (8).
        refresh: ``"periodic"`` (a branch that advanced ``refresh_interval`` tokens since its last
            refresh is refreshed by a full forward), ``"divergence"`` (also when its keys drift from
            the branches' mean by more than ``divergence_threshold``), or ``"off"``.
        refresh_interval: tokens between periodic refreshes (32).
        early_stop: end a request once a branch's fully decoded block holds EOS (on).
        eos_confidence: when several branches of a request hit EOS in the same step, the one most
            confident in its EOS wins; ``"completion"`` reads that confidence from the forward that
            completed the block (the EOS token's probability at the first EOS), as the reference's
            LLaDA code does; ``"commit"`` keeps the EOS token's probability from when it was
            committed (or merged, or copied by a sync), as its Dream code does. ``"completion"`` is
            the default: on the six tiny suites it was right on 69 items where ``"commit"`` was
            wrong, and wrong on 52 where it was right (``benchmarks/RESULTS.md`` §6).
        skip_completed_block_step: as in :class:`FastDLLMConfig` (the reference BlockBatch code also
            runs the extra forward on a block that a full forward completed; default ``False``).
        variant: ``"ours"`` (default) or ``"reference"``: the authors' bulk LLaDA decoder step for
            step (their refresh, sync, merge order and EOS rule; see docs/algorithm.md, "Where the
            authors' code differs"). It supports only the options their code has.

    Beyond the paper (issue 16; off by default, measured in ``benchmarks/beyond_paper.py``):
        prune_after_syncs: retire a branch for the rest of its request once it has been synced
            this many times (``policies/prune.py``): it is never queried, refreshed, merged, synced
            or a leader again, so its query tokens stop. ``None`` (default): never. Needs ``sync``.
        merge_agreement: a merge takes a source's token at a position only where source and
            destination hold the same (token, or both masked) within this many positions either
            side (``policies/merge.py``), so that a merge cannot splice two answer forms. ``0``
            (default): no such guard, the paper's merge. Needs ``merge``.
        merge_source_confidence: a merge takes a source's token only where the source holds it at
            a probability at least this (it committed, merged or copied it at that probability), so
            a narrow branch's forced commits (its window's best candidate when none reaches the
            threshold) stay its own. ``None`` (default): every decoded token is offered, the paper's
            merge. Needs ``merge``.
        eos_prefer_widest: when several branches hit EOS in the same step, the one with the largest
            block wins, instead of the one most confident in its EOS (``eos_confidence``). Why: the
            hitters' EOS probabilities are often within 1e-6 of 1 and of each other, so that ranking
            is a coin toss; the widest window chose its answer tokens with current keys and values
            for the whole answer, a narrow one against a cache stale beyond its window. ``False``
            (default): the paper's ranking. Needs ``early_stop``.
        window_queries: ``"sparse"``: each block step queries only the masks of a branch's window
            and the positions decoded since their K/V were written (as in :class:`FastDLLMConfig`),
            so a wide window costs what it has left to decode, not its width. ``"all"`` (default):
            every window position, as the paper. ``requery_radius``: as in :class:`FastDLLMConfig`.
    """

    strategy = "blockbatch"
    _ours = DiffusionGenerationConfig._ours + (
        "block_sizes", "threshold", "factor", "merge", "merge_threshold", "sync", "sync_threshold", "refresh",
        "refresh_interval", "divergence_threshold", "early_stop", "eos_confidence", "skip_completed_block_step",
        *_RULE_OPTIONS, "variant",
    ) + _BEYOND  # fmt: skip

    def __init__(self, **kwargs: Any) -> None:
        """Pop BlockBatch's fields with their defaults (``threshold`` 0.9 unless ``factor`` is given; ``block_sizes``
        a list, see :meth:`__setattr__`), then the shared ones."""
        self.variant = kwargs.pop("variant", "ours")
        self.block_sizes = kwargs.pop("block_sizes", (4, 8, 16, 32, 64, 128))
        self.threshold = kwargs.pop("threshold", 0.9 if "factor" not in kwargs else None)
        self.factor = kwargs.pop("factor", None)
        self.merge = kwargs.pop("merge", True)
        self.merge_threshold = kwargs.pop("merge_threshold", 0.5)
        self.sync = kwargs.pop("sync", True)
        self.sync_threshold = kwargs.pop("sync_threshold", 8)
        self.refresh = kwargs.pop("refresh", "periodic")
        self.refresh_interval = kwargs.pop("refresh_interval", 32)
        self.divergence_threshold = kwargs.pop("divergence_threshold", 0.1)
        self.early_stop = kwargs.pop("early_stop", True)
        self.eos_confidence = kwargs.pop("eos_confidence", "completion")
        self.skip_completed_block_step = kwargs.pop("skip_completed_block_step", False)
        _pop_rule_options(self, kwargs)
        for name, default in _BEYOND_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(**kwargs)

    @classmethod
    def lean(cls, **kwargs: Any) -> BlockBatchConfig:
        """The beyond-the-paper Pareto point: :data:`LEAN` (three branches 4 / 16 / 64, guarded
        merges, the widest EOS winner, synced branches retire, sparse queries at radius 6), with
        ``kwargs`` on top (``BlockBatchConfig.lean(max_new_tokens=256)``).

        Why a preset rather than the defaults: it was chosen on 500 training items per suite and
        reported on the test splits (``benchmarks/RESULTS.md`` §11). There it is within 1 point of
        a tuned Fast-dLLM on 5 of 6 suites, with no paired interval excluding 0, at 0.97-0.98x its
        forwards and 0.77-0.93x its query tokens. The paper's defaults need fewer forwards but lose
        10-14 points on code. The defaults stay the paper's algorithm; this is the point we
        recommend against a tuned baseline."""
        return cls(**{**LEAN, "block_sizes": list(LEAN["block_sizes"]), **kwargs})

    def __setattr__(self, name: str, value: Any) -> None:
        """``block_sizes`` reads as a list however it is set: one size (``block_sizes=8``) or a tuple, given to the
        constructor, ``generate(..., block_sizes=(4, 16, 64))``, transformers' ``update`` and ``from_pretrained(...,
        block_sizes=...)``, or assigned. Only the constructor and ``generate`` took them before; the others were
        refused by ``validate``, whose message says a block size or a list is what it takes."""
        super().__setattr__(name, _as_block_sizes(value) if name == "block_sizes" else value)

    def validate(self, **kwargs: Any) -> None:
        """The shared checks, then BlockBatch's: block sizes (distinct, positive), exactly one of threshold or
        factor, merge, sync and refresh settings, and the reference variant's limits (``kwargs`` change nothing)."""
        super().validate()
        _check_rule(self)
        _check_beyond(self)
        if self.eos_confidence not in ("completion", "commit"):
            raise ValueError(f"eos_confidence must be 'completion' or 'commit', got {self.eos_confidence!r}.")
        if not isinstance(self.block_sizes, list):
            raise ValueError(
                f"block_sizes must be a block size or a list of them, e.g. [4, 8, 16, 32, 64], got "
                f"{self.block_sizes!r} ({type(self.block_sizes).__name__})."
            )
        if not self.block_sizes:
            raise ValueError("block_sizes must name at least one block size, e.g. [4, 8, 16, 32, 64].")
        for i, b in enumerate(self.block_sizes):
            check_positive_int(f"block_sizes[{i}]", b)
        if len(set(self.block_sizes)) != len(self.block_sizes):
            raise ValueError(f"block_sizes must not repeat a size, got {self.block_sizes}.")
        if (self.threshold is None) == (self.factor is None):
            raise ValueError("Give exactly one of threshold or factor.")
        _check_threshold("threshold", self.threshold, allow_none=True)
        if self.factor is not None:
            check_positive_real("factor", self.factor)
        _check_threshold("merge_threshold", self.merge_threshold)
        check_not_numpy_int("sync_threshold", self.sync_threshold)
        if not isinstance(self.sync_threshold, int) or isinstance(self.sync_threshold, bool) or self.sync_threshold < 0:
            raise ValueError(f"sync_threshold must be an integer >= 0, got {self.sync_threshold!r}.")
        if self.refresh not in ("periodic", "divergence", "off"):
            raise ValueError(f"refresh must be 'periodic', 'divergence' or 'off', got {self.refresh!r}.")
        check_positive_int("refresh_interval", self.refresh_interval)
        check_positive_real("divergence_threshold", self.divergence_threshold)
        for flag in ("merge", "sync", "early_stop", "skip_completed_block_step"):
            check_bool(flag, getattr(self, flag))
        if self.variant not in ("ours", "reference"):
            raise ValueError(f"variant must be 'ours' or 'reference' (the authors' bulk BlockBatch), got {self.variant!r}.")
        if self.variant == "reference":
            _check_reference(self)


def _check_reference(cfg: BlockBatchConfig) -> None:
    """``variant="reference"`` reproduces the authors' bulk LLaDA decoder, which has none of these
    options: refuse them rather than decode something that is neither theirs nor ours."""
    unsupported = [
        (cfg.factor is not None, "factor (their rule is the threshold rule)"),
        (cfg.rule is not None, f"rule={cfg.rule!r} (their rule is the threshold rule)"),
        (cfg.refresh == "divergence", "refresh='divergence' (their bulk decoder refreshes periodically)"),
        (bool(cfg.skip_completed_block_step), "skip_completed_block_step (their order is built in)"),
        (float(cfg.temperature or 0.0) > 0, "temperature > 0 (their decoder is greedy)"),
        (cfg.remasking != "low_confidence", f"remasking={cfg.remasking!r} (theirs is 'low_confidence')"),
        (not cfg.early_stop, "early_stop=False (their decoder always stops at EOS)"),
        (cfg.eos_confidence != "completion", "eos_confidence='commit' (they rank by the completing forward)"),
        *((getattr(cfg, k) != v, f"{k}={getattr(cfg, k)!r} (an option beyond the paper)") for k, v in _BEYOND_DEFAULTS.items()),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"variant='reference' does not support {what}: remove it, or use variant='ours'.")
    bad_sizes = [b for b in cfg.block_sizes if cfg.max_new_tokens % b]
    if bad_sizes:
        raise ValueError(f"variant='reference' needs every block size to divide max_new_tokens "
                         f"({cfg.max_new_tokens}), as the authors' code asserts; {bad_sizes} do not.")  # fmt: skip


_BY_STRATEGY = {c.strategy: c for c in (VanillaDiffusionConfig, FastDLLMConfig, BlockBatchConfig)}


def config_from_dict(data: dict[str, Any]) -> DiffusionGenerationConfig:
    """Rebuild the right config class from a saved dict (its ``strategy`` field). A JSON string (what
    ``to_json_string()`` gives) is refused with a TypeError that says to parse it: ``data.get`` failed on it."""
    if not isinstance(data, Mapping):
        raise TypeError(f"config_from_dict: data must be a dict, e.g. json.loads(text) or cfg.to_dict(), got "
                        f"{type(data).__name__}.")  # fmt: skip
    strategy = data.get("strategy")
    if strategy not in _BY_STRATEGY:
        raise ValueError(f"Unknown strategy {strategy!r}; expected one of {sorted(_BY_STRATEGY)}.")
    return _BY_STRATEGY[strategy](**{k: v for k, v in data.items() if k != "transformers_version"})
