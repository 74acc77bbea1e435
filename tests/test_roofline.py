"""``hf_blockbatch.eval.roofline``: a forward's price at a geometry, and a logged decode's."""

from __future__ import annotations

import pytest

import hf_blockbatch as hb
from hf_blockbatch.eval.forward_log import ForwardRecord
from hf_blockbatch.eval.roofline import Geometry, Hardware, kv_residency, price, project


def test_geometries_are_the_real_models():
    llada, dream = Geometry.llada_8b(), Geometry.dream_7b()
    assert llada.body_params + 2 * llada.head_params == pytest.approx(
        8.02e9, rel=0.01
    )  # head + embedding table
    assert dream.body_params + 2 * dream.head_params == pytest.approx(7.62e9, rel=0.01)
    assert (llada.layers, llada.d_kv, dream.layers, dream.d_kv) == (
        32,
        4096,
        28,
        512,
    )  # MHA; GQA with 4 KV heads
    small = hb.LLaDAConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=3, mlp_hidden_size=96, vocab_size=50,
                           embedding_size=64)  # fmt: skip
    assert Geometry.from_config(small) == Geometry("llada", 3, 64, 32, 96, 64)
    # no mlp_hidden_size: the model's MLP is mlp_ratio x d_model wide (the geometry held None, and its prices failed)
    ratio = hb.LLaDAConfig(d_model=64, n_heads=4, n_kv_heads=4, n_layers=1, mlp_hidden_size=None, mlp_ratio=3, vocab_size=50,
                           embedding_size=64)  # fmt: skip
    assert Geometry.from_config(ratio).mlp_hidden == hb.LLaDAModelLM(ratio).model.transformer.blocks[0].ff_proj.out_features == 192
    # what the weights occupy in bf16 (the head and the untied embedding table both): 16.03 GB at LLaDA-8B
    assert llada.weight_bytes == 2 * (llada.body_params + 2 * llada.head_params) == 16_030_629_888


def test_resident_kv_per_request_and_the_batch_it_leaves_room_for():
    """A cache row of a 1024-position canvas at LLaDA-8B (32 layers of 4096-wide keys and values, bf16)
    is 0.54 GB; Dream-7B's grouped heads make it 9x smaller. Rows multiply it, and divide the batch."""
    llada, dream, hw = Geometry.llada_8b(), Geometry.dream_7b(), Hardware()
    assert llada.kv_bytes_per_token == 2 * 32 * 4096 * 2 and dream.kv_bytes_per_token == 2 * 28 * 512 * 2
    one, four = (kv_residency(r, llada, hw, 1024) for r in (1, 4))
    assert one["kv_gb_per_request"] == pytest.approx(0.537, abs=1e-3) and four["kv_gb_per_request"] == pytest.approx(
        4 * one["kv_gb_per_request"])
    room = hw.memory - llada.weight_bytes
    assert one["max_batch"] == int(room // (1024 * llada.kv_bytes_per_token)) and four["max_batch"] == int(
        room // (4 * 1024 * llada.kv_bytes_per_token))
    assert kv_residency(0, llada, hw, 1024)["max_batch"] is None  # no cache: the K/V bound no batch
    assert kv_residency(1, dream, hw, 1024)["max_batch"] > 8 * one["max_batch"]
    # a device smaller than the weights leaves room for no request: 0, not a negative batch
    assert kv_residency(1, llada, Hardware(memory=8e9), 1024)["max_batch"] == 0


def test_a_forward_costs_its_weights_read_until_its_flops_outweigh_it():
    g, hw = Geometry.llada_8b(), Hardware()
    one = ForwardRecord("windows", 1, 1, 1, [100], [1], 0)
    seconds, compute_bound = price(one, g, hw)
    weights, kv = 2 * (g.body_params + g.head_params + g.d_model), 2 * g.layers * g.d_kv * 2 * 100
    assert not compute_bound and seconds == pytest.approx((weights + kv) / (hw.bandwidth * hw.bandwidth_eff))
    # the weights' read is the same for 1 token and for 32: a batch-1 step of a few rows costs one read
    assert price(ForwardRecord("windows", 1, 32, 32, [100], [32], 0), g, hw)[0] == pytest.approx(
        seconds + 2 * 31 * g.d_model / (hw.bandwidth * hw.bandwidth_eff)
    )
    many = ForwardRecord("windows", 1, 8192, 8192, [8192], [8192], 0)
    seconds, compute_bound = price(many, g, hw)
    flops = 2 * (g.body_params + g.head_params) * 8192 + 4 * g.layers * g.d_model * 8192 * 8192
    assert compute_bound and seconds == pytest.approx(flops / (hw.flops * hw.flops_eff))
    # the head's flops go with the slots sent through it, not with every query token
    few_heads = ForwardRecord("windows", 1, 8192, 64, [8192], [8192], 0)
    flops = 2 * g.body_params * 8192 + 2 * g.head_params * 64 + 4 * g.layers * g.d_model * 8192 * 8192
    assert price(few_heads, g, hw) == (pytest.approx(flops / (hw.flops * hw.flops_eff)), True)


def test_a_decode_s_three_host_settings():
    g = Geometry.llada_8b()
    records = [ForwardRecord("full", 1, 60, 30, [60], [60], 10, model_ops=20, layer_ops=40, last_layer_ops=10, layers=4),
               ForwardRecord("positions", 3, 20, 9, [60] * 3, [10, 5, 5], 300, model_ops=25, layer_ops=48,
                             last_layer_ops=12, layers=4)]  # fmt: skip
    p = project(records, 5, g, Hardware(op_us=5.0), items=2)
    gpu = 1e3 * sum(price(r, g, Hardware())[0] for r in records) / 2
    assert p["gpu_ms_item"] == pytest.approx(gpu) and p["policy_ops_per_forward"] == (10 + 300 + 5) / 2
    assert p["policy_ms_item"] == pytest.approx(1e3 * 315 * 5e-6 / 2)
    assert p["graphed_ms_item"] == pytest.approx(p["gpu_ms_item"] + p["policy_ms_item"])
    host = [r.forward_ops(32) * 5e-6 for r in records]  # 20 + 40 + 28 * 10 = 340; 25 + 48 + 28 * 12 = 409
    assert [r.forward_ops(32) for r in records] == [340, 409]
    assert p["eager_ms_item"] == pytest.approx(
        1e3 * (sum(max(h, price(r, g, Hardware())[0]) for h, r in zip(host, records)) + 315 * 5e-6) / 2
    )
    # what the forwards carried: 60 and 20 query tokens, 1 and 3 rows; both memory-bound (about 3.9 ms each)
    assert (p["query_tokens_per_forward"], p["rows_per_forward"], p["compute_bound_share"]) == (40, 2, 0)
    assert p["forward_ops_per_forward"] == (340 + 409) / 2
    # host-bound: a forward whose operations' host time outlasts its roofline (340 and 409 operations)
    shares = [project(records, 5, g, Hardware(op_us=us))["host_bound_share"] for us in (5.0, 11.0, 20.0)]
    assert shares == [0.0, 0.5, 1.0]  # 1.7 and 2.0 ms; 3.7 and 4.5 ms; 6.8 and 8.2 ms
    free = project(records, 5, g, Hardware(op_us=0.0))  # no host time: every setting is the roofline
    assert free["eager_ms_item"] == free["graphed_ms_item"] == free["async_ms_item"] == pytest.approx(2 * gpu)


def test_the_policy_overlaps_the_forward_before_it_only_up_to_its_first_sync():
    """``async``: a forward is queued, and the policy's operations after it run on the host while the
    device computes, until the first one that reads a result back; the rest are in series. The first
    forward of a decode follows nothing it could overlap, and a forward that synced after its layers
    returns only once it is done."""
    g, hw = Geometry.llada_8b(), Hardware(op_us=5.0)
    us = 5e-6

    def rec(policy_ops: int, overlap: int | None, after: bool, late: int = 0) -> ForwardRecord:
        return ForwardRecord("positions", 1, 10, 10, [100], [10], policy_ops, policy_syncs=int(overlap is not None),
                             policy_overlap_ops=overlap, after_forward=after, late_syncs=late)  # fmt: skip

    t = price(rec(0, None, False), g, hw)[0]  # every record carries the same load
    assert 100 * us < t < 1500 * us  # a batch-1 forward at 8B: a few ms, 100 to 1500 operations' host time
    records = [rec(50, 10, False), rec(300, 100, True), rec(2000, 1500, True), rec(40, None, True)]
    p = project(records, 7, g, hw)
    expected = (50 * us  # the first forward's policy precedes it: nothing to overlap
                + max(t, 100 * us) + 200 * us  # 100 operations hide behind the first forward
                + max(t, 1500 * us) + 500 * us  # 1500 operations outlast the second forward
                + max(t, 40 * us)  # no sync at all: every operation overlaps
                + t + 7 * us)  # fmt: skip
    assert p["async_ms_item"] == pytest.approx(1e3 * expected)
    assert p["async_ms_item"] < p["graphed_ms_item"] == pytest.approx(1e3 * (4 * t + (50 + 300 + 2000 + 40 + 7) * us))
    assert p["serial_ops_per_forward"] == (50 + 200 + 500 + 0) / 4 and p["policy_syncs_per_forward"] == 0.75
    late = project([rec(50, 10, False, late=1), rec(300, 100, True)], 0, g, hw)  # the first forward syncs late
    assert late["async_ms_item"] == pytest.approx(1e3 * (50 * us + t + 300 * us + t))
    assert late["late_sync_share"] == 0.5
