"""``hf_blockbatch.eval.forward_log``: what each forward of a decode carried, and the policy's
operations between forwards."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, MASK_ID, load_benchmark, make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb
from hf_blockbatch.eval.forward_log import ForwardLog, OpCounter, is_sync


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    ids = torch.randint(5, 60, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: keys and query tokens count real positions only
    return ids.masked_fill(mask == 0, EOS_ID), mask


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_logged_decode_is_the_same_decode_and_counts_every_forward(family):
    model = make_tiny_llada() if family == "llada" else make_tiny_dream()
    ids, mask = _prompts()
    for cfg, rows_per_request in (
        (hb.FastDLLMConfig(max_new_tokens=32, block_length=16, threshold=0.05, mask_token_id=MASK_ID), 1),
        (hb.FastDLLMConfig(max_new_tokens=32, block_length=16, threshold=0.05, mask_token_id=MASK_ID,
                           window_queries="sparse", requery_radius=2, lookahead=2), 3),
        (hb.BlockBatchConfig(max_new_tokens=32, block_sizes=[8, 16], threshold=0.05, mask_token_id=MASK_ID), 2),
    ):  # fmt: skip
        plain = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
        for alone in (False, True):
            with ForwardLog(model) as log:
                rows = [slice(0, 2)] if not alone else [slice(0, 1), slice(1, 2)]
                outs = []
                for sl in rows:
                    outs.append(model.generate(ids[sl], attention_mask=mask[sl], generation_config=cfg,
                                               return_dict_in_generate=True))  # fmt: skip
                    log.end_decode()
            assert "forward" not in vars(model) and "forward_positions" not in vars(
                model
            )  # the class's methods again
            out_nfe = torch.cat([o.nfe for o in outs])
            assert torch.equal(torch.cat([o.sequences[:, -32:] for o in outs]), plain.sequences[:, -32:])
            assert torch.equal(out_nfe, plain.nfe)
            if alone:  # one request per forward: the log has exactly NFE forwards
                assert len(log.records) == int(out_nfe.sum())
            queries = sum(st["query_tokens"] for o in outs for st in o.stats)
            assert sum(r.queries for r in log.records) == queries  # Dream's windows with the slot before them
            assert all(r.policy_ops > 0 for r in log.records) and log.tail_ops > 0
            assert log.policy_ops == sum(r.policy_ops for r in log.records) + log.tail_ops
            # what each decode kept resident: its requests' cache rows (a row per branch, and per draft) × canvas
            assert log.kv_slots == [(sl.stop - sl.start) * rows_per_request * (12 + 32) for sl in rows]
            firsts = [i for i, r in enumerate(log.records) if not r.after_forward]
            assert len(firsts) == len(rows) and firsts[0] == 0  # each decode's first forward follows no forward
            for r in log.records:
                assert len(r.keys) == r.rows == len(r.row_queries) and sum(r.row_queries) == r.queries
                # the forward selects its head's rows before its layers: it never holds the host until it ends
                assert r.late_syncs == 0 and r.model_syncs > 0
                assert 0 <= r.serial_policy_ops <= r.policy_ops and (r.policy_overlap_ops is None) == (r.policy_syncs == 0)
                assert 0 < r.heads <= r.queries and max(r.keys) <= ids.shape[1] + 32
                assert min(r.keys) in (8 + 32, 12 + 32) and r.query_key_pairs >= r.queries * 40


def test_the_forward_s_own_operations_split_into_per_layer_and_the_rest():
    """A deeper model of the same code repeats a middle layer's operations: what the log scales a
    forward's host time by. Logged at two depths, the split predicts the deeper one exactly (the first
    layer builds what all read, the last computes only the head's rows past its attention)."""
    ids, mask = _prompts()
    cfg = hb.FastDLLMConfig(max_new_tokens=16, block_length=16, threshold=0.05, mask_token_id=MASK_ID)
    logs = {}
    for layers in (3, 5):
        model = make_tiny_llada(n_layers=layers)
        with ForwardLog(model) as log:
            model.generate(ids, attention_mask=mask, generation_config=cfg)
        logs[layers] = log.records
    assert len(logs[3]) == len(logs[5])  # random weights, but the same number of steps here
    for shallow, deep in zip(logs[3], logs[5]):
        assert shallow.layers == 3 and deep.layers == 5 and shallow.layer_ops > 0
        assert shallow.middle_layer_ops == deep.middle_layer_ops > 0
        assert shallow.forward_ops(5) == deep.forward_ops() and shallow.model_ops == deep.model_ops


def test_an_instance_s_own_forward_is_wrapped_and_put_back():
    """accelerate's dispatch sets ``model.forward`` on the instance: the log wraps it and restores it,
    instead of leaving the class's method in its place."""
    model = make_tiny_llada()
    calls = []
    plain = model.forward

    def own_forward(*args, **kwargs):
        calls.append(1)
        return plain(*args, **kwargs)

    model.forward = own_forward
    ids, mask = _prompts()
    cfg = hb.FastDLLMConfig(max_new_tokens=16, block_length=16, threshold=0.05, mask_token_id=MASK_ID)
    with ForwardLog(model) as log:
        model.generate(ids, attention_mask=mask, generation_config=cfg)
    assert model.forward is own_forward and len(calls) == sum(r.kind == "full" for r in log.records) > 0


def test_host_syncs_are_the_calls_that_read_the_device_back():
    """What would stop a GPU's host until the device is idle: a value read back, an output sized by
    the data, a blocking copy of host values; not the operations that only queue work."""
    x, mask, idx = torch.arange(6.0), torch.tensor([True, False] * 3), torch.tensor([0, 2])
    syncs = [(torch.Tensor.__bool__, (x[:1],)), (torch.Tensor.item, (x[:1],)), (torch.Tensor.tolist, (x,)),
             (torch.Tensor.nonzero, (x,)), (torch.equal, (x, x)), (torch.Tensor.__getitem__, (x, mask)),
             (torch.Tensor.__setitem__, (x, (mask,), 0.0)), (torch.where, (mask,)), (torch.tensor, ([1, 2],)),
             (torch.repeat_interleave, (x, torch.tensor([1] * 6)))]  # fmt: skip
    queued = [(torch.Tensor.__getitem__, (x, idx)), (torch.Tensor.__getitem__, (x, slice(1, 3))),
              (torch.where, (mask, x, x)), (torch.Tensor.sum, (x,)), (torch.Tensor.masked_fill, (x, mask, 0.0)),
              (torch.tensor, (x,)), (torch.repeat_interleave, (x, 2))]  # fmt: skip
    assert all(is_sync(f, args, {}) for f, args in syncs)
    assert not any(is_sync(f, args, {}) for f, args in queued)
    assert not is_sync(torch.repeat_interleave, (x, torch.tensor([1] * 6)), {"output_size": 6})


def test_the_overlap_ends_at_a_bucket_s_first_sync():
    """``before_sync`` (a record's ``policy_overlap_ops``) is the operations before the bucket's first sync, not its
    last; ``torch.where`` with its operands as keywords queues work like the three-argument form."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    with OpCounter() as counter:
        counter.bucket = "policy"
        y = x + 1
        y.sum().item()  # the third operation, the first sync: two before it
        y = y * 2
        y.tolist()  # the fifth, a second sync
        torch.where(mask, input=x, other=y)
        counter.bucket = None
    assert (counter.counts, counter.syncs, counter.before_sync) == ({"policy": 6}, {"policy": 2}, {"policy": 2})


def test_a_sync_after_the_last_layer_is_a_late_sync_of_the_forward():
    """What a forward does after its last decoder layer (its "head" bucket) is the forward's own: a sync there is one
    of ``model_syncs`` and a ``late_syncs`` (the host waits for the whole forward)."""
    model = make_tiny_llada()
    ids, mask = _prompts()
    cfg = hb.FastDLLMConfig(max_new_tokens=16, block_length=16, threshold=0.05, mask_token_id=MASK_ID)
    model.generate(ids, attention_mask=mask, generation_config=cfg)  # a first forward builds what later ones reuse
    with ForwardLog(model) as plain:
        model.generate(ids, attention_mask=mask, generation_config=cfg)

    def read_back(*_) -> None:  # after the log's own hook: in the head's bucket
        torch.zeros(1).item()

    with ForwardLog(model) as log:
        hook = list(model._decoder_layers())[-1].register_forward_hook(read_back)
        try:
            model.generate(ids, attention_mask=mask, generation_config=cfg)
        finally:
            hook.remove()
    assert len(log.records) == len(plain.records) > 0
    for a, b in zip(plain.records, log.records):
        assert (b.model_ops, b.model_syncs, b.late_syncs) == (a.model_ops + 2, a.model_syncs + 1, a.late_syncs + 1)


def test_the_policy_s_operations_add_up_over_decodes_closed_or_not():
    """``tail_ops`` adds every closed decode's operations after its last forward, and ``policy_ops`` counts those of
    a decode not yet closed by ``end_decode()`` too: the same decode logged once, twice, or left open."""
    model = make_tiny_llada()
    ids, mask = _prompts()
    cfg = hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.05, mask_token_id=MASK_ID)
    model.generate(ids, attention_mask=mask, generation_config=cfg)  # a first forward builds what later ones reuse
    logs = []
    for decodes, close in ((1, True), (2, True), (1, False)):
        with ForwardLog(model) as log:
            for _ in range(decodes):
                model.generate(ids, attention_mask=mask, generation_config=cfg)
                if close:
                    log.end_decode()
        logs.append(log)
    once, twice, left_open = logs
    assert twice.tail_ops == 2 * once.tail_ops > 0 and twice.policy_ops == 2 * once.policy_ops
    assert left_open.tail_ops == 0 and left_open.policy_ops == once.policy_ops


def test_the_policy_s_operations_are_counted_per_calling_function():
    """``ForwardLog(by_caller=True)`` splits the policy's operations and syncs by the package function
    that ran them: they add up to the totals, a lookahead decode names its draft policy and a plain one
    does not, and the decode is the same decode."""
    model = make_tiny_llada()
    ids, mask = _prompts()
    plain_cfg = hb.FastDLLMConfig(max_new_tokens=32, block_length=16, threshold=0.05, mask_token_id=MASK_ID)
    drafted_cfg = hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=32, block_length=16, threshold=0.05,
                                            mask_token_id=MASK_ID)  # fmt: skip
    for cfg, drafts in ((plain_cfg, False), (drafted_cfg, True)):
        alone = model.generate(ids, attention_mask=mask, generation_config=cfg)
        with ForwardLog(model, by_caller=True) as log:
            out = model.generate(ids, attention_mask=mask, generation_config=cfg)
            log.end_decode()
        assert torch.equal(out, alone)
        callers = log.policy_callers
        assert sum(ops for _, ops, _ in callers) == log.policy_ops
        # every sync is counted against a caller: those after the last forward as well as between forwards
        assert sum(syncs for *_, syncs in callers) >= sum(r.policy_syncs for r in log.records) > 0
        names = [name for name, _, _ in callers]
        assert all(ops > 0 for _, ops, _ in callers) and [c[1] for c in callers] == sorted((c[1] for c in callers), reverse=True)
        assert "generation/commit.py:write_commits" in names and "?" not in names
        assert ("generation/policies/lookahead.py:Lookahead.apply" in names) == drafts
        seconds = dict(log.policy_caller_seconds)
        assert seconds.keys() == set(names) and all(t >= 0 for t in seconds.values()) and sum(seconds.values()) > 0
    with ForwardLog(model) as log:
        pass
    with pytest.raises(ValueError, match="by_caller=True"):
        _ = log.policy_callers
    with pytest.raises(ValueError, match="by_caller=True"):
        _ = log.policy_caller_seconds


def test_the_policy_benchmark_times_a_pass_as_the_decodes_count_it():
    """``benchmarks/policy_overhead.py``'s timed pass (its warm-up passes are the same, untimed): every batch decoded
    once, the forwards' time inside the decode's, and the NFE the decodes report."""
    bench = load_benchmark("policy_overhead")
    model = make_tiny_llada()
    ids, mask = _prompts()
    cfg = hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.05, mask_token_id=MASK_ID)
    nfe = sum(int(model.generate(ids[i : i + 1], attention_mask=mask[i : i + 1], generation_config=cfg,
                                 return_dict_in_generate=True).nfe.sum()) for i in range(ids.shape[0]))  # fmt: skip
    run = bench.timed_pass(model, ids, mask, cfg, 1)
    assert run["mean_nfe"] == nfe / ids.shape[0]
    assert 0 < run["forward_seconds"] < run["decode_seconds"] <= run["wall_seconds"]
    assert 0 < run["policy_fraction"] < 1 and run["policy_fraction_without_sampling"] < run["policy_fraction"]
