"""What ``generate(..., return_dict_in_generate=True)`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

__all__ = ["DiffusionGenerateOutput"]


@dataclass
class DiffusionGenerateOutput(ModelOutput):
    """``sequences``: prompt (as given, left padding included) + new tokens, ``[B, Lp + G]``.
    ``nfe``: forward passes per request (a batched forward counts once per request it carries).
    ``stats``: per request, the winner's block size, tokens committed / merged / copied per branch,
    syncs, refreshes, the NFE split, timings (with early stop and several branches, each branch's
    ``eos_hit`` and the ``eos_probability`` that ranked it), and with ``output_trace=True`` a
    replayable trace:
    ``stats[i]["trace"]`` lists events ``{"step", "phase": "init"|"block"|"refresh", "branch",
    "window": [s, e], "committed": [positions], "tokens": [ids]}``, ``{"phase": "merge", "branch",
    "positions", "tokens"}`` and ``{"phase": "sync", "branch", "leader"}``; positions count from the
    start of the generated region; ``step`` is the request's NFE when the event happened."""

    sequences: torch.Tensor | None = None
    nfe: torch.Tensor | None = None
    stats: list[dict[str, Any]] | None = None
