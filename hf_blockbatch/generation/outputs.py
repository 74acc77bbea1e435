"""What ``generate(..., return_dict_in_generate=True)`` returns."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

__all__ = ["DecodeResult", "DiffusionGenerateOutput", "answer_lengths", "answer_texts", "as_token_ids", "end_token_ids"]

#: End-of-turn markers of the chat formats in use (LLaDA / Llama-3, Dream / Qwen), by text: not
#: every config names them, but an answer ends at them as it does at EOS.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>")


@dataclass
class DecodeResult:
    """What the decoding core returns for one call: sequences ``[B, L]``, NFE ``[B]``, stats per request."""

    sequences: torch.Tensor
    nfe: torch.Tensor
    stats: list[dict[str, Any]]


@dataclass
class DiffusionGenerateOutput(ModelOutput):
    """``sequences``: prompt (as given, left padding included) + new tokens, ``[B, Lp + G]``.
    ``nfe``: forward passes per request (a batched forward counts once per request it carries).
    ``stats``: per request, the winner's block size, tokens committed / merged / copied per branch,
    syncs, refreshes, the NFE split, timings (with early stop and several branches, each branch's
    ``eos_hit`` and the ``eos_probability`` that ranked it), and with ``output_trace=True`` a
    replayable trace:
    ``stats[i]["trace"]`` lists events ``{"step", "phase": "init"|"block"|"refresh"|"adopt", "branch",
    "window": [s, e], "committed": [positions], "tokens": [ids]}``, ``{"phase": "merge", "branch",
    "positions", "tokens"}`` and ``{"phase": "sync", "branch", "leader"}``; positions count from the
    start of the generated region; ``step`` is the request's NFE when the event happened. With
    ``lookahead``, each adopted draft is a sync of branch 0 to the draft's branch followed by an
    ``adopt`` commit of the tokens it gained (a chain: one pair per draft, in turn)."""

    sequences: torch.Tensor | None = None
    nfe: torch.Tensor | None = None
    stats: list[dict[str, Any]] | None = None


def end_token_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """The ids that end an answer: EOS (tokenizer's and model config's) and the end-of-turn tokens."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(model_config, "eos_token_id", None),
                  getattr(model_config, "eot_token_id", None)):  # fmt: skip
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)


def as_token_ids(value: Any, name: str = "eos_token_id") -> list[int]:
    """Token ids as a list: one id, a list, tuple or tensor of them, or ``None`` (none). A value that is no
    integer id is refused naming ``name``: ``int()`` would read ``1.5`` as 1, silently another token."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    try:  # ints and numpy / torch integer scalars; not 1.5, "1" or True
        if any(isinstance(v, bool) for v in values):
            raise TypeError
        return [operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{name} must be an integer token id (or a list of them), got {value!r}.") from None


def answer_lengths(new_tokens: torch.Tensor, end_ids: Iterable[int] | int) -> torch.Tensor:
    """``[B]`` tokens before each row's first end token (the row's length when it has none).

    A masked canvas has a fixed length: what a decoder left after the first end token (more text
    when it decodes to the end, padding or masks when it stopped early) is not part of the answer,
    as an autoregressive ``generate`` would have stopped there. Scoring it would also treat the
    strategies unequally, since they fill that region differently.
    """
    ends = as_token_ids(end_ids, "end_ids")  # one id (tokenizer.eos_token_id) or several
    is_end = torch.isin(new_tokens, torch.tensor(ends, dtype=new_tokens.dtype, device=new_tokens.device))
    if not new_tokens.shape[-1]:  # no new token (an empty slice of the sequences): empty answers, where argmax fails
        return torch.zeros(new_tokens.shape[:-1], dtype=torch.long, device=new_tokens.device)
    return torch.where(is_end.any(-1), is_end.int().argmax(-1), new_tokens.shape[-1])


def answer_texts(tokenizer: Any, new_tokens: torch.Tensor, end_ids: Iterable[int] | int) -> list[str]:
    """Each row's answer text: the new tokens before its first end token, special tokens removed. One row of new
    tokens (``out.sequences[0, prompt_length:]``) is a batch of one."""
    if isinstance(new_tokens, torch.Tensor) and new_tokens.dim() == 1:
        new_tokens = new_tokens[None]
    if not isinstance(new_tokens, torch.Tensor) or new_tokens.dim() != 2:
        shape = tuple(new_tokens.shape) if isinstance(new_tokens, torch.Tensor) else type(new_tokens).__name__
        raise ValueError(f"new_tokens must be [batch, new] token ids (out.sequences[:, prompt_length:]), got {shape}.")
    lengths = answer_lengths(new_tokens, end_ids).tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(new_tokens.tolist(), lengths)], skip_special_tokens=True)
