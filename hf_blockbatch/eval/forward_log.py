"""What each model forward of a decode carried, and the policy's tensor operations between them.

Why: NFE and query tokens per request are exact, but they do not say what one forward costs on
a machine where a forward's time is not linear in its tokens (a GPU reading 16 GB of weights per
forward is as fast with 1 query token as with 100). Pricing a decode there needs each forward's
own load: its rows, its query tokens, the slots sent through the head and the keys each row attends
to; and the decoding policy's work between forwards, which on a GPU is one kernel launch per
tensor operation. :class:`ForwardLog` records both while a model decodes, without changing what it
decodes (it only wraps the model's three forward entry points and counts torch calls outside them).

Used by ``benchmarks/policy_overhead.py`` (operations per forward) and
``benchmarks/gpu_projection.py`` (a roofline price of each forward).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from hf_blockbatch.models.base import DiffusionLMOutput, PositionOutput, WindowOutput

__all__ = ["ForwardLog", "ForwardRecord", "OpCounter", "is_sync"]

#: the model's forward entry points, and what each kind of forward is called in a record
_ENTRY_POINTS = {"forward": "full", "forward_windows": "windows", "forward_positions": "positions"}

#: metadata reads, not operations: no kernel, no allocation
_NOT_OPS = {
    "__get__",
    "size",
    "dim",
    "numel",
    "__len__",
    "stride",
    "is_contiguous",
    "data_ptr",
    "element_size",
}


#: calls that make the host wait for the device on a GPU: a value read back to the host, or an
#: output whose size depends on the data (boolean-mask indexing, ``nonzero``), or a blocking copy
#: from host memory (``torch.tensor`` of Python values onto a device). A CPU never waits, so these
#: are counted by name, as they would be met on a GPU
_SYNCS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "equal", "masked_select",
          "unique", "unique_consecutive", "argwhere", "cpu", "numpy"}  # fmt: skip
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}

#: a forward's own buckets: before and after its layers ("model"), inside them, inside the one before the last
#: ("middle", from three layers up), inside the last one, and after the last one ("head")
_FORWARD_BUCKETS = ("model", "layer", "middle", "last", "head")

#: the package's folder, and this file: a caller is the innermost frame in the first and not the second
#: (as the interpreter names them: frames carry the path the module was imported from)
_PACKAGE = str(Path(__file__).parents[1]) + os.sep
_THIS_FILE = __file__


def _caller() -> str:
    """``"generation/policies/lookahead.py:Lookahead.apply"``: the innermost function of the package
    on the stack (below this module), which a policy operation is counted against; ``"?"`` when none is."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and path != _THIS_FILE:
            code = frame.f_code
            return f"{path[len(_PACKAGE):]}:{getattr(code, 'co_qualname', code.co_name)}"
        frame = frame.f_back
    return "?"


def is_sync(func: Callable[..., Any], args: tuple, kwargs: dict | None) -> bool:
    """Whether a torch call would stop the host until the device has run everything queued before it."""
    name = getattr(func, "__name__", "")
    if name in _SYNCS:
        return True
    if name in _INDEXING and len(args) > 1:  # a boolean mask as an index: the output's size is the mask's count
        index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "repeat_interleave":  # tensor repeats: the output's size is their sum, unless given
        repeats = args[1] if len(args) > 1 else (kwargs or {}).get("repeats")
        return isinstance(repeats, torch.Tensor) and "output_size" not in (kwargs or {})
    if name == "where":  # the one-argument form is nonzero
        return len(args) == 1 and not kwargs
    return name in ("tensor", "as_tensor") and bool(args) and not isinstance(args[0], torch.Tensor)


class OpCounter(TorchFunctionMode):
    """Counts torch calls (functions and tensor methods) into ``counts[bucket]``, and those that
    would stop the host on a GPU (:func:`is_sync`) into ``syncs[bucket]``, none while ``bucket`` is
    ``None``; ``before_sync[bucket]`` holds the calls counted before that bucket's first sync (since
    the bucket was last reset): the same counts on any machine for the same code and inputs, unlike
    a time.

    With ``by_caller``, ``callers`` also counts the ``"policy"`` bucket's calls and syncs per calling
    function of the package (:func:`_caller`): which part of the policy a change should be judged by
    (a stack walk per call: for untimed passes only); and ``caller_seconds`` the wall time of those calls
    themselves (the counting's own overhead outside it): counts say where the operations are, times where
    the host's time goes, since one row copy of a K/V cache costs what tens of small operations do."""

    def __init__(self, by_caller: bool = False) -> None:
        """Empty counts and no bucket (nothing is counted until one is set); ``by_caller`` also keeps ``callers``
        and ``caller_seconds``."""
        super().__init__()
        self.bucket: str | None = None
        self.counts: dict[str, int] = {}
        self.syncs: dict[str, int] = {}
        self.before_sync: dict[str, int] = {}
        self.callers: dict[str, list[int]] | None = {} if by_caller else None
        self.caller_seconds: dict[str, float] | None = {} if by_caller else None

    def reset(self, bucket: str) -> None:
        """Start ``bucket``'s counts again from 0, and forget its first sync (a forward's buckets, at each forward)."""
        self.counts[bucket] = self.syncs[bucket] = 0
        self.before_sync.pop(bucket, None)

    def __torch_function__(
        self, func: Callable[..., Any], types: Collection[type], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """``TorchFunctionMode``'s hook, called for every torch call while the mode is entered: count it in the
        current bucket (metadata reads aside; nothing while ``bucket`` is ``None``), then run it unchanged."""
        bucket = self.bucket
        if bucket is not None and getattr(func, "__name__", "") not in _NOT_OPS:
            n = self.counts.get(bucket, 0)
            sync = is_sync(func, args, kwargs)
            if sync:
                self.syncs[bucket] = self.syncs.get(bucket, 0) + 1
                self.before_sync.setdefault(bucket, n)
            self.counts[bucket] = n + 1
            if self.callers is not None and bucket == "policy":
                caller = _caller()
                entry = self.callers.setdefault(caller, [0, 0])
                entry[0] += 1
                entry[1] += sync
                start = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                self.caller_seconds[caller] = self.caller_seconds.get(caller, 0.0) + time.perf_counter() - start
                return out
        return func(*args, **(kwargs or {}))


@dataclass
class ForwardRecord:
    """One model forward call. ``queries``: hidden states computed (positions fed through the model;
    a shifted model's window forward computes one more per row than its window); ``heads``: those
    sent through the LM head; ``keys``: per row, the keys its queries attend to (the row's real
    length); ``policy_ops``: the decoding policy's tensor operations since the previous forward
    (or since the decode began); ``model_ops`` and ``layer_ops``: the forward's own, outside and
    inside its ``layers`` decoder layers, of which ``last_layer_ops`` in the last one and
    ``middle_layer_ops`` in the one before it (from three layers up; else ``None``). A deeper model of the
    same code repeats a middle layer's operations: the first layer also builds what every layer reads, and
    the last one computes only the rows the head reads past its attention (``models.layers.keep_rows``).

    Host syncs (calls that would stop the host until the GPU has run everything queued, see
    :func:`is_sync`): ``policy_syncs`` among the policy's operations, of which the first comes after
    ``policy_overlap_ops`` of them (``None``: no sync; ``after_forward``: those operations follow a
    forward of the same decode, which they can overlap on a GPU until that first sync); ``model_syncs``
    in the forward, of which ``late_syncs`` after its decoder layers (the host then waits for the
    whole forward before it returns)."""

    kind: str  # "full" | "windows" | "positions"
    rows: int
    queries: int
    heads: int
    keys: list[int]
    row_queries: list[int]
    policy_ops: int
    model_ops: int = 0
    layer_ops: int = 0
    last_layer_ops: int = 0
    layers: int = 1
    middle_layer_ops: int | None = None
    policy_syncs: int = 0
    policy_overlap_ops: int | None = None
    after_forward: bool = False
    model_syncs: int = 0
    late_syncs: int = 0

    @property
    def query_key_pairs(self) -> int:
        """Σ over rows of queries × keys: what attention's two matrix products scale with."""
        return sum(q * k for q, k in zip(self.row_queries, self.keys))

    @property
    def serial_policy_ops(self) -> int:
        """The policy's operations from its first sync on: on a GPU, issued while the device waits."""
        overlap = self.policy_ops if self.policy_overlap_ops is None else self.policy_overlap_ops
        return self.policy_ops - overlap if self.after_forward else self.policy_ops

    def forward_ops(self, layers: int | None = None) -> int:
        """The forward's tensor operations, at ``layers`` decoder layers (``None``: as logged): the
        layers beyond the logged ones each repeat a middle one's (the last one's where fewer than three were
        logged: a few operations over, its row selection's)."""
        extra = 0 if layers is None else layers - self.layers
        repeated = self.last_layer_ops if self.middle_layer_ops is None else self.middle_layer_ops
        return self.model_ops + self.layer_ops + extra * repeated


@dataclass
class ForwardLog:
    """Records every forward of ``model`` while entered, and counts the policy's operations between
    them and the forward's own inside them. ``end_decode()`` closes one ``generate`` call: the
    operations after its last forward (the output's assembly) are kept in ``tail_ops``. Reads a few
    sizes per forward (host syncs), so a logged decode is not a timed one."""

    model: torch.nn.Module
    records: list[ForwardRecord] = field(default_factory=list)
    tail_ops: int = 0
    #: also count the policy's operations and syncs per calling function (:attr:`policy_callers`)
    by_caller: bool = False
    #: per closed decode, the K/V slots its cache held (cache rows × canvas length, padding included,
    #: the most at any forward): what a decoder keeps resident, where ``records`` say what it reads
    kv_slots: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        """The operation counter and the open decode's bookkeeping, which are state, not dataclass fields."""
        self.counter = OpCounter(self.by_caller)
        self._hooks: list = []
        self._after_forward = False  # the policy's operations now follow a forward of this decode
        self._kv_slots = 0  # the open decode's largest cache so far

    # ------------------------------------------------------------------ entering
    def __enter__(self) -> ForwardLog:
        """Wrap the model's forward entry points, hook its decoder layers and start counting, in the policy's
        bucket: the decode's operations before its first forward are the policy's."""
        m = self.model
        # what the instance itself holds under these names (accelerate's dispatch hooks set ``forward``
        # there), put back on exit; the class's methods otherwise
        self._own = {name: vars(m).get(name) for name in _ENTRY_POINTS}
        for name, kind in _ENTRY_POINTS.items():
            setattr(m, name, self._wrap(getattr(m, name), kind))
        layers = list(m._decoder_layers())
        self._layers = len(layers)
        # inside a layer its operations count apart (a deeper model repeats a middle one's); after the
        # last one, the forward's tail ("head": its syncs keep the host waiting for the whole forward)
        for i, layer in enumerate(layers):
            inside, after = ("last", "head") if i == len(layers) - 1 else ("layer", "model")
            if i == len(layers) - 2 and i > 0:
                inside = "middle"
            self._hooks.append(layer.register_forward_pre_hook(lambda *_, b=inside: self._into(b)))
            self._hooks.append(layer.register_forward_hook(lambda *_, b=after: self._into(b)))
        self.counter.__enter__()
        self.counter.bucket = "policy"
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop counting, remove the layer hooks and put the model's entry points back as they were (the
        instance's own where it had one, else the class's methods); an exception propagates."""
        self.counter.bucket = None
        self.counter.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for name, own in self._own.items():
            if own is None:
                delattr(self.model, name)  # the class's method again
            else:
                setattr(self.model, name, own)

    def _into(self, bucket: str) -> None:
        self.counter.bucket = bucket

    def end_decode(self) -> None:
        """The operations since the last forward belong to no forward: keep them apart."""
        self.tail_ops += self.counter.counts.get("policy", 0)
        self.counter.reset("policy")
        self._after_forward = False
        self.kv_slots.append(self._kv_slots)
        self._kv_slots = 0

    @property
    def policy_ops(self) -> int:
        """The policy's operations of every logged decode: between forwards, after each decode's last one
        (``tail_ops``), and since the last forward of a decode not yet closed by :meth:`end_decode`."""
        return sum(r.policy_ops for r in self.records) + self.tail_ops + self.counter.counts.get("policy", 0)

    @property
    def policy_callers(self) -> list[tuple[str, int, int]]:
        """``(caller, operations, syncs)`` of every function of the package that ran the policy's
        operations while logged (``by_caller``), most operations first; they add up to
        :attr:`policy_ops`."""
        if self.counter.callers is None:
            raise ValueError("ForwardLog(model, by_caller=True) counts the policy's operations per caller.")
        return sorted(((k, ops, syncs) for k, (ops, syncs) in self.counter.callers.items()), key=lambda c: (-c[1], c[0]))

    @property
    def policy_caller_seconds(self) -> list[tuple[str, float]]:
        """``(caller, seconds)``: the wall time of the policy's operations per function of the package
        (``by_caller``), longest first; the callers of :attr:`policy_callers`."""
        if self.counter.caller_seconds is None:
            raise ValueError("ForwardLog(model, by_caller=True) times the policy's operations per caller.")
        return sorted(self.counter.caller_seconds.items(), key=lambda c: (-c[1], c[0]))

    # ------------------------------------------------------------------ recording
    def _wrap(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            for bucket in _FORWARD_BUCKETS:
                self.counter.reset(bucket)
            self.counter.bucket = "model"
            try:
                out = fn(*args, **kwargs)
                self.counter.bucket = None
                self.records.append(self._record(kind, args, kwargs, out))
                return out
            finally:
                self.counter.reset("policy")
                self.counter.bucket, self._after_forward = "policy", True

        return call

    def _record(
        self, kind: str, args: tuple, kwargs: dict, out: DiffusionLMOutput | WindowOutput | PositionOutput | tuple
    ) -> ForwardRecord:
        c, syncs = self.counter.counts, self.counter.syncs
        ops = {
            "policy_ops": c.get("policy", 0),
            "model_ops": c["model"] + c["head"],
            "layer_ops": c["layer"] + c["middle"] + c["last"],
            "last_layer_ops": c["last"],
            "layers": self._layers,
            "middle_layer_ops": c["middle"] if self._layers >= 3 else None,
            "policy_syncs": syncs.get("policy", 0),
            "policy_overlap_ops": self.counter.before_sync.get("policy"),
            "after_forward": self._after_forward,
            "model_syncs": sum(syncs[b] for b in _FORWARD_BUCKETS),
            "late_syncs": syncs["head"],
        }
        cache = args[3] if len(args) > 3 else kwargs.get("cache")  # every entry point's fourth argument
        if cache is None and kind == "full":
            cache = kwargs.get("past_key_values")  # transformers' name for it
        if cache is not None:
            self._kv_slots = max(self._kv_slots, cache.num_rows * cache.length)
        if kind == "full":
            ids = args[0] if args else kwargs["input_ids"]
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            lengths = mask.sum(-1).tolist()
            keep = kwargs.get("logits_mask")
            heads = int(keep.sum()) if keep is not None else ids.numel()
            return ForwardRecord(kind, len(lengths), sum(lengths), heads, lengths, lengths, **ops)
        rows = kwargs.get("rows", args[4] if len(args) > 4 else None)
        key_mask = cache.key_mask if rows is None else cache.key_mask[rows]
        keys = key_mask.sum(-1).tolist()
        if kind == "windows":
            starts, ends = (torch.as_tensor(a) for a in args[1:3])
            row_queries = (ends - starts + self.model.logit_shift).tolist()
        else:  # positions: the query mask the forward used
            row_queries = out.query_mask.sum(-1).tolist()
        return ForwardRecord(kind, len(keys), sum(row_queries), out.logits.shape[0], keys, row_queries, **ops)
