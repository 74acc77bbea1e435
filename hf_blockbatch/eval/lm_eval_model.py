"""An lm-evaluation-harness model: ``--model hf_blockbatch``, decoding with our ``generate``.

Why: lm-evaluation-harness is what the BlockBatch and Fast-dLLM authors evaluated with, so its
task definitions (prompts, few-shot selection, answer filters, metrics) are the reference for
comparing accuracies with theirs. This adapter implements ``generate_until`` with vanilla,
Fast-dLLM or BlockBatch decoding; the harness does everything else.

Use (the harness only knows models whose module was imported, so start it through this module,
which registers the class and then runs the harness's own command line)::

    python -m hf_blockbatch.eval.lm_eval_model run --model hf_blockbatch \\
        --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct,method=blockbatch,gen_length=256 \\
        --tasks gsm8k --num_fewshot 5 --batch_size 4 --apply_chat_template

or from Python: ``import hf_blockbatch.eval.lm_eval_model`` then
``lm_eval.simple_evaluate(model="hf_blockbatch", model_args=...)``.

``model_args``: ``pretrained`` (default ``tiny-llada``), ``method`` (``vanilla``, ``fast_dllm``,
``fast_dllm_early_stop``, ``blockbatch``), ``gen_length`` (default: the task's ``max_gen_toks``,
else 256), ``dtype``, ``device_map``, and any field of the method's config (``threshold=0.9``,
``block_length=64``, ``block_sizes=4|8|16|32`` — ``|`` separates list items, since the harness
splits ``model_args`` at commas). Data parallel: ``accelerate launch -m
hf_blockbatch.eval.lm_eval_model run ...`` (the harness splits requests by rank).

Log-likelihood requests (multiple-choice tasks) are refused: a masked diffusion model has no
cheap left-to-right log-likelihood (LLaDA estimates it by Monte Carlo over masking ratios, with
hundreds of forwards per answer), and every task of the paper is generative.

lm-evaluation-harness is an optional dependency (``pip install hf-blockbatch[lmeval]``); without
it this module still imports (the class then has a minimal stand-in base), so the adapter can be
tested without the harness.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from typing import Any

import torch

from hf_blockbatch.eval.runner import METHODS, build_method_configs, partial_state, shard_info
from hf_blockbatch.generation.outputs import answer_texts, end_token_ids

logger = logging.getLogger(__name__)

__all__ = ["HAVE_LM_EVAL", "HFBlockBatchLM", "main"]

#: the canvas length when neither ``gen_length`` nor the task's ``max_gen_toks`` sets one
DEFAULT_GEN_LENGTH = 256

try:  # pragma: no cover - depends on the optional extra
    from lm_eval.api.model import LM as _LMBase
    from lm_eval.api.registry import register_model

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - exercised when the extra is absent
    HAVE_LM_EVAL = False

    class _LMBase:  # type: ignore[no-redef]
        """Stand-in for ``lm_eval.api.model.LM`` when the harness is not installed."""

        def __init__(self) -> None:
            self._rank, self._world_size = 0, 1

    def register_model(*names: str):  # type: ignore[no-redef]
        return lambda cls: cls


_NOT_GENERATIVE = (
    "hf_blockbatch: {what} is not supported. Masked diffusion models (LLaDA, Dream) do not give "
    "left-to-right log-likelihoods cheaply (LLaDA estimates them by Monte Carlo over masking ratios, "
    "hundreds of forwards per answer). Use generative tasks (generate_until), as the paper does: "
    "gsm8k, minerva_math, humaneval, mbpp."
)


def _field_value(value: Any) -> Any:
    """``model_args`` values: the harness already made numbers and booleans; ``a|b|c`` is a list."""
    if isinstance(value, str) and "|" in value:
        from hf_blockbatch.eval.runner import _parse_value

        return [_parse_value(v) for v in value.split("|") if v]
    return value


@register_model("hf_blockbatch", "hf-blockbatch")
class HFBlockBatchLM(_LMBase):
    """lm-evaluation-harness adapter around a hf-blockbatch model (see the module docstring)."""

    def __init__(
        self,
        pretrained: str | Any = "tiny-llada",
        method: str = "blockbatch",
        gen_length: int | None = None,
        batch_size: int | str = 1,
        device: str | None = None,
        dtype: str = "auto",
        device_map: str | None = None,
        tokenizer: Any = None,
        max_batch_size: int | None = None,
        **config_fields: Any,
    ) -> None:
        super().__init__()
        if method not in METHODS:  # every method the bench knows (a new one is one entry of METHODS)
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        shard = shard_info()
        self._rank, self._world_size = shard.rank, shard.world_size
        if self._world_size > 1:
            partial_state(shard)  # joins the process group the harness's gathers use
        if isinstance(pretrained, str):
            from hf_blockbatch.hub import load_model

            torch_dtype = None if dtype == "auto" else getattr(torch, str(dtype))
            if device_map is not None:
                self.model, self.tokenizer = load_model(pretrained, dtype=torch_dtype, device_map=device_map)
            else:
                # the harness passes "cuda:0" by default: under a launcher each process takes its own
                # GPU, and without CUDA the model stays on the CPU (as the harness's own HF model does)
                if device is None or (str(device).startswith("cuda") and self._world_size > 1):
                    device = f"cuda:{shard.local_rank}" if torch.cuda.is_available() else "cpu"
                elif str(device).startswith("cuda") and not torch.cuda.is_available():
                    logger.warning("device=%s but CUDA is not available: running on the CPU", device)
                    device = "cpu"
                self.model, self.tokenizer = load_model(pretrained, device=device, dtype=torch_dtype)
            self._name = pretrained
        else:  # an already loaded model (tests, notebooks)
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a model object")
            self.model, self.tokenizer, self._name = pretrained, tokenizer, type(pretrained).__name__
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._device = next(self.model.parameters()).device
        self._end_ids = end_token_ids(self.tokenizer, self.model.config)
        self.method = method
        self.gen_length = int(gen_length) if gen_length is not None else None
        # "auto" (the harness's batch-size search) has no meaning here: decode one at a time
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self.overrides = {method: {k: _field_value(v) for k, v in config_fields.items()}}
        # fail on a bad field now, not after loading data (at the length the first request will likely use)
        build_method_configs([method], self.gen_length or DEFAULT_GEN_LENGTH, self.overrides)
        #: NFE of every request decoded so far, in order
        self.nfe: list[int] = []
        self.seconds = 0.0

    # ------------------------------------------------------------------ harness API

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self._name)).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template is not False else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        raise NotImplementedError(_NOT_GENERATIVE.format(what="loglikelihood (multiple-choice tasks)"))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(_NOT_GENERATIVE.format(what="loglikelihood_rolling (perplexity tasks)"))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Decode every request's context and cut the text at its first stop string."""
        from tqdm.auto import tqdm

        args = [tuple(r.args) for r in requests]
        # group requests with the same generation settings, longest first (less padding per batch)
        order = sorted(range(len(args)), key=lambda i: (self._settings_key(args[i][1]), -len(args[i][0])))
        out: list[str | None] = [None] * len(args)
        bar = tqdm(total=len(args), desc="hf_blockbatch", disable=disable_tqdm or self._rank != 0)
        i = 0
        while i < len(order):
            key = self._settings_key(args[order[i]][1])
            batch = [order[i]]
            while len(batch) < self.batch_size and i + len(batch) < len(order) \
                    and self._settings_key(args[order[i + len(batch)]][1]) == key:  # fmt: skip
                batch.append(order[i + len(batch)])
            texts = self._generate([args[j][0] for j in batch], args[batch[0]][1])
            for j, text in zip(batch, texts):
                out[j] = text
                if getattr(self, "cache_hook", None) is not None:
                    self.cache_hook.add_partial("generate_until", args[j], text)
            bar.update(len(batch))
            i += len(batch)
        bar.close()
        if self.nfe:
            logger.info("hf_blockbatch %s: %d requests, mean NFE %.1f, %.1f s decoding", self.method,
                        len(self.nfe), statistics.fmean(self.nfe), self.seconds)  # fmt: skip
        return [o if o is not None else "" for o in out]

    def get_model_info(self) -> dict[str, Any]:
        info = {"hf_blockbatch_method": self.method, "hf_blockbatch_overrides": self.overrides}
        if self.nfe:
            info["hf_blockbatch_mean_nfe"] = statistics.fmean(self.nfe)
        return info

    # ------------------------------------------------------------------ helpers

    def _gen_length(self, gen_kwargs: dict[str, Any]) -> int:
        if self.gen_length is not None:
            return self.gen_length
        return int(gen_kwargs.get("max_gen_toks") or gen_kwargs.get("max_new_tokens") or DEFAULT_GEN_LENGTH)

    def _settings_key(self, gen_kwargs: dict[str, Any]) -> tuple:
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0) if gen_kwargs.get("do_sample", True) else 0.0
        return self._gen_length(gen_kwargs), temperature

    def _generate(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[str]:
        gen_length, temperature = self._settings_key(gen_kwargs)
        cfg = build_method_configs([self.method], gen_length, self.overrides)[self.method]
        cfg.temperature = temperature
        bos = getattr(self.tokenizer, "bos_token", None)
        # a context rendered by a chat template already starts with BOS; a raw one gets it added
        add_special = not (bos and all(c.startswith(bos) for c in contexts))
        enc = self.tokenizer(contexts, add_special_tokens=add_special, return_tensors="pt", padding=True)
        ids, mask = enc.input_ids.to(self._device), enc.attention_mask.to(self._device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            result = self.model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
        self.seconds += time.perf_counter() - t0
        self.nfe.extend(int(n) for n in result.nfe)
        texts = answer_texts(self.tokenizer, result.sequences[:, ids.shape[1] :], self._end_ids)
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        return [_cut(t, until) for t in texts]

    # ------------------------------------------------------------------ data parallel (accelerate)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        from accelerate.utils import gather

        return gather(tensor.reshape(1) if tensor.dim() == 0 else tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self._world_size == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def barrier(self) -> None:
        if self._world_size > 1:
            partial_state(shard_info()).wait_for_everyone()


def _cut(text: str, stops: list[str]) -> str:
    """``text`` up to the earliest stop string (the harness's ``until``)."""
    end = len(text)
    for s in stops:
        if s:
            k = text.find(s)
            if k != -1:
                end = min(end, k)
    return text[:end]


def main(argv: list[str] | None = None) -> None:
    """Run lm-evaluation-harness's command line with ``hf_blockbatch`` registered."""
    if not HAVE_LM_EVAL:
        raise SystemExit("lm-evaluation-harness is not installed: pip install 'hf-blockbatch[lmeval]'")
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
