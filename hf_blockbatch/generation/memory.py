"""What a decode's K/V cache costs, and an out-of-memory error that says what to change.

Why: the cache is the one allocation our decoders multiply. A request holds one cache row per
branch: ``1 + lookahead`` with draft rows (4 for ``FastDLLMConfig.drafted()``), one per block size
with BlockBatch (6 by default). At LLaDA-8B and a 1,024-position canvas a row is about 0.5 GB in
bfloat16, so a batch that fits Fast-dLLM runs out of memory with drafts, and PyTorch's own error
("CUDA out of memory. Tried to allocate 134.00 GiB") names neither the rows nor the setting that
sized them. :func:`new_cache` builds the cache as before and, when the allocation fails, raises the
same error type (so that code catching out-of-memory errors, such as accelerate's
``find_executable_batch_size``, still recognises it: the allocator's message is kept in it) with what
the cache needed, per request, and which settings shrink it. Once the cache is built, a decode that
runs out of memory later (in a forward beside the cache, or in the policy) is explained the same way by
:func:`explain_decode_error`, which the engine calls.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from hf_blockbatch.cache import BranchCache
from hf_blockbatch.generation.plans import DecodePlan

__all__ = ["cache_bytes_per_row", "explain_decode_error", "is_out_of_memory", "new_cache"]

#: the allocators' messages that mean "out of memory" (a CPU allocation raises a plain RuntimeError)
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory")
#: how an explained message starts (an error explained once is not explained again)
_PREFIX = "Out of memory"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator running out of memory (a GPU's ``torch.OutOfMemoryError``, or the CPU
    allocator's RuntimeError), ours included: the words are kept in the explained message."""
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _OUT_OF_MEMORY)


def _sizable(model: Any) -> bool:
    """Whether ``model`` says what its cache holds (ours: ``_placement`` and ``config.kv_geometry``). A model that
    only implements the forward contract (:func:`hf_blockbatch.enable`) need not: its out-of-memory error passes
    unexplained, rather than replaced by an AttributeError that no out-of-memory handler recognises."""
    config = getattr(model, "config", None)
    return callable(getattr(model, "_placement", None)) and callable(getattr(config, "kv_geometry", None))


def cache_bytes_per_row(model: Any, length: int) -> int:
    """Bytes of K/V one cache row of ``length`` positions holds for ``model`` (all layers, keys and values): one of
    our models (``config.kv_geometry``, ``_placement``; generation never imports the model classes, hence ``Any``)."""
    g = model.config.kv_geometry()
    _, dtype = model._placement()
    return 2 * g["num_layers"] * length * g["num_kv_heads"] * g["head_dim"] * dtype.itemsize


def new_cache(model: Any, num_rows: int, length: int, attention_mask: torch.Tensor, plan: DecodePlan,
              requests: int) -> BranchCache:  # fmt: skip
    """``model.new_cache(num_rows, length, attention_mask)``; an allocation that runs out of memory is
    raised again with what the cache needed and how to make it smaller (see the module docstring)."""
    try:
        return model.new_cache(num_rows, length, attention_mask)
    except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError too
        if not is_out_of_memory(err) or not _sizable(model):
            raise
        raise _explained(err, _cache_message(model, num_rows, length, plan, requests)) from err


def explain_decode_error(err: RuntimeError, model: Any, plan: DecodePlan, requests: int, num_rows: int, length: int,
                         in_forward: bool) -> RuntimeError:  # fmt: skip
    """The error to raise for ``err``, raised while decoding once the cache was built: ``err`` itself unless it is
    an allocator out of memory; then the same type, saying where (a model forward, or the policy between them),
    what the decode's cache already holds, and the same settings that shrink it. A forward's activations are
    not what the decoders multiply, but the cache they share memory with is, and so are the rows a forward carries."""
    if not is_out_of_memory(err) or str(err).startswith(_PREFIX) or not _sizable(model):
        return err
    rows, per_request, device, dtype = _held(model, num_rows, length, requests)
    where = ("in a model forward" if in_forward
             else "in the decoding policy between forwards (proposals over the vocabulary, cache copies)")  # fmt: skip
    msg = f"{_PREFIX} {where}, decoding {requests} request(s) × {rows} row(s) each{_why(plan, rows)} × {length} positions"
    if plan.cache == "none":
        msg += f", with no K/V cache, on {device}."
    else:
        msg += f", whose K/V cache holds {_amount(per_request, requests, device, dtype)}."
    free = _free(device)
    if free is not None:
        msg += f" {_size(free)} is free there now."
    return _explained(err, msg + _fixes(plan, rows, device, dtype))


def _explained(err: RuntimeError, message: str) -> RuntimeError:
    """``err``'s type with ``message`` and the allocator's own words after it: handlers that catch out-of-memory
    errors by type (``torch.OutOfMemoryError``) or by those words (accelerate's batch-size finder) still do."""
    message += f" (the allocator: {err})"
    try:
        return type(err)(message)
    except TypeError:  # an error type that takes other arguments: its base, which every handler catches too
        return RuntimeError(message)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _why(plan: DecodePlan, rows: int) -> str:
    """Why a request holds ``rows`` cache rows under ``plan``."""
    if plan.lookahead is not None:
        return f" (a main row and {rows - 1} draft rows: lookahead={rows - 1})"
    if rows > 1:
        return f" (one per block size: {plan.block_sizes[:rows]})"
    return ""


def _fixes(plan: DecodePlan, rows: int, device: torch.device, dtype: torch.dtype) -> str:
    """`` To fit: ...``: the settings that shrink what a request holds."""
    fixes = ["a smaller batch (`bench --batch-size`)", "a shorter canvas (max_new_tokens, or shorter prompts)"]
    if plan.lookahead is not None:
        fixes.append("fewer draft rows (lookahead=1 keeps 2 rows a request, as in FastDLLMConfig.drafted(lookahead=1); "
                     "0 keeps 1)")  # fmt: skip
    elif rows > 1:
        fixes.append("fewer block sizes (each is a row; BlockBatchConfig.lean() keeps 3)")
    if device.type == "cuda" and dtype == torch.float32:
        fixes.append("the model in bfloat16 (torch_dtype=torch.bfloat16), which halves the cache")
    return " To fit: " + "; ".join(fixes) + "."


def _cache_message(model: Any, num_rows: int, length: int, plan: DecodePlan, requests: int) -> str:
    """One line: what the cache needed, per request, and the settings that shrink it."""
    rows, per_request, device, dtype = _held(model, num_rows, length, requests)
    msg = (f"{_PREFIX} for the K/V cache: {requests} request(s) × {rows} cache row(s) each{_why(plan, rows)} × "
           f"{length} positions need {_amount(per_request, requests, device, dtype)}.")  # fmt: skip
    free = _free(device)
    if free is not None:
        msg += f" {_size(free)} is free there: {math.floor(free / per_request)} request(s) of this size fit."
    return msg + _fixes(plan, rows, device, dtype)


def _held(model: Any, num_rows: int, length: int, requests: int) -> tuple[int, int, torch.device, torch.dtype]:
    """Cache rows per request, their bytes, and the cache's device and dtype."""
    rows = num_rows // max(requests, 1)
    device, dtype = model._placement()
    return rows, cache_bytes_per_row(model, length) * rows, device, dtype


def _amount(per_request: int, requests: int, device: torch.device, dtype: torch.dtype) -> str:
    return (f"{_size(per_request * requests)} in {str(dtype).removeprefix('torch.')} on {device}, "
            f"{_size(per_request)} a request")  # fmt: skip


def _free(device: torch.device) -> int | None:
    """Free memory on a CUDA device, else ``None``: a courtesy, so a failing query never hides the error."""
    if device.type != "cuda":
        return None
    with contextlib.suppress(RuntimeError):
        return torch.cuda.mem_get_info(device)[0]
    return None
