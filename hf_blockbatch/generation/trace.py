"""What a run records besides its tokens: NFE, per-request stats, the step trace, streaming.

The trace is a list of typed events per request (:class:`CommitEvent`, :class:`MergeEvent`,
:class:`SyncEvent`) that the demo and the notebooks import and replay; ``event.to_dict()`` gives
the JSON form. Positions count from the start of the generated region; ``step`` is the request's
NFE when the event happened.

NFE is counted as the paper counts it: every forward call adds one to each request it carries.
Every live request rides in every block step (a request whose rows are all done has finished), so
block steps are one host counter, copied into ``nfe_block`` when a request finishes; refreshes
carry only the due rows and are counted per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from hf_blockbatch.generation.state import DecodeState
from hf_blockbatch.generation.stop import Ending

__all__ = ["CommitEvent", "MergeEvent", "Recorder", "SyncEvent", "TraceEvent", "event_from_dict"]


@dataclass
class CommitEvent:
    """Tokens the transfer rule committed in one row's window (``phase``: init, block or refresh), or,
    with lookahead, the tokens a main row took from the draft it adopted (``phase`` adopt, after the
    :class:`SyncEvent` that names the draft)."""

    step: int
    phase: str
    branch: int
    window: list[int]  # [start, end)
    committed: list[int]
    tokens: list[int]

    def to_dict(self) -> dict[str, Any]:
        """This event as plain JSON values; :func:`event_from_dict` reads it back."""
        return asdict(self)


@dataclass
class MergeEvent:
    """Tokens a branch took from compatible branches by a confidence-gated merge."""

    step: int
    branch: int
    positions: list[int]
    tokens: list[int]
    phase: ClassVar[str] = "merge"

    def to_dict(self) -> dict[str, Any]:
        """This event as plain JSON values, with its ``phase`` (a class constant, which ``asdict`` omits);
        :func:`event_from_dict` reads it back."""
        return {"phase": self.phase, **asdict(self)}


@dataclass
class SyncEvent:
    """A lagging branch became a copy of its request's leader."""

    step: int
    branch: int
    leader: int
    phase: ClassVar[str] = "sync"

    def to_dict(self) -> dict[str, Any]:
        """This event as plain JSON values, with its ``phase`` (a class constant, which ``asdict`` omits);
        :func:`event_from_dict` reads it back."""
        return {"phase": self.phase, **asdict(self)}


TraceEvent = CommitEvent | MergeEvent | SyncEvent


#: the phases of a :class:`CommitEvent` (its ``phase`` field; merge and sync are events of their own)
COMMIT_PHASES = ("init", "block", "refresh", "adopt")


def event_from_dict(data: dict[str, Any]) -> TraceEvent:
    """The event a ``to_dict()`` came from (a trace saved as JSON). A dict without a known ``phase`` is refused:
    it raised a KeyError, and an unknown phase (a typo, another tool's event) was built into a CommitEvent."""
    if not isinstance(data, Mapping):
        raise TypeError(f"event_from_dict: data must be a dict (an event's to_dict()), got {type(data).__name__}.")
    data = dict(data)
    phase = data.pop("phase", None)
    if phase not in (*COMMIT_PHASES, "merge", "sync"):
        raise ValueError(f"event_from_dict: phase must be one of {(*COMMIT_PHASES, 'merge', 'sync')} (a to_dict() has "
                         f"it), got {phase!r}.")  # fmt: skip
    if phase == "merge":
        return MergeEvent(**data)
    if phase == "sync":
        return SyncEvent(**data)
    return CommitEvent(phase=phase, **data)


_COUNTS = ("committed", "merged", "copied", "syncs", "refreshes")


def for_streamer(tokens: torch.Tensor) -> torch.Tensor:
    """A copy of ``tokens`` on the host, made outside inference mode: the decode runs in it
    (``engine.run_plan``), and a streamer that keeps what it is given may edit it in place later or
    use it in a training step, as it can with transformers' own ``generate``; and a copy, never a
    view of the run's tensors."""
    with torch.inference_mode(False):
        return tokens.to("cpu", copy=True)


def _query_tokens(host: dict[str, list[int]], rows: list[int]) -> int:
    """Positions a request fed through the model: its rows' block steps, every full forward of a row
    (its real length; ``refreshes`` counts the initial forward too), and the initial forward once,
    since it is one forward per request whose K/V every branch shares."""
    block = sum(host["block_queries"][i] for i in rows)
    full = sum((host["refreshes"][i] - 1) * host["length"][i] for i in rows)
    return block + full + host["length"][rows[0]]


@dataclass
class Recorder:
    """NFE counters, per-request stats and the trace of one run, and its streamer."""

    num_requests: int
    device: torch.device
    gen_start: int
    strategy: str
    tracing: bool = False
    eos_rank: str | None = None
    streamer: Any = None
    stop_ids: torch.Tensor | None = None  # where a streamed answer ends
    mask_id: int = -1
    block_steps: int = 0
    streamed: int = 0
    stream_done: bool = False  # request 0's whole answer was sent
    stats: list[dict[str, Any]] = field(default_factory=list)
    trace: list[list[TraceEvent]] = field(default_factory=list)
    _uncounted: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (request, winner row, its rows)

    def __post_init__(self) -> None:
        """Per-request NFE counters (block and refresh forwards) on ``device``, and an empty stats dict and trace
        per request (any ``stats`` or ``trace`` passed in are replaced)."""
        self.nfe_block = torch.zeros(self.num_requests, dtype=torch.long, device=self.device)
        self.nfe_refresh = torch.zeros_like(self.nfe_block)
        self.stats = [{} for _ in range(self.num_requests)]
        self.trace = [[] for _ in range(self.num_requests)]

    # ------------------------------------------------------------------ NFE
    def count_refresh(self, state: DecodeState, rows: torch.Tensor) -> None:
        """One refresh forward: +1 NFE for every request with at least one row in it."""
        hit = torch.zeros_like(self.nfe_refresh, dtype=torch.bool).index_fill_(0, state.request[rows], True)
        self.nfe_refresh += hit

    def nfe(self, request: int, refreshes: int | None = None) -> int:
        """Forwards so far of a live request (``refreshes``: its refresh forwards, when the caller has read them)."""
        return 1 + self.block_steps + (int(self.nfe_refresh[request]) if refreshes is None else refreshes)

    def total_nfe(self) -> torch.Tensor:
        """``[B]`` forwards per request: the initial forward, its block steps and its refreshes."""
        return 1 + self.nfe_block + self.nfe_refresh

    # ------------------------------------------------------------------ trace
    def commit(self, state: DecodeState, rows: torch.Tensor, positions: torch.Tensor, select: torch.Tensor,
               phase: str) -> None:  # fmt: skip
        """Trace the tokens ``select`` ``[A, W]`` committed at ``positions`` of ``rows`` (a host read per row: only
        with ``output_trace``)."""
        if not self.tracing:
            return
        gs = self.gen_start
        req, br = state.request[rows].tolist(), state.branch[rows].tolist()
        ws, we = state.win_start[rows].tolist(), state.win_end[rows].tolist()
        for i, (r, b) in enumerate(zip(req, br)):
            pos = positions[i][select[i]]
            self.trace[r].append(CommitEvent(self.nfe(r), phase, b, [ws[i] - gs, we[i] - gs], (pos - gs).tolist(),
                                             state.canvas[rows[i], pos].tolist()))  # fmt: skip

    def positions(self, state: DecodeState, taken: torch.Tensor, phase: str) -> None:
        """Positions ``taken`` [R, G] by a merge."""
        if not self.tracing:
            return
        for i in taken.any(-1).nonzero().squeeze(1).tolist():
            r = int(state.request[i])
            pos = taken[i].nonzero().squeeze(1)
            self.trace[r].append(MergeEvent(self.nfe(r), int(state.branch[i]), pos.tolist(),
                                            state.canvas[i, self.gen_start + pos].tolist()))  # fmt: skip

    def sync(self, state: DecodeState, synced: torch.Tensor, leader: torch.Tensor) -> None:
        """Trace the ``[R]`` bool ``synced`` rows as copies of their ``[R]`` ``leader`` rows (callers call it only
        when tracing)."""
        for i in synced.nonzero().squeeze(1).tolist():
            r = int(state.request[i])
            self.trace[r].append(SyncEvent(self.nfe(r), int(state.branch[i]), int(state.branch[leader[i]])))

    # ------------------------------------------------------------------ stats
    def finished(self, state: DecodeState, ending: Ending) -> None:
        """Per-request stats of the requests that just ended (before their rows retire)."""
        req = ending.requests
        self.nfe_block[req] = self.block_steps
        decoded = state.decoded() if ending.decoded is None else ending.decoded
        cols = {"request": state.request, "branch": state.branch, "block": state.block, "decoded": decoded,
                # Lookahead parks its draft rows with ``pruned``: they are drafts, not pruned branches
                **({} if state.pruned is None or state.adopted is not None else {"pruned": state.pruned.long()}),
                **({} if state.adopted is None else {"adopted": state.adopted}),
                **{k: getattr(state, k) for k in _COUNTS}}  # fmt: skip
        host = dict(zip(cols, torch.stack(list(cols.values())).tolist()))
        if self.eos_rank is not None:  # what ranked the EOS hitters (stop.pick_winners)
            eos_hit, eos_prob = state.eos_hit.tolist(), state.eos_prob.tolist()
        # one read for every finished request: which, its winner, whether by EOS, its refresh forwards (its block
        # steps are the run's, just written)
        ended = torch.stack((req, ending.winners, ending.by_eos.long(), self.nfe_refresh[req])).tolist()
        wanted = set(ended[0])
        rows_of: dict[int, list[int]] = {r: [] for r in wanted}
        for i, r in enumerate(host["request"]):  # one pass over the rows, whatever finished
            if r in wanted:
                rows_of[r].append(i)
        keys = (*_COUNTS, "decoded")
        for r_i, w, e, refreshes in zip(*ended):
            rows = rows_of[r_i]
            branches = [{"block_size": host["block"][i], **{k: host[k][i] for k in keys},
                         "pruned": bool(host["pruned"][i]) if "pruned" in host else False,
                         **({"draft": host["branch"][i] > 0} if "adopted" in host else {})} for i in rows]  # fmt: skip
            if self.eos_rank is not None:
                for b, i in zip(branches, rows):
                    ranked = eos_hit[i] and self.eos_rank != "widest"  # "widest" reads no probability
                    b["eos_hit"], b["eos_probability"] = eos_hit[i], eos_prob[i] if ranked else None
            self.stats[r_i] = {
                "strategy": self.strategy,
                "winner_block_size": host["block"][w],
                "winner_branch": host["branch"][w],
                "stopped_by": "eos" if e else "complete",
                "nfe": self.nfe(r_i, refreshes),
                "nfe_block": self.block_steps,
                "nfe_refresh": refreshes,
                "syncs": sum(b["syncs"] for b in branches),
                "merged": sum(b["merged"] for b in branches),
                "pruned": sum(b["pruned"] for b in branches),
                "branches": branches,
            }
            if "adopted" in host:  # block steps the request skipped by adopting drafts (Lookahead; each adoption one)
                self.stats[r_i]["lookahead_adopted"] = sum(host["adopted"][i] for i in rows)
            if self.tracing:
                self.stats[r_i]["trace"] = self.trace[r_i]
            self._uncounted.append((r_i, w, rows))

    def fill_counts(self, state: DecodeState) -> None:
        """``nfe_authors`` (the forwards that carried the winner: its full ones and block steps) and
        ``query_tokens`` of the requests that finished since the last call, whose rows are still in
        ``state``: once before rows are dropped and once at the end, not at every finish."""
        if not self._uncounted:
            return
        cols = (state.refreshes, state.block_forwards, state.block_queries, state.attention_mask.sum(-1))
        host = dict(zip(("refreshes", "block_forwards", "block_queries", "length"), torch.stack(cols).tolist()))
        for r_i, w, rows in self._uncounted:
            self.stats[r_i]["nfe_authors"] = host["refreshes"][w] + host["block_forwards"][w]
            self.stats[r_i]["query_tokens"] = _query_tokens(host, rows)
        self._uncounted = []

    def timings(self, seconds: float, forward_seconds: float, sample_seconds: float) -> None:
        """Every request's stats get the run's wall time, and its parts in forwards and in sampling (seconds)."""
        for st in self.stats:
            st.update(seconds=seconds, forward_seconds=forward_seconds, sample_seconds=sample_seconds)

    # ------------------------------------------------------------------ streaming
    def stream(self, state: DecodeState, sequences: torch.Tensor, final: bool = False) -> None:
        """Send request 0's newly agreed left-to-right prefix to the streamer, up to its first end token; once request 0
        has finished (its rows retired or dropped), the rest of its answer at once, from ``sequences``, and nothing
        after. Before, a finished request 0's last tokens waited for the whole batch to end. ``end()`` is not called
        here: ``diffusion_generate`` calls it once, when the call ends (and when it raises)."""
        if self.streamer is None or self.stream_done:
            return
        gs = self.gen_start
        rows = None if final else ((state.request == 0) & ~state.retired).nonzero().squeeze(1)
        if rows is None or rows.numel() == 0:  # request 0's answer is in sequences
            gen = sequences[0, gs:]
            stop = torch.isin(gen, self.stop_ids) | (gen == self.mask_id)
            n = int(stop.float().argmax()) if bool(stop.any()) else gen.shape[0]
            self.stream_done = True
        else:
            gen = state.canvas[rows, gs:]
            agree = (gen != self.mask_id).all(0) & (gen == gen[:1]).all(0) & ~torch.isin(gen[0], self.stop_ids)
            n = int((~agree).float().argmax()) if bool((~agree).any()) else agree.shape[0]
            gen = gen[0]
        if n > self.streamed:
            self.streamer.put(for_streamer(gen[self.streamed : n]))
            self.streamed = n
