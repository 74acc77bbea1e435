"""Supervised fine-tuning of tiny masked-diffusion models with LLaDA's SFT objective.

Why this objective (LLaDA paper, SFT section): the prompt is never masked; every response token
is masked independently with probability ``t`` (one ``t`` per example) and the model is trained
to recover the masked tokens. The response is the target, the end-of-turn token, then EOS
padding up to a generation length: LLaDA-Instruct learns the trailing EOS this way, which is
what lets a fixed-length canvas end early. Rows of a batch are right-padded with EOS, so every
row is ``prompt + target + eot + EOS...``: all real tokens, no attention mask needed.

Deviations chosen for tiny models on a CPU, and why:

* ``t ~ U(t_min, 1)`` with a floor (default 0.1): very small ``t`` gives almost no signal per
  step.
* The loss is the plain mean cross-entropy over masked positions, without the ``1/t`` weight of
  the ELBO: at this scale the weight only adds variance.
* The generation length is drawn per batch from a range, so the model learns the EOS tail for
  every canvas length the decoders may use (72 to 96 tokens by default: the longest target is 68 tokens with its end of turn).
* Dream's logits are shifted (position ``i - 1`` predicts token ``i``); the loss aligns them.

Dropout is off unless asked for: ``--attention-dropout``, ``--residual-dropout`` and ``--embedding-dropout`` (the model
configs' own field names; LLaDA has all three, Dream attention dropout only) set the model's dropouts for the run and
are saved in its ``config.json``. As with transformers' ``from_pretrained(path, attention_dropout=...)``, a run
continued with ``init_from`` takes each one that is set and keeps the checkpoint's value for each one left unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_blockbatch.checks import check_dropout
from hf_blockbatch.training.eval_quick import decode_accuracy, masked_token_accuracy
from hf_blockbatch.training.objective import apply_noise, sft_loss
from hf_blockbatch.training.tokenizer import TINY_CONTEXT

logger = logging.getLogger(__name__)

__all__ = [
    "TrainConfig",
    "TrainingSettingsError",
    "Example",
    "build_model",
    "encode_items",
    "make_batch",
    "train",
    "main",
]


class TrainingSettingsError(ValueError):
    """A training setting that cannot work, said before (or instead of) a run."""


@dataclass
class TrainConfig:
    """Everything that determines a training run (saved next to the checkpoint)."""

    family: str = "llada"
    # model geometry
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    #: None: all heads (LLaDA), half the heads (Dream, grouped-query attention as in Qwen2)
    n_kv_heads: int | None = None
    mlp_hidden: int = 384
    max_positions: int = TINY_CONTEXT
    rope_theta: float = 10000.0
    # dropout probabilities in [0, 1), named as the model configs name them (LLaDA has the three, Dream attention
    # dropout only). None: unset, the model's own (0.0 for a fresh model, the checkpoint's with init_from)
    attention_dropout: float | None = None
    residual_dropout: float | None = None
    embedding_dropout: float | None = None
    # optimisation
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    #: 32, not 64: on two shared CPU cores a 64-row step takes ~4 s; more, smaller steps learn faster per minute
    batch_size: int = 32
    steps: int = 5000
    #: wall-clock budget in minutes (0: none); the LR schedule then follows elapsed time
    minutes: float = 0.0
    seed: int = 0
    # data
    suites: dict[str, float] = field(default_factory=lambda: {"arith": 0.5, "code": 0.25, "lists": 0.25})
    train_items_per_suite: int = 50_000
    #: generation length drawn per batch from [gen_min, gen_max] (multiples of 8)
    gen_min: int = 72
    gen_max: int = 96
    t_min: float = 0.1
    #: continue from a saved checkpoint folder (its weights; a fresh optimizer and LR schedule):
    #: how a CPU-bound run is extended in stages without losing what it learned
    init_from: str = ""
    # evaluation
    eval_every: int = 200
    log_every: int = 25
    eval_items_per_suite: int = 64
    decode_items_per_suite: int = 32
    decode_tokens_per_step: int = 4
    num_threads: int = 2

    def validate(self) -> None:
        """Refuse settings that would fail minutes into a run (or inside torch), or train nothing,
        with one line naming the option (``--option`` at the command line) and what it must be."""
        from hf_blockbatch.tasks import SUITES

        problems = []
        if self.family not in ("llada", "dream"):
            problems.append(f"family must be 'llada' or 'dream', got {self.family!r}")
        at_least = {"d_model": 1, "n_layers": 1, "n_heads": 1, "mlp_hidden": 1, "max_positions": 1, "batch_size": 1,
                    "steps": 1, "train_items_per_suite": 1, "eval_items_per_suite": 1, "eval_every": 1, "log_every": 1,
                    "decode_tokens_per_step": 1, "num_threads": 1, "warmup_steps": 0, "decode_items_per_suite": 0,
                    "gen_min": 1}  # fmt: skip
        for name, low in at_least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                problems.append(f"{name} must be an integer >= {low}, got {value!r}")
        positive = ("lr", "grad_clip", "rope_theta")
        for name in positive + ("min_lr_ratio", "weight_decay", "minutes", "t_min"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (name in positive and value == 0):
                problems.append(f"{name} must be a finite number {'> 0' if name in positive else '>= 0'}, got {value!r}")
        if isinstance(self.min_lr_ratio, (int, float)) and self.min_lr_ratio > 1:
            problems.append(f"min_lr_ratio must be at most 1 (the floor of the LR schedule), got {self.min_lr_ratio!r}")
        if isinstance(self.t_min, (int, float)) and self.t_min >= 1:
            problems.append(f"t_min must be below 1 (the noise level is drawn from [t_min, 1)), got {self.t_min!r}")
        if isinstance(self.gen_min, int) and isinstance(self.gen_max, int) and self.gen_max < self.gen_min:
            problems.append(f"gen_max ({self.gen_max}) must be >= gen_min ({self.gen_min})")
        if isinstance(self.d_model, int) and isinstance(self.n_heads, int) and self.n_heads >= 1:
            kv = self.n_kv_heads
            if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
                problems.append(f"d_model ({self.d_model}) must divide by n_heads ({self.n_heads}) into an even head dim")
            if kv is not None and (not isinstance(kv, int) or kv < 1 or self.n_heads % kv):
                problems.append(f"n_kv_heads must divide n_heads ({self.n_heads}), got {kv!r}")
        if self.family in ("llada", "dream"):
            own = _model_config_class(self.family).dropout_fields
            for name, value in _dropout_settings(self).items():
                try:
                    check_dropout(name, value)
                except ValueError as err:
                    problems.append(str(err).rstrip("."))
                else:
                    if name not in own:
                        problems.append(f"{name} is no dropout of {self.family} models (theirs: {', '.join(own)})")
        if not self.suites:
            problems.append("suites is empty: name one or more of " + ", ".join(SUITES))
        for name, weight in self.suites.items():
            if name not in SUITES:
                problems.append(f"suite {name!r} is unknown; known: {', '.join(SUITES)}")
            elif not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
                problems.append(f"suite {name!r} needs a weight > 0, got {weight!r}")
        if self.init_from and not (Path(self.init_from) / "config.json").is_file():
            problems.append(f"init_from {self.init_from!r} is not a checkpoint folder (no config.json in it)")
        if problems:
            raise TrainingSettingsError("Bad training settings: " + "; ".join(problems) + ".")


@dataclass
class Example:
    """One tokenized training pair: prompt ids (never masked) and response ids (target + eot)."""

    prompt: list[int]
    response: list[int]
    suite: str = ""


# ----------------------------------------------------------------------------- model


def _model_config_class(family: str) -> type:
    """The model config class of ``family`` (``llada`` or ``dream``)."""
    from hf_blockbatch import DreamConfig, LLaDAConfig

    return {"llada": LLaDAConfig, "dream": DreamConfig}[family]


def _dropout_settings(config: TrainConfig) -> dict[str, Any]:
    """The dropout probabilities ``config`` sets, by model config field (of either family: ``validate`` refuses one
    the family has not); the fields left at None are not in it."""
    from hf_blockbatch import DreamConfig, LLaDAConfig

    names = dict.fromkeys(LLaDAConfig.dropout_fields + DreamConfig.dropout_fields)
    return {name: value for name in names if (value := getattr(config, name)) is not None}


def build_model(config: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    """A freshly initialised model of ``config.family`` with the official config field names."""
    from hf_blockbatch import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM
    from hf_blockbatch.training.tokenizer import special_token_ids

    ids = special_token_ids(tokenizer)
    vocab = int(math.ceil(len(tokenizer) / 8) * 8)
    if config.family == "llada":
        cfg = LLaDAConfig(
            d_model=config.d_model,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads or config.n_heads,
            n_layers=config.n_layers,
            mlp_ratio=max(1, config.mlp_hidden // config.d_model),
            mlp_hidden_size=config.mlp_hidden,
            rope_theta=config.rope_theta,
            max_sequence_length=config.max_positions,
            vocab_size=vocab,
            embedding_size=vocab,
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
            bos_token_id=ids["bos"],
            mask_token_id=ids["mask"],
            eot_token_id=ids["eot"],
            **_dropout_settings(config),
        )
        return LLaDAModelLM(cfg)
    if config.family == "dream":
        cfg = DreamConfig(
            vocab_size=vocab,
            hidden_size=config.d_model,
            intermediate_size=config.mlp_hidden,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=config.n_kv_heads or max(1, config.n_heads // 2),
            max_position_embeddings=config.max_positions,
            max_window_layers=config.n_layers,
            rope_theta=config.rope_theta,
            mask_token_id=ids["mask"],
            pad_token_id=ids["pad"],
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            eot_token_id=ids["eot"],
            **_dropout_settings(config),
        )
        return DreamModel(cfg)
    raise ValueError(f"family must be 'llada' or 'dream', got {config.family!r}")


# ----------------------------------------------------------------------------- data


def encode_items(
    items: list[Any], task: Any, tokenizer: Any, eot_id: int, max_response: int
) -> list[Example]:
    """Tokenize ``items`` as chat prompt + (target, eot); drop those whose response is too long.

    ``add_special_tokens=False`` because the chat template already wrote the bos token.
    """
    prompts = [task.prompt(it, tokenizer) for it in items]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    t_ids = tokenizer([it.target for it in items], add_special_tokens=False)["input_ids"]
    out, dropped = [], 0
    for p, t in zip(p_ids, t_ids):
        resp = list(t) + [eot_id]
        if len(resp) > max_response:
            dropped += 1
            continue
        out.append(Example(list(p), resp, task.name))
    if dropped:
        logger.warning(
            "%s: dropped %d of %d items longer than %d tokens", task.name, dropped, len(items), max_response
        )
    return out


def make_batch(examples: list[Example], gen_length: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``prompt + response + EOS...`` of one common length, and the prompt mask.

    Every row is right-padded with EOS to ``max(prompt) + gen_length``; the padding belongs to
    the response (so a shorter prompt simply has a longer EOS tail). Returns ``(ids [B, L],
    is_prompt [B, L] bool)``.
    """
    P = max(len(e.prompt) for e in examples)
    L = P + gen_length
    ids = torch.full((len(examples), L), eos_id, dtype=torch.long)
    is_prompt = torch.zeros((len(examples), L), dtype=torch.bool)
    for r, e in enumerate(examples):
        if len(e.response) > gen_length:
            raise ValueError(f"response of {len(e.response)} tokens exceeds gen_length {gen_length}")
        n = len(e.prompt)
        ids[r, :n] = torch.as_tensor(e.prompt)
        ids[r, n : n + len(e.response)] = torch.as_tensor(e.response)
        is_prompt[r, :n] = True
    return ids, is_prompt


# ----------------------------------------------------------------------------- training


def _lr_factor(progress: float, step: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_ratio`` as ``progress`` goes 0 -> 1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(max(progress, 0.0), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _save_atomic(model: Any, tokenizer: Any, out_dir: Path, extra: dict[str, Any]) -> None:
    """Write the checkpoint to a temporary folder, then move its files into ``out_dir``.

    So a run killed mid-save never leaves a half-written ``model.safetensors`` behind.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "best_metrics.json").write_text(json.dumps(extra, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_unfinished_saves(out_dir: Path) -> None:
    """Remove the temporary folders of :func:`_save_atomic` that a run killed mid-save (SIGTERM, SIGKILL, a lost
    machine) left in ``out_dir`` and ``out_dir/last``: hidden, each as large as a checkpoint, and never read."""
    for folder in (out_dir, out_dir / "last"):
        for tmp in sorted(folder.glob(".ckpt-*")) if folder.is_dir() else []:
            if tmp.is_dir():
                logger.warning("removing %s, an unfinished checkpoint save of an earlier run", tmp)
                shutil.rmtree(tmp, ignore_errors=True)


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM's handler during the training steps: the same as a Ctrl-C (evaluate and save where it stopped)."""
    raise KeyboardInterrupt


def _load_data(config: TrainConfig, tokenizer: Any, eot_id: int) -> tuple[dict[str, list[Example]], dict]:
    from hf_blockbatch.tasks import get_suite

    train, test = {}, {}
    for name in config.suites:
        task = get_suite(name)
        train[name] = encode_items(
            task.items("train", config.train_items_per_suite), task, tokenizer, eot_id, config.gen_min
        )
        test[name] = task.items("test")
    return train, test


def _decode_gen_length(config: TrainConfig, task: Any) -> int:
    """The canvas the held-out decode gives ``task``: its default length, within ``[gen_min, gen_max]``."""
    return min(config.gen_max, max(config.gen_min, int(getattr(task, "default_gen_length", 128))))


def _check_context(
    config: TrainConfig,
    tokenizer: Any,
    train_data: dict[str, list[Example]],
    heldout: dict[str, list[Example]],
    test_items: dict[str, list[Any]],
    context: int,
) -> None:
    """Refuse, before any step, a canvas of the run beyond the model's ``context`` positions.

    The training rows, the held-out loss batches (test prompts, ``gen_max``) and the held-out decodes (test prompts,
    :func:`_decode_gen_length`) each need one. Test prompts can be longer than the training ones: unchecked, the
    first evaluation failed in the forward, ``eval_every`` steps into the run.
    """
    from hf_blockbatch.tasks import get_suite

    longest = max(len(e.prompt) for exs in train_data.values() for e in exs)
    canvases = [(longest + config.gen_max, "training prompt plus gen_max")]
    held = [len(e.prompt) for exs in heldout.values() for e in exs]
    if held:
        canvases.append((max(held) + config.gen_max, "held-out test prompt plus gen_max"))
    for name, items in test_items.items():
        if items := items[: config.decode_items_per_suite]:
            task = get_suite(name)
            prompts = tokenizer([task.prompt(it, tokenizer) for it in items], add_special_tokens=False)["input_ids"]
            length = _decode_gen_length(config, task)
            canvases.append((max(map(len, prompts)) + length, f"decoded {name} test prompt plus its {length} tokens"))
    size, what = max(canvases, key=lambda c: c[0])
    if size > context:
        raise TrainingSettingsError(
            f"The longest {what} is {size} tokens, beyond the model's {context} "
            # a checkpoint continued with init_from keeps its context: raising max_positions changed nothing
            + ("positions (the init_from checkpoint's): lower gen_max." if config.init_from else
               "positions: raise max_positions or lower gen_max.")
        )


def train(config: TrainConfig, out_dir: str | Path, show_progress: bool = True) -> dict[str, Any]:
    """Train one model and keep the best checkpoint (by held-out decode accuracy, then loss) in ``out_dir``.

    ``out_dir`` also receives ``train_log.jsonl`` (one JSON line per event: ``start``, ``train``, ``eval``,
    ``done``) and ``train_config.json`` (this run's settings). A run into a folder that holds an earlier run's log
    (a run continued in stages, ``init_from`` its checkpoint) adds its lines to it: each run's lines begin with its
    ``start`` line, which holds its ``date`` (UTC) and ``config``, so the runs of one log can be told apart.
    Returns the best metrics.
    """
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from hf_blockbatch.eval.script_args import folder_problem
    from hf_blockbatch.tasks import get_suite
    from hf_blockbatch.training.tokenizer import asset_dir, special_token_ids

    config.validate()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TrainingSettingsError(f"out {str(out)!r} is a file: name a folder for the checkpoints.")
    # the final weights go to out/last: a file there failed their save once every step had run
    if problem := folder_problem(out / "last"):
        raise TrainingSettingsError(f"{problem} (the final weights go there).")
    if config.decode_items_per_suite > 0:
        # a sandbox that cannot start stops the run at its first evaluation (SandboxStartError), minutes in: said first
        from hf_blockbatch.eval.runner import check_scoring

        try:
            check_scoring([get_suite(name) for name in config.suites])
        except ValueError as err:
            raise TrainingSettingsError(str(err)) from None
    out.mkdir(parents=True, exist_ok=True)
    _remove_unfinished_saves(out)
    torch.set_num_threads(config.num_threads)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    tokenizer = AutoTokenizer.from_pretrained(str(asset_dir(config.family)))
    ids = special_token_ids(tokenizer)
    if config.init_from:
        from transformers import AutoModel

        from hf_blockbatch import DreamModel, LLaDAModelLM

        model = AutoModel.from_pretrained(config.init_from, dtype=torch.float32).to(device)
        if not isinstance(model, {"llada": LLaDAModelLM, "dream": DreamModel}[config.family]):
            raise TrainingSettingsError(
                f"init_from {config.init_from!r} holds a {type(model).__name__}, not a {config.family} model: "
                f"pass the family of the checkpoint (its tokenizer and prompts are the family's)."
            )
        logger.info("continuing from %s", config.init_from)
        # a dropout set overrides the checkpoint's (saved with the new checkpoint); one left unset keeps it
        for name, value in _dropout_settings(config).items():
            setattr(model.config, name, value)
    else:
        model = build_model(config, tokenizer).to(device)
    if dropouts := {name: p for name in model.config.dropout_fields if (p := getattr(model.config, name))}:
        logger.info("training with dropout %s", dropouts)
    # saved with the checkpoint: truncation stops at its context. The model's, not max_positions: a checkpoint
    # continued with init_from keeps its own context, and the tokenizer saved beside it claimed max_positions
    tokenizer.model_max_length = model.config.context_length
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("%s: %.2fM parameters on %s", config.family, n_params / 1e6, device)

    t0 = time.time()
    train_data, test_items = _load_data(config, tokenizer, ids["eot"])
    empty = [name for name, examples in train_data.items() if not examples]
    if empty:
        raise TrainingSettingsError(
            f"No training item of {', '.join(empty)} fits gen_min={config.gen_min} tokens (its target and end of "
            "turn): raise gen_min."
        )
    suite_names = list(config.suites)
    heldout_examples = {
        name: encode_items(
            test_items[name][: config.eval_items_per_suite], get_suite(name), tokenizer, ids["eot"], config.gen_max
        )
        for name in suite_names
    }
    _check_context(config, tokenizer, train_data, heldout_examples, test_items, model.config.context_length)
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    logger.info("data ready in %.1fs: %s", time.time() - t0, {k: len(v) for k, v in train_data.items()})
    weights = torch.tensor([config.suites[s] for s in suite_names], dtype=torch.float)

    # fixed held-out batches, noised once with their own seed
    g_eval = torch.Generator().manual_seed(12345)
    heldout = []
    for name in suite_names:
        exs = heldout_examples[name]
        for i in range(0, len(exs), 32):
            b, p = make_batch(exs[i : i + 32], config.gen_max, ids["eos"])
            noisy, masked = apply_noise(b, p, ids["mask"], g_eval, t=torch.full((b.shape[0],), 0.5))
            heldout.append((noisy, b, masked))

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(config.seed)
    rng = random.Random(config.seed)
    use_amp = device.type == "cuda"
    log_f = open(out / "train_log.jsonl", "a")  # noqa: SIM115 - kept open for the whole run

    def log(rec: dict[str, Any]) -> None:
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()

    # a rerun into the folder adds to the log: its rows followed the earlier run's with nothing to tell the two apart,
    # while train_config.json holds the last run's settings only
    log({"event": "start", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
         "config": dataclasses.asdict(config)})  # fmt: skip

    best: dict[str, Any] = {}
    best_key: tuple[float, float] | None = None

    def evaluate(step: int) -> None:
        nonlocal best, best_key
        model.eval()
        te = time.time()
        rec: dict[str, Any] = {"event": "eval", "step": step, "elapsed_s": round(time.time() - t_start, 1)}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            rec.update(masked_token_accuracy(model, heldout))
            accs = []
            for name in suite_names:
                if config.decode_items_per_suite <= 0:
                    break
                task = get_suite(name)
                items = test_items[name][: config.decode_items_per_suite]
                gl = _decode_gen_length(config, task)
                acc, texts = decode_accuracy(
                    model, tokenizer, task, items, gl, ids, tokens_per_step=config.decode_tokens_per_step
                )
                rec[f"decode_acc/{name}"] = acc
                rec[f"sample/{name}"] = texts[0][:200]
                accs.append(acc)
        rec["decode_acc"] = sum(accs) / len(accs) if accs else 0.0
        rec["eval_s"] = round(time.time() - te, 1)
        key = (rec["decode_acc"], -rec["heldout_loss"])
        if best_key is None or key > best_key:
            best_key, best = key, dict(rec)
            rec["saved"] = True
            _save_atomic(
                model, tokenizer, out, {**rec, "params": n_params, "config": dataclasses.asdict(config)}
            )
        log(rec)
        logger.info("eval %s", {k: v for k, v in rec.items() if not k.startswith("sample")})
        model.train()

    model.train()
    t_start = time.time()
    budget = config.minutes * 60.0
    bar = tqdm(total=config.steps, disable=not show_progress, dynamic_ncols=True)
    step, ema = 0, None
    gen_choices = list(range(config.gen_min, config.gen_max + 1, 8))
    # a SIGTERM (``timeout``, a batch scheduler's stop, ``kill``) ended the run where it was: no evaluation of the steps
    # since the last one, no ``last`` weights, half a save left behind. During the steps it stops them as a Ctrl-C
    # does; a second one, during the final evaluation and saves, ends the process as before
    catch_term = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    on_term = signal.signal(signal.SIGTERM, _terminate_as_interrupt) if catch_term else None
    try:
        while step < config.steps:
            elapsed = time.time() - t_start
            if budget and elapsed >= budget:
                logger.info("wall-clock budget of %s min reached at step %d", config.minutes, step)
                break
            progress = max(step / config.steps, elapsed / budget if budget else 0.0)
            for group in opt.param_groups:
                group["lr"] = config.lr * _lr_factor(progress, step, config.warmup_steps, config.min_lr_ratio)
            suites = torch.multinomial(weights, config.batch_size, replacement=True, generator=g).tolist()
            batch = [rng.choice(train_data[suite_names[s]]) for s in suites]
            gen_length = rng.choice(gen_choices)
            clean, is_prompt = make_batch(batch, gen_length, ids["eos"])
            noisy, masked = apply_noise(clean, is_prompt, ids["mask"], g, config.t_min)
            clean, noisy, masked = clean.to(device), noisy.to(device), masked.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                logits = model(noisy).logits
            loss = sft_loss(logits, clean, masked, model.logit_shift)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            step += 1
            lv = loss.detach().item()
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
            if step % config.log_every == 0 or step == 1:
                log({
                    "event": "train", "step": step, "loss": lv, "loss_ema": ema, "grad_norm": float(gnorm),
                    "lr": opt.param_groups[0]["lr"], "gen_length": gen_length,
                    "elapsed_s": round(time.time() - t_start, 1),
                    "s_per_step": round((time.time() - t_start) / step, 3),
                })  # fmt: skip
            if step % config.eval_every == 0:
                evaluate(step)
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d: evaluating and saving", step)
    finally:
        if catch_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if on_term is None else on_term)
        bar.close()
    if not step:  # a budget that ended, or a Ctrl-C that came, before the first step
        logger.warning(
            "no training step ran: the checkpoint saved in %s is the starting model (%s)",
            out, f"init_from {config.init_from}" if config.init_from else "untrained",
        )
    # where it stopped, unless an evaluation there finished (one a Ctrl-C cut short runs again)
    if best_key is None or step % config.eval_every != 0:
        evaluate(step)
    # the final weights too: "best" is chosen on a few dozen decoded items, a noisy criterion,
    # while the final weights have the lowest held-out loss of a decayed schedule
    _save_atomic(model, tokenizer, out / "last", {"event": "last", "step": step, "params": n_params,
                                                  "config": dataclasses.asdict(config)})  # fmt: skip
    log({"event": "done", "step": step, "elapsed_s": round(time.time() - t_start, 1), "best": best})
    log_f.close()
    return best


def _weight(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise TrainingSettingsError(
            f"--suites takes name:weight pairs, e.g. arith:0.5,code:0.25; got the weight {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m hf_blockbatch.training.sft --family llada --out DIR --steps N [--minutes M]``."""
    from hf_blockbatch.eval.script_args import STOPPED, refused_status, stopped_status, tolerant_stdout

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--family", choices=("llada", "dream"), required=True)
    p.add_argument("--out", required=True)
    d = TrainConfig()
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("family", "suites"):
            continue
        default = getattr(d, f.name)
        # an option unset by default (None) takes the type its annotation names beside None
        typ = type(default) if default is not None else next(t for t in typing.get_args(hints[f.name]) if t is not type(None))
        p.add_argument("--" + f.name.replace("_", "-"), type=typ, default=default)
    p.add_argument("--suites", default=",".join(f"{k}:{v}" for k, v in d.suites.items()),
                   help="comma-separated name:weight")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kw = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name not in ("family", "suites")
    }
    tolerant_stdout()
    try:
        suites = {name: _weight(w) if sep else 1.0 for name, sep, w in (s.partition(":") for s in args.suites.split(",") if s)}
        best = train(TrainConfig(family=args.family, suites=suites, **kw), args.out, show_progress=not args.no_progress)
        print(json.dumps({k: v for k, v in best.items() if not k.startswith("sample")}, indent=2))
    except TrainingSettingsError as err:  # bad settings: one line that says what to change
        p.error(str(err))
    except STOPPED as err:  # a Ctrl-C while loading or during the last save (one in the steps saves and ends), | head
        sys.exit(stopped_status(err))
    except OSError as err:  # a full disk saving a checkpoint, a code sandbox that stopped starting: one line, as bench
        sys.exit(refused_status(err))


if __name__ == "__main__":
    main()
