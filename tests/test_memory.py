"""An out-of-memory K/V allocation says what the cache needed and what to change (generation/memory.py),
and stays the error type that code catching out-of-memory errors recognises."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb
from hf_blockbatch import cache as cache_module
from hf_blockbatch.generation import memory
from hf_blockbatch.generation.plans import plan_from_config

CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)")  # fmt: skip


def _refuse(error: BaseException):
    def take(self, numel, dtype):
        raise error

    return take


@pytest.mark.parametrize("make", [make_tiny_llada, make_tiny_dream], ids=["llada", "dream"])
def test_bytes_per_row_are_the_cache_s_own(make):
    """The figure the message gives is what a decode's cache holds: rows × bytes per row."""
    model = make()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    seen = []
    original = cache_module.BranchCache.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.num_rows, self.length, self.nbytes()))  # as built: finished rows are dropped later

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache_module.BranchCache, "__init__", spy)
        model.generate(ids, generation_config=hb.FastDLLMConfig.drafted(max_new_tokens=13, block_length=8))
    rows, length, nbytes = seen[0]
    assert rows == 2 * 4 and nbytes == rows * memory.cache_bytes_per_row(model, length)


@pytest.mark.parametrize("cfg,rows,advice", [
    (hb.FastDLLMConfig.drafted(max_new_tokens=16), 4, "fewer draft rows (lookahead=1 keeps 2 rows a request"),
    (hb.BlockBatchConfig(max_new_tokens=16), 6, "fewer block sizes (each is a row; BlockBatchConfig.lean() keeps 3)"),
    (hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[4, 8]), 2, "fewer block sizes (each is a row; "),
    (hb.FastDLLMConfig(max_new_tokens=16), 1, "a shorter canvas (max_new_tokens, or shorter prompts)."),
], ids=["drafted", "blockbatch", "two_sizes", "fast_dllm"])  # fmt: skip
def test_a_cache_too_large_for_memory_says_what_to_change(monkeypatch, cfg, rows, advice):
    model = make_tiny_llada()
    monkeypatch.setattr(cache_module._StoragePool, "take", _refuse(RuntimeError(CPU_OOM)))
    with pytest.raises(RuntimeError) as caught:
        model.generate(torch.tensor([[5, 6, 7]] * 3), generation_config=cfg)
    text = str(caught.value)
    assert text.startswith(f"Out of memory for the K/V cache: 3 request(s) × {rows} cache row(s) each")
    assert "× 19 positions need " in text and " in float32 on cpu, " in text and advice in text
    assert text.endswith(f"(the allocator: {CPU_OOM})") and "\n" not in text
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_error_stays_an_out_of_memory_error(monkeypatch):
    """``torch.OutOfMemoryError`` (a GPU's) stays one, and accelerate's batch-size finder still reads both
    kinds as out of memory: it matches the allocator's words in a one-argument RuntimeError."""
    from accelerate.utils.memory import should_reduce_batch_size

    model = make_tiny_llada()
    cfg = hb.FastDLLMConfig(max_new_tokens=8)
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB."), RuntimeError(CPU_OOM)):
        monkeypatch.setattr(cache_module._StoragePool, "take", _refuse(error))
        with pytest.raises(type(error)) as caught:
            model.generate(torch.tensor([[5, 6, 7]]), generation_config=cfg)
        assert type(caught.value) is type(error) and str(caught.value).startswith("Out of memory for the K/V cache")
        assert should_reduce_batch_size(caught.value)


def test_other_allocation_errors_pass_unchanged(monkeypatch):
    model = make_tiny_llada()
    monkeypatch.setattr(cache_module._StoragePool, "take", _refuse(RuntimeError("something else went wrong")))
    with pytest.raises(RuntimeError, match="^something else went wrong$"):
        model.generate(torch.tensor([[5, 6, 7]]), generation_config=hb.FastDLLMConfig(max_new_tokens=8))


def test_on_a_gpu_it_says_how_many_requests_fit(monkeypatch):
    """On CUDA the message adds the free memory and how many requests of this size it holds, and suggests
    bfloat16 for a float32 model (the device is faked: no GPU is needed to check the text)."""
    model = make_tiny_llada()
    per_request = 4 * memory.cache_bytes_per_row(model, 40)
    monkeypatch.setattr(model, "_placement", lambda: (torch.device("cuda", 0), torch.float32))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * per_request + 1, 10 * per_request))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    monkeypatch.setattr(model, "new_cache", oom)
    plan = plan_from_config(hb.FastDLLMConfig.drafted(max_new_tokens=16), [model.config.eos_token_id], [])
    with pytest.raises(torch.OutOfMemoryError) as caught:
        memory.new_cache(model, 4 * 5, 40, torch.ones(20, 40, dtype=torch.bool), plan, requests=5)
    text = str(caught.value)
    assert "5 request(s) × 4 cache row(s) each" in text and " on cuda:0, " in text
    assert "is free there: 3 request(s) of this size fit." in text
    assert "the model in bfloat16 (torch_dtype=torch.bfloat16), which halves the cache" in text


def test_an_explained_error_is_not_explained_again():
    """An error already explained (its message starts "Out of memory") comes back as it is, not wrapped in a second
    explanation around the first."""
    model = make_tiny_llada()
    plan = plan_from_config(hb.FastDLLMConfig(max_new_tokens=16), [model.config.eos_token_id], [])
    raw = RuntimeError(CPU_OOM)
    once = memory.explain_decode_error(raw, model, plan, requests=3, num_rows=3, length=19, in_forward=True)
    assert once is not raw and str(once).startswith("Out of memory in a model forward, decoding 3 request(s) × 1 row(s)")
    assert memory.explain_decode_error(once, model, plan, requests=3, num_rows=3, length=19, in_forward=False) is once


@pytest.mark.parametrize("where", ["cache", "forward"])
def test_a_contract_only_model_keeps_its_out_of_memory_error(where):
    """A model given ``generate`` by ``hb.enable`` need not say what its cache holds (``_placement``,
    ``config.kv_geometry``): its out-of-memory error comes back as it was, not replaced by an AttributeError that
    accelerate's batch-size finder and the bench's halving do not read as out of memory."""
    from test_generation import _ContractOnly

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 134.00 GiB.")

    class Fails(_ContractOnly):
        def new_cache(self, *args, **kwargs):
            if where == "cache":
                raise error
            return super().new_cache(*args, **kwargs)

        def forward_windows(self, *args, **kwargs):
            raise error

    model = hb.enable(Fails(make_tiny_llada()))
    with pytest.raises(torch.OutOfMemoryError) as caught:
        model.generate(torch.tensor([[5, 6, 7]]), generation_config=hb.FastDLLMConfig(max_new_tokens=8))
    assert caught.value is error


def _fails_on_call(fn, n: int, error: BaseException):
    """``fn``, except that its ``n``-th call raises ``error``."""
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return fn(*args, **kwargs)

    return call


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB."),
                                   RuntimeError(CPU_OOM)], ids=["cuda", "cpu"])  # fmt: skip
def test_a_forward_out_of_memory_says_what_the_decode_holds(monkeypatch, error):
    """A forward that runs out of memory after the cache was built (here the second sparse step's) raises the same
    type, saying it was a forward, what the decode's cache holds and what shrinks it, with the allocator's words:
    the bench's halving and accelerate's batch-size finder still read it as out of memory."""
    from accelerate.utils.memory import should_reduce_batch_size

    model = make_tiny_llada()
    monkeypatch.setattr(model, "forward_positions", _fails_on_call(model.forward_positions, 2, error))
    with pytest.raises(type(error)) as caught:
        model.generate(torch.tensor([[5, 6, 7]] * 3), generation_config=hb.FastDLLMConfig.drafted(max_new_tokens=16))
    text, per_request = str(caught.value), 4 * memory.cache_bytes_per_row(model, 19)
    assert type(caught.value) is type(error) and caught.value.__cause__ is error and "\n" not in text
    assert text.startswith("Out of memory in a model forward, decoding 3 request(s) × 4 row(s) each (a main row and 3 "
                           f"draft rows: lookahead=3) × 19 positions, whose K/V cache holds {3 * per_request / 2**20:.1f} "
                           f"MiB in float32 on cpu, {per_request / 2**20:.1f} MiB a request. To fit: a smaller batch")  # fmt: skip
    assert "fewer draft rows (lookahead=1" in text and text.endswith(f"(the allocator: {error})")
    assert memory.is_out_of_memory(caught.value) and should_reduce_batch_size(caught.value)


def test_out_of_memory_between_forwards_and_without_a_cache(monkeypatch):
    """Out of memory in the policy (the proposals over the vocabulary) says so; a decode without a K/V cache (vanilla)
    names no cache; an error that is not out of memory, in a forward, passes unchanged."""
    from hf_blockbatch.generation import sampling

    model = make_tiny_llada()
    ids = torch.tensor([[5, 6, 7]] * 2)
    with monkeypatch.context() as mp:
        mp.setattr(sampling, "_propose_rows", _fails_on_call(sampling._propose_rows, 3, RuntimeError(CPU_OOM)))
        with pytest.raises(RuntimeError, match=r"^Out of memory in the decoding policy between forwards \(proposals"):
            model.generate(ids, generation_config=hb.BlockBatchConfig(max_new_tokens=16))
    with monkeypatch.context() as mp:
        mp.setattr(type(model), "forward", _fails_on_call(type(model).forward, 2, RuntimeError(CPU_OOM)))
        with pytest.raises(RuntimeError) as caught:
            model.generate(ids, generation_config=hb.VanillaDiffusionConfig(max_new_tokens=8))
    assert str(caught.value).startswith("Out of memory in a model forward, decoding 2 request(s) × 1 row(s) each × "
                                        "11 positions, with no K/V cache, on cpu. To fit: a smaller batch")  # fmt: skip
    boom = RuntimeError("shapes do not match")
    monkeypatch.setattr(model, "forward_positions", _fails_on_call(model.forward_positions, 1, boom))
    with pytest.raises(RuntimeError) as caught:
        model.generate(ids, generation_config=hb.FastDLLMConfig.drafted(max_new_tokens=16))
    assert caught.value is boom
    monkeypatch.undo()
    assert model.generate(ids, generation_config=hb.FastDLLMConfig.drafted(max_new_tokens=16)).shape == (2, 19)


@pytest.mark.parametrize("cfg", [
    hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=12, block_length=4),
    hb.BlockBatchConfig(max_new_tokens=12, block_sizes=[2, 4, 8]),
    hb.FastDLLMConfig(max_new_tokens=12, block_length=4, temperature=0.8),
], ids=["drafted", "blockbatch", "sampled"])  # fmt: skip
def test_proposals_in_row_chunks_decode_the_same(monkeypatch, cfg):
    """A decode whose logits are proposed two rows at a time (``SAMPLE_CHUNK_ELEMENTS``, which bounds the float
    copies of a real vocabulary's logits) gives the same tokens, NFE and query tokens; sampling too, with a seed."""
    from hf_blockbatch.generation import sampling

    model = make_tiny_dream()
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])

    def run():
        return model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True,
                              generator=torch.Generator().manual_seed(4))  # fmt: skip

    whole = run()
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_ELEMENTS", 2 * model.config.vocab_size)
    chunked = run()
    assert torch.equal(whole.sequences, chunked.sequences) and torch.equal(whole.nfe, chunked.nfe)
    assert [s["query_tokens"] for s in whole.stats] == [s["query_tokens"] for s in chunked.stats]


def test_the_sampling_memory_benchmark_reports_each_setting(monkeypatch):
    """``benchmarks/sampling_memory.py``'s measurement of one setting (run in its own process there; here in this
    one, small, with chunks of two rows): the rows a chunk holds and the figures RESULTS §37 quotes, with keyed noise
    too (§39)."""
    from conftest import load_benchmark

    from hf_blockbatch.generation import sampling

    bench = load_benchmark("sampling_memory")
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_ELEMENTS", 2 * 1024)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # its own process sets one thread; this one keeps its
    chunked = bench.one(rows=8, vocab=1024, temperature=1.0, chunked=True, repeats=1)
    keyed = bench.one(rows=8, vocab=1024, temperature=1.0, chunked=True, repeats=1, keyed=True)
    whole = bench.one(rows=8, vocab=1024, temperature=1.0, chunked=False, repeats=1)  # widens the chunk to all rows
    assert (chunked["chunk_rows"], whole["chunk_rows"], sampling.SAMPLE_CHUNK_ELEMENTS) == (2, 8, 8 * 1024)
    assert chunked["logits_mb"] == 8 * 1024 * 2 / 2**20 and chunked["peak_above_logits_mb"] >= 0
    assert chunked["median_s"] > 0
    assert keyed["keyed"] and not chunked["keyed"] and keyed["chunk_rows"] == 2 and keyed["median_s"] > 0
