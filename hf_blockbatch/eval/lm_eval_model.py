"""An lm-evaluation-harness model: ``--model hf_blockbatch``, decoding with our ``generate``.

Why: lm-evaluation-harness is what the BlockBatch and Fast-dLLM authors evaluated with, so its
task definitions (prompts, few-shot selection, answer filters, metrics) are the reference for
comparing accuracies with theirs. This adapter implements ``generate_until`` with vanilla,
Fast-dLLM or BlockBatch decoding; the harness does everything else.

Use: the harness only knows models whose module was imported, and lm-eval 0.4 discovers no
plugins, so a bare ``lm_eval --model hf_blockbatch`` cannot find this class. ``hf-blockbatch
lm-eval`` (or ``python -m hf_blockbatch.eval.lm_eval_model``) is the harness's own command line,
same arguments, with the class registered::

    hf-blockbatch lm-eval --model hf_blockbatch \\
        --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct,method=blockbatch,gen_length=256 \\
        --tasks gsm8k --num_fewshot 5 --batch_size 4 --apply_chat_template --log_samples --output_path out

It adds what the harness cannot know: each task's NFE (mean, and the other statistics in
``results["config"]["hf_blockbatch_tasks"]``) next to its metrics in the printed table and the
results JSON, each logged sample's NFE and decoding stats (its ``hf_blockbatch`` field), and the
device the model really ran on. From Python: ``import hf_blockbatch.eval.lm_eval_model as m``,
``results = lm_eval.simple_evaluate(model="hf_blockbatch", model_args=...)``, then
``m.annotate_results(results)``.

A prompt longer than the model's context (minus the generation length) is cut from the left with
a warning, as the harness's own ``hf`` model does, so one long few-shot prompt does not abort a
run; ``model.generate`` itself refuses such a prompt.

``model_args``: ``pretrained`` (default ``tiny-llada``), ``method`` (any method of ``hf-blockbatch bench``:
``vanilla``, ``fast_dllm``, ``fast_dllm_early_stop``, ``blockbatch``, ``fast_dllm_drafted``, ...),
``gen_length`` (default: the task's ``max_gen_toks``, else 256), ``dtype``, ``device_map``, and any field of the method's config (``threshold=0.9``,
``block_length=64``, ``block_sizes=4|8|16|32`` — ``|`` separates list items, since the harness
splits ``model_args`` at commas). Data parallel: ``accelerate launch -m
hf_blockbatch.eval.lm_eval_model run ...`` on GPUs, ``torchrun --nproc_per_node N -m hf_blockbatch.eval.lm_eval_model
run ...`` on CPUs (accelerate starts one process without a GPU); the harness splits requests by rank, and
process 0's results count every process's NFE.

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
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from hf_blockbatch.checks import check_positive_int
from hf_blockbatch.eval.runner import METHODS, build_method_configs, partial_state, shard_info
from hf_blockbatch.generation.outputs import answer_texts, end_token_ids

logger = logging.getLogger(__name__)

__all__ = ["HAVE_LM_EVAL", "HFBlockBatchLM", "annotate_results", "main"]

#: (records, device) of each adapter created since the last :func:`annotate_results`: the harness
#: drops its adapter before returning the results, so what annotating needs is kept here (small:
#: a few numbers per request, never the model)
_RUNS: list[tuple[list[dict[str, Any]], str]] = []

#: the canvas length when neither ``gen_length`` nor the task's ``max_gen_toks`` sets one
DEFAULT_GEN_LENGTH = 256

#: config fields that every request's ``gen_kwargs`` decide (:meth:`HFBlockBatchLM._settings_key`), so ``model_args``
#: cannot set them
_PER_REQUEST_FIELDS = ("temperature", "do_sample")

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

    def register_model(*names: str) -> Callable[[type], type]:  # type: ignore[no-redef]
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
        """Check ``method``, ``gen_length`` and the config fields (those a task sets per request refused) before
        anything loads, then load ``pretrained`` (a name) on this process's device or by ``device_map``, or take a
        loaded model and its ``tokenizer``, which is set to pad on the left."""
        super().__init__()
        if method not in METHODS:  # every method the bench knows (a new one is one entry of METHODS)
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        if isinstance(gen_length, str) and gen_length.strip().isdigit():  # the harness parses numbers; Python callers may not
            gen_length = int(gen_length)
        if gen_length is not None:  # 0 was taken for "unset" by the check below, and refused at the first request
            check_positive_int("gen_length", gen_length)  # "abc" got int()'s "invalid literal" before
        self.gen_length = gen_length
        if "max_new_tokens" in config_fields:  # the bench's refusal names its --gen-length, which is not this interface's
            raise ValueError("model_args max_new_tokens: the generation length is model_args gen_length=N (else the task's "
                             f"max_gen_toks, else {DEFAULT_GEN_LENGTH}); drop max_new_tokens.")  # fmt: skip
        per_request = sorted(set(config_fields) & set(_PER_REQUEST_FIELDS))
        if per_request:  # each request's gen_kwargs set them (greedy unless they sample): given here, they were ignored
            raise ValueError(
                f"model_args {', '.join(per_request)}: each task sets this per request (its generation_kwargs); give it "
                f"to the harness instead, e.g. --gen_kwargs temperature=0.7, and drop it from model_args."
            )
        self.overrides = {method: {k: _field_value(v) for k, v in config_fields.items()}}
        # fail on a bad field now, before loading the model and the data (at the length the first request will
        # likely use)
        build_method_configs([method], self.gen_length or DEFAULT_GEN_LENGTH, self.overrides)
        shard = shard_info()
        self._rank, self._world_size = shard.rank, shard.world_size
        if self._world_size > 1:
            partial_state(shard)  # joins the process group the harness's gathers use
        if isinstance(pretrained, str):
            from hf_blockbatch.hub import load_model

            # "auto" here is the device's default (load_model's None); load_model checks any other name itself
            torch_dtype = None if dtype == "auto" else dtype
            if device_map is not None:
                self.model, self.tokenizer = load_model(pretrained, dtype=torch_dtype, device_map=device_map)
            else:
                # the harness passes "cuda:0" by default: under a launcher each process takes its own
                # GPU, and without CUDA the model stays on the CPU (as the harness's own HF model does)
                if device is None or (str(device).startswith("cuda") and self._world_size > 1):
                    device = f"cuda:{shard.local_rank}" if torch.cuda.is_available() else "cpu"
                elif str(device).startswith("cuda") and not torch.cuda.is_available():
                    # the harness's default, not a request: said once, quietly (its own hf model does the same)
                    logger.info("device=%s but CUDA is not available: running on the CPU", device)
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
        self._device = self.model.device
        self._end_ids = end_token_ids(self.tokenizer, self.model.config)
        # "auto" (the harness's batch-size search) has no meaning here: decode one at a time
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        #: NFE of every request decoded so far, in order
        self.nfe: list[int] = []
        #: per request decoded so far: its task, document, NFE and decoding stats (for annotate_results)
        self.records: list[dict[str, Any]] = []
        self.seconds = 0.0
        self.truncated = 0
        _RUNS.append((self.records, str(self._device)))

    # ------------------------------------------------------------------ harness API

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name with ``/`` as ``__``, as the harness's ``hf`` model gives it (it names cached requests)."""
        return str(getattr(self.tokenizer, "name_or_path", self._name)).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template for the harness's ``--apply_chat_template`` (``""`` while that is off, None
        when the tokenizer has none)."""
        return getattr(self.tokenizer, "chat_template", None) if chat_template is not False else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The harness's chat turns as one prompt text (tokenized later, with the batch), by the tokenizer's template."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Refused: a masked diffusion model has no cheap log-likelihood (use generative tasks)."""
        raise NotImplementedError(_NOT_GENERATIVE.format(what="loglikelihood (multiple-choice tasks)"))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Refused: a masked diffusion model has no cheap log-likelihood (use generative tasks)."""
        raise NotImplementedError(_NOT_GENERATIVE.format(what="loglikelihood_rolling (perplexity tasks)"))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Decode every request's context and cut the text at its first stop string."""
        from tqdm.auto import tqdm

        args = [tuple(r.args) for r in requests]
        # group requests with the same generation settings, longest first (less padding per batch)
        order = sorted(range(len(args)), key=lambda i: (self._settings_key(args[i][1]), -len(args[i][0])))
        # every group's settings first: a task whose max_gen_toks (or temperature) the method or the model's context
        # cannot take was refused only at its group's turn, after every group before it had decoded
        for gen_length, temperature in sorted({self._settings_key(a[1]) for a in args}):
            self._check_room(gen_length)
            self._config(gen_length, temperature).validate()
        out: list[str | None] = [None] * len(args)
        bar = tqdm(total=len(args), desc="hf_blockbatch", disable=disable_tqdm or self._rank != 0)
        i = 0
        while i < len(order):
            key = self._settings_key(args[order[i]][1])
            batch = [order[i]]
            while len(batch) < self.batch_size and i + len(batch) < len(order) \
                    and self._settings_key(args[order[i + len(batch)]][1]) == key:  # fmt: skip
                batch.append(order[i + len(batch)])
            texts, nfe, stats = self._generate([args[j][0] for j in batch], args[batch[0]][1])
            for j, text, n, st in zip(batch, texts, nfe, stats):
                out[j] = text
                self.records.append({"task": getattr(requests[j], "task_name", None),
                                     "doc_id": getattr(requests[j], "doc_id", None), "nfe": n, "stats": st})  # fmt: skip
                if getattr(self, "cache_hook", None) is not None:
                    self.cache_hook.add_partial("generate_until", args[j], text)
            bar.update(len(batch))
            i += len(batch)
        bar.close()
        for task, summary in self.task_summaries().items():
            logger.info("hf_blockbatch %s on %s: %d requests, mean NFE %.1f (min %d, max %d)", self.method, task,
                        summary["requests"], summary["mean_nfe"], summary["min_nfe"], summary["max_nfe"])  # fmt: skip
        return [o if o is not None else "" for o in out]

    def task_summaries(self) -> dict[str, dict[str, Any]]:
        """Per task: see :func:`task_summaries`."""
        return task_summaries(self.records)

    def get_model_info(self) -> dict[str, Any]:
        """What the harness writes into its results beside the scores: the method, its overrides, the device,
        and once requests ran their mean NFE, per-task summaries and how many prompts were cut."""
        info = {"hf_blockbatch_method": self.method, "hf_blockbatch_overrides": self.overrides,
                "hf_blockbatch_device": str(self._device)}  # fmt: skip
        if self.nfe:
            info["hf_blockbatch_mean_nfe"] = statistics.fmean(self.nfe)
            info["hf_blockbatch_tasks"] = self.task_summaries()
        if self.truncated:
            info["hf_blockbatch_truncated_prompts"] = self.truncated
        return info

    # ------------------------------------------------------------------ helpers

    def _gen_length(self, gen_kwargs: dict[str, Any]) -> int:
        if self.gen_length is not None:
            return self.gen_length
        return int(gen_kwargs.get("max_gen_toks") or gen_kwargs.get("max_new_tokens") or DEFAULT_GEN_LENGTH)

    def _settings_key(self, gen_kwargs: dict[str, Any]) -> tuple:
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0) if gen_kwargs.get("do_sample", True) else 0.0
        return self._gen_length(gen_kwargs), temperature

    def _config(self, gen_length: int, temperature: float) -> Any:
        """The method's config for a group of requests: its generation length and its temperature (sampling when
        above 0)."""
        cfg = build_method_configs([self.method], gen_length, self.overrides)[self.method]
        cfg.temperature = temperature
        cfg.follow_temperature()  # sampling when > 0: the method's config is greedy (do_sample False) by default
        return cfg

    def _check_room(self, gen_length: int) -> None:
        """Refuse a generation length that leaves no position of the model's context for a prompt."""
        limit = getattr(self.model.config, "context_length", None)
        if limit and limit - gen_length < 1:
            raise ValueError(
                f"gen_length {gen_length} leaves no room for a prompt in the model's context of {limit} positions: "
                "lower gen_length (model_args) or the task's max_gen_toks."
            )

    def _fit_context(self, ids: torch.Tensor, mask: torch.Tensor, gen_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut prompts longer than the context minus ``gen_length`` from the left, with a warning, as
        the harness's ``hf`` model does (the few-shot examples come first, the question last)."""
        limit = getattr(self.model.config, "context_length", None)
        if not limit or ids.shape[1] + gen_length <= limit:
            return ids, mask
        self._check_room(gen_length)
        keep = limit - gen_length
        lengths = mask.sum(1)
        cut = int((lengths > keep).sum())
        if cut:
            self.truncated += cut
            logger.warning("Left truncation applied: %d prompt(s) of up to %d tokens cut to their last %d so that "
                           "%d new tokens fit the context of %d; some content is lost.", cut, int(lengths.max()), keep,
                           gen_length, limit)  # fmt: skip
        return ids[:, -keep:], mask[:, -keep:]

    def _generate(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> tuple[list[str], list[int], list[dict]]:
        gen_length, temperature = self._settings_key(gen_kwargs)
        cfg = self._config(gen_length, temperature)
        bos = getattr(self.tokenizer, "bos_token", None)
        # a context rendered by a chat template already starts with BOS; a raw one gets it added
        add_special = not (bos and all(c.startswith(bos) for c in contexts))
        enc = self.tokenizer(contexts, add_special_tokens=add_special, return_tensors="pt", padding=True)
        ids, mask = self._fit_context(enc.input_ids.to(self._device), enc.attention_mask.to(self._device), gen_length)
        t0 = time.perf_counter()
        with torch.inference_mode():
            result = self.model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
        self.seconds += time.perf_counter() - t0
        nfe = [int(n) for n in result.nfe]
        self.nfe.extend(nfe)
        # each request's stats without the trace (large, and off here anyway); "batch": requests decoded together
        stats = [{**{k: v for k, v in st.items() if k != "trace"}, "batch": len(contexts)} for st in result.stats]
        texts = answer_texts(self.tokenizer, result.sequences[:, ids.shape[1] :], self._end_ids)
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        return [_cut(t, until) for t in texts], nfe, stats

    # ------------------------------------------------------------------ data parallel (accelerate)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The harness's data-parallel hook: ``tensor`` of every accelerate process, concatenated (one process: itself)."""
        if self._world_size == 1:
            return tensor
        from accelerate.utils import gather

        return gather(tensor.reshape(1) if tensor.dim() == 0 else tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """The harness's data-parallel hook: ``obj`` of every accelerate process, in rank order."""
        if self._world_size == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def barrier(self) -> None:
        """The harness's data-parallel hook: wait until every accelerate process gets here."""
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


def task_summaries(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per task (as the harness names it): requests, NFE mean / median / min / max, decoding
    seconds, and the winners' block sizes (BlockBatch)."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_task[str(r["task"])].append(r)
    out = {}
    for task, rows in by_task.items():
        nfe = [r["nfe"] for r in rows]
        winners: dict[str, int] = defaultdict(int)
        for r in rows:
            if r["stats"].get("winner_block_size") is not None:
                winners[str(r["stats"]["winner_block_size"])] += 1
        out[task] = {"requests": len(rows), "mean_nfe": statistics.fmean(nfe), "median_nfe": statistics.median(nfe),
                     "min_nfe": min(nfe), "max_nfe": max(nfe),
                     "seconds": sum(float(r["stats"].get("seconds", 0.0)) / r["stats"].get("batch", 1) for r in rows),
                     "winner_block_sizes": dict(winners)}  # fmt: skip
    return out


def _every_process_runs(runs: list[tuple[list[dict[str, Any]], str]]) -> list[tuple[list[dict[str, Any]], str]]:
    """Every process's decoding records (a collective: every process calls it). Process 0 alone annotated the
    results with its own share, so its NFE figures covered 1/N of the requests."""
    if shard_info().world_size == 1:
        return runs
    from accelerate.utils import gather_object

    return [(list(records), device) for records, device in gather_object(list(runs))]


def annotate_results(results: dict[str, Any] | None, lm: HFBlockBatchLM | None = None) -> dict[str, Any] | None:
    """Add to an lm-eval results dict what the harness cannot know about our decoding.

    * ``results["results"][task]["mean_nfe,none"]``: the task's mean NFE (so the printed table and
      the results JSON show it beside the task's metrics); the other statistics per task are in
      ``results["config"]["hf_blockbatch_tasks"]``;
    * each logged sample (``log_samples=True``): ``"hf_blockbatch": [{"nfe", "stats"}]``, one per
      request of the document, in the order of its ``resps``;
    * ``results["config"]["device"]``: where the model ran (the harness records what it passed).

    ``lm``: the adapter that decoded (default: those created since the last call, as the harness
    builds its own from ``model="hf_blockbatch"``); an adapter given as ``lm`` is not read again by a later call
    without it. Under data parallelism (several processes) every process must call it: each decoded its share of the
    requests, and process 0, which holds the harness's results, gathers them all (other processes get ``None`` back).
    """
    if lm is None:
        runs = list(_RUNS)
        _RUNS.clear()
    else:  # annotated: it is no longer one of the adapters a later call without lm reads (nor kept for ever)
        runs = [(lm.records, str(lm._device))]
        _RUNS[:] = [run for run in _RUNS if run[0] is not lm.records]
    runs = _every_process_runs(runs)
    if results is None:
        return None
    records: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for run_records, _ in runs:
        for r in run_records:
            records[(str(r["task"]), r["doc_id"])].append({"nfe": r["nfe"], "stats": r["stats"]})
    tasks = task_summaries([r for run_records, _ in runs for r in run_records])
    if not tasks:
        return results
    for task, summary in tasks.items():
        if task in results.get("results", {}):
            results["results"][task]["mean_nfe,none"] = summary["mean_nfe"]
            results["results"][task]["mean_nfe_stderr,none"] = "N/A"
    config = results.setdefault("config", {})
    config["hf_blockbatch_tasks"] = tasks
    if len({device for _, device in runs}) == 1:
        config["device"] = runs[0][1]
    for task, samples in (results.get("samples") or {}).items():
        for sample in samples:
            found = records.get((task, sample.get("doc_id")))
            if found is not None:
                sample["hf_blockbatch"] = found
    return results


def main(argv: list[str] | None = None) -> None:
    """Run lm-evaluation-harness's command line with ``hf_blockbatch`` registered, and every run's
    results annotated by :func:`annotate_results` before the harness prints and saves them."""
    if not HAVE_LM_EVAL:
        raise SystemExit("lm-evaluation-harness is not installed: pip install 'hf-blockbatch[lmeval]'")
    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    # The harness's command line looks simple_evaluate up on the package when it runs; wrapping it
    # there (for this call only) is the one place between decoding and printing/saving the results.
    # (older versions call it as lm_eval.evaluator.simple_evaluate: both names are wrapped)
    import lm_eval.evaluator

    original = lm_eval.evaluator.simple_evaluate
    package_had = vars(lm_eval).get("simple_evaluate")

    def simple_evaluate(*args: Any, **kwargs: Any) -> dict[str, Any] | None:
        return annotate_results(original(*args, **kwargs))

    lm_eval.simple_evaluate = lm_eval.evaluator.simple_evaluate = simple_evaluate
    _RUNS.clear()
    try:
        cli_evaluate()
    finally:
        lm_eval.evaluator.simple_evaluate = original
        if package_had is None:
            del lm_eval.simple_evaluate  # the package resolves the name lazily again
        else:
            lm_eval.simple_evaluate = package_had


if __name__ == "__main__":
    main()
