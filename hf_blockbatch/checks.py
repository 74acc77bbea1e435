"""Checks of single values (numbers, counts, switches) that every layer refuses the same way, in one line naming
the field: the configs, generate's keywords, the cache, the sampler and the statistics; and the check of token ids
against a model's vocabulary, which ``generate`` and the models' own forward both make.

Why a module of its own, at the bottom: the cache and the statistics sit below the configs, and each read these
checks from the configs' module, the cache with an import inside two of its methods (a top-level one is a cycle).
The models' forward read the token-id check from the generation mixin, inside the forward, for the same reason (the
mixin is a base class of the models).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch

__all__ = ["COMPUTE_DTYPES", "check_bool", "check_device", "check_dropout", "check_not_numpy_int", "check_positive_int", "check_positive_real", "check_real", "check_token_ids", "vocabulary_size"]


def check_real(name: str, value: Any) -> float:
    """``value`` as a finite float, or a ValueError naming the field: a string (``"high"``), a bool,
    NaN or an infinity would otherwise pass or fail a range check by accident (NaN compares false
    with everything, so ``temperature=nan`` passed ``< 0`` and crashed the sampler)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def check_positive_real(name: str, value: Any) -> None:
    """A finite number above 0 (see :func:`check_real` for what is refused on the way), else a ValueError naming it."""
    if not check_real(name, value) > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")


def check_dropout(name: str, value: Any) -> float:
    """A dropout probability: a finite number in ``[0, 1)`` (see :func:`check_real`), as a float, else a ValueError
    naming the field. Above 1 failed inside torch's dropout at the first training forward; at 1 every attention
    weight and residual update is dropped, which leaves nothing to train."""
    p = check_real(name, value)
    if not 0 <= p < 1:
        raise ValueError(f"{name} must be a dropout probability in [0, 1), got {value!r}.")
    return p


def check_not_numpy_int(name: str, value: Any) -> None:
    """Refuse a NumPy (or other non-``int``) integer scalar with what to do about it. Why not take it: the configs are
    saved as JSON, which has no ``np.int64``; and "must be an integer, got np.int64(16)" contradicts itself."""
    if isinstance(value, Integral) and not isinstance(value, (int, bool)):
        raise ValueError(f"{name} must be a Python int, got {value!r} ({type(value).__name__}): convert it with int().")


def check_positive_int(name: str, value: Any) -> None:
    """A Python ``int`` of at least 1, else a ValueError naming the field: ``True``, ``2.0`` and ``np.int64(2)`` are
    refused too (the last with what to do, :func:`check_not_numpy_int`)."""
    check_not_numpy_int(name, value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def check_bool(name: str, value: Any) -> None:
    """On/off fields take True or False only: ``"false"`` (a string from a JSON file or a form) is truthy."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__}).")


def check_device(device: str | torch.device | None) -> None:
    """A device this PyTorch can use, or a one-line error (torch's own is a RuntimeError listing
    every device type it knows)."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={str(device)!r} is not a device PyTorch knows: use cpu, or cuda (cuda:0, ...).") from err
    if kind == "meta":  # exists in every PyTorch, but holds shapes only: "not available" misled
        raise ValueError("device='meta' holds no weights, so nothing could decode on it: use cpu, or cuda (cuda:0, ...).")
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if kind in available and not available[kind]:
        raise ValueError(f"device={str(device)!r} but this PyTorch sees no {kind.upper()} device: use device='cpu'.")
    if kind not in available and not getattr(getattr(torch, kind, None), "is_available", lambda: False)():
        raise ValueError(f"device={str(device)!r} is not available in this PyTorch: use cpu, or cuda (cuda:0, ...).")


#: the dtypes a model loads and computes in, and a cache holds K/V in
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def vocabulary_size(model: Any) -> int | None:
    """The embedding table's rows (else the config's vocabulary size): the ids a forward can embed."""
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a contract model without the accessor
        emb = None
    return getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None)


def check_token_ids(model: Any, input_ids: torch.Tensor) -> None:
    """Token ids outside the embedding table would fail deep in the embedding (an IndexError on CPU,
    a device-side assert on CUDA); padding positions are checked too, since they are embedded.
    One host read per call, before any forward."""
    size = vocabulary_size(model)
    if not size:
        return
    low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()
    if low < 0 or high >= size:
        bad = high if high >= size else low
        raise ValueError(
            f"input_ids holds token id {bad}, outside this model's vocabulary of {size} ids (0..{size - 1}): encode "
            "the prompt with this model's tokenizer."
        )
