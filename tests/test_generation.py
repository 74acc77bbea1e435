"""Decoding layer, end to end on tiny models: reference equality, padding, seeds, early stop,
streaming, config errors and config save/load."""

from __future__ import annotations

import functools

import pytest
import torch
from _generation_helpers import eos_model, peaked, ref_generate
from conftest import EOS_ID, MASK_ID, make_tiny_dream, make_tiny_llada
from transformers import GenerationConfig

import hf_blockbatch as hb
from hf_blockbatch.generation import (
    BlockBatchConfig,
    FastDLLMConfig,
    VanillaDiffusionConfig,
    config_from_dict,
)

FAMILIES = ["llada", "dream"]
PROMPT = [1, 2, 3, 4, 5, 6, 7]
G = 16


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return peaked(request.param)


def _gen(model, prompt, cfg, **kwargs):
    ids = torch.tensor([prompt]) if isinstance(prompt, list) else prompt
    return model.generate(ids, generation_config=cfg, return_dict_in_generate=True, **kwargs)


# ----------------------------------------------------------------------------- 1. reference equality
REFERENCE_CASES = [
    # (mode, block, rule kwargs); block 6 does not divide 16: the last block is shorter
    ("none", 4, {"threshold": 0.47}),
    ("none", 6, {"threshold": 0.47}),
    ("prefix", 4, {"threshold": 0.47}),
    ("prefix", 6, {"factor": 2.0}),
    ("dual", 4, {"threshold": 0.47}),
    ("dual", 6, {"threshold": 0.47}),
    ("dual", 16, {"threshold": 0.47}),
    ("dual", 8, {"factor": 2.0}),
    ("dual", 8, {"steps": 8, "threshold": None}),
    ("prefix", 8, {"steps": 4, "threshold": None}),
]


@pytest.mark.parametrize("mode,block,rule", REFERENCE_CASES)
def test_fast_dllm_matches_reference(model, mode, block, rule):
    ref, ref_nfe = ref_generate(model, PROMPT, G, block, mode, **rule)
    out = _gen(model, PROMPT, FastDLLMConfig(max_new_tokens=G, block_length=block, cache=mode, **rule))
    assert out.sequences[0].tolist() == ref
    assert int(out.nfe[0]) == ref_nfe == out.stats[0]["nfe"]


@pytest.mark.parametrize("steps,block", [(16, 8), (8, 16), (12, 6)])
def test_vanilla_matches_reference(model, steps, block):
    ref, ref_nfe = ref_generate(model, PROMPT, G, block, "none", steps=steps)
    out = _gen(model, PROMPT, VanillaDiffusionConfig(max_new_tokens=G, steps=steps, block_length=block))
    assert out.sequences[0].tolist() == ref
    assert int(out.nfe[0]) == ref_nfe == steps
    assert MASK_ID not in out.sequences[0].tolist()


@pytest.mark.parametrize("block,steps", [(6, 18), (5, 16), (32, 16)])
def test_vanilla_default_steps_with_a_block_that_does_not_divide(model, block, steps):
    """The default is one step per token. With G = 16 and a block of 6 (three blocks, the last of 4), 16 steps do not
    split over three blocks, and the config was refused for steps the caller never set ("steps (16) must be a
    multiple of the number of blocks"). The default is now the smallest multiple of the blocks >= G, as the bench's
    vanilla schedule (which now reads it from the config); with a block that divides, or covers, G it is G."""
    cfg = VanillaDiffusionConfig(max_new_tokens=G, block_length=block)
    assert cfg.resolved() == (steps, block)
    ref, ref_nfe = ref_generate(model, PROMPT, G, block, "none", steps=steps)
    out = _gen(model, PROMPT, cfg)
    assert out.sequences[0].tolist() == ref
    assert int(out.nfe[0]) == ref_nfe and MASK_ID not in out.sequences[0].tolist()


def test_skip_completed_block_step_saves_the_extra_forward(model):
    """With a low threshold every block-start forward completes its block: the official loop still
    runs one more forward per block; skip_completed_block_step=True does not."""
    kw = dict(max_new_tokens=G, block_length=4, cache="dual", threshold=0.01)
    official = _gen(model, PROMPT, FastDLLMConfig(**kw))
    skipped = _gen(model, PROMPT, FastDLLMConfig(skip_completed_block_step=True, **kw))
    assert official.sequences.tolist() == skipped.sequences.tolist()
    assert int(official.nfe[0]) == 2 * (G // 4)
    assert int(skipped.nfe[0]) == G // 4


# ----------------------------------------------------------------------------- 4. seeds
def test_same_seed_same_output(model):
    cfg = BlockBatchConfig(max_new_tokens=G, block_sizes=[4, 8], threshold=0.47, temperature=1.0)
    runs = [
        _gen(model, PROMPT, cfg, generator=torch.Generator().manual_seed(s)).sequences for s in (1, 1, 2, 3)
    ]
    assert torch.equal(runs[0], runs[1])
    assert not (torch.equal(runs[0], runs[2]) and torch.equal(runs[0], runs[3]))


def test_decode_runs_in_inference_mode_and_returns_ordinary_tensors(model):
    """The decode's forwards run in inference mode (cheaper small operations); what the caller gets
    back is an ordinary tensor outside it (editable in place, usable by a training step), and stays
    as it is inside it."""
    seen = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        out = _gen(model, PROMPT, FastDLLMConfig(max_new_tokens=G, block_length=8, threshold=0.47))
        with torch.inference_mode():
            inside = _gen(model, PROMPT, FastDLLMConfig(max_new_tokens=G, block_length=8, threshold=0.47))
    finally:
        hook.remove()
    assert seen and all(seen)
    assert not out.sequences.is_inference() and not out.nfe.is_inference()
    assert inside.sequences.is_inference() and torch.equal(inside.sequences, out.sequences)
    out.sequences[0, -1] = out.sequences[0, 0]  # in place, outside inference mode
    embedding = model.get_input_embeddings()
    embedding(out.sequences).float().sum().backward()  # saved for backward: an inference tensor could not be
    assert embedding.weight.grad is not None
    embedding.weight.grad = None


DEFAULT_DTYPE_CONFIGS = [
    BlockBatchConfig(max_new_tokens=G, block_sizes=[4, 8], threshold=0.47),  # the probability map
    BlockBatchConfig(max_new_tokens=G, block_sizes=[4, 8], threshold=0.47, refresh="divergence", refresh_interval=4,
                     divergence_threshold=1e-3),  # fmt: skip
    FastDLLMConfig.drafted(max_new_tokens=G, block_length=G),  # the runner-up drafts' map
    FastDLLMConfig(max_new_tokens=G, block_length=8, threshold=0.47),
]


@pytest.mark.parametrize("cfg", DEFAULT_DTYPE_CONFIGS, ids=["blockbatch", "divergence", "drafted", "fast_dllm"])
def test_the_default_dtype_does_not_change_the_decode(model, cfg):
    """``torch.set_default_dtype(torch.float64)`` (set by a user for something else) reached the decoders' float
    buffers: BlockBatch, the drafted presets and the divergence refresh failed deep in torch on a float32 model
    (``index_copy_(): ... Double and ... Float``). Every decoder now decodes the same tokens in the same forwards."""
    plain = _gen(model, PROMPT, cfg)
    torch.set_default_dtype(torch.float64)
    try:
        under = _gen(model, PROMPT, cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(under.sequences, plain.sequences) and torch.equal(under.nfe, plain.nfe)


# ----------------------------------------------------------------------------- 5. padding
PADDED_CONFIGS = [
    VanillaDiffusionConfig(max_new_tokens=G, steps=8, block_length=8),
    FastDLLMConfig(max_new_tokens=G, block_length=4, cache="none", threshold=0.47),
    FastDLLMConfig(max_new_tokens=G, block_length=6, cache="prefix", threshold=0.47),
    FastDLLMConfig(max_new_tokens=G, block_length=4, cache="dual", threshold=0.47),
    BlockBatchConfig(
        max_new_tokens=G, block_sizes=[2, 4, 8], threshold=0.47, sync_threshold=2, refresh_interval=8
    ),
    BlockBatchConfig(
        max_new_tokens=G, block_sizes=[2, 4, 8], threshold=0.47, sync_threshold=2, refresh_interval=8,
        prune_after_syncs=1, merge_agreement=1, merge_threshold=0.3, eos_prefer_widest=True,
    ),
]


@pytest.mark.parametrize("cfg", PADDED_CONFIGS, ids=lambda c: f"{c.strategy}-{getattr(c, 'cache', '')}")
def test_padded_batch_equals_alone(model, cfg):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9], [7, 9, 3, 2, 3, 8, 4, 6, 2, 6]]
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    for i, p in enumerate(prompts):
        alone = _gen(model, p, cfg)
        assert batch.sequences[i, width - len(p) :].tolist() == alone.sequences[0].tolist()
        assert batch.sequences[i, : width - len(p)].tolist() == [EOS_ID] * (width - len(p))
        assert int(batch.nfe[i]) == int(alone.nfe[0])
        assert batch.stats[i]["query_tokens"] == alone.stats[0]["query_tokens"]
        assert batch.stats[i].get("pruned") == alone.stats[0].get("pruned")


# ----------------------------------------------------------------------------- 6. early stop
@pytest.mark.parametrize("family", FAMILIES)
def test_early_stop_on_eos(family):
    m = eos_model(family)
    kw = dict(max_new_tokens=32, block_length=4, cache="dual", threshold=0.9)
    full = _gen(m, PROMPT, FastDLLMConfig(**kw))
    stopped = _gen(m, PROMPT, FastDLLMConfig(early_stop=True, **kw))
    gen = stopped.sequences[0, len(PROMPT) :].tolist()
    assert EOS_ID in gen
    assert MASK_ID not in gen
    assert stopped.stats[0]["stopped_by"] == "eos"
    assert full.stats[0]["stopped_by"] == "complete"
    assert int(stopped.nfe[0]) < int(full.nfe[0])
    # up to and including the first EOS, the stopped run agrees with the full one
    first = gen.index(EOS_ID)
    assert gen[: first + 1] == full.sequences[0, len(PROMPT) : len(PROMPT) + first + 1].tolist()
    # the block holding the first EOS is fully decoded; everything after it is padding (pad id = EOS)
    block_end = (first // 4 + 1) * 4
    assert gen[block_end:] == [EOS_ID] * (len(gen) - block_end)
    assert len(gen) - block_end >= 8  # it did stop early


# ----------------------------------------------------------------------------- 7. streaming
class RecordingStreamer:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ended == 0, "put() after end()"
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize(
    "family,cfg",
    [
        ("llada", BlockBatchConfig(max_new_tokens=G, block_sizes=[2, 4, 8], threshold=0.47)),
        ("dream", FastDLLMConfig(max_new_tokens=G, block_length=4, threshold=0.47)),
        ("llada", FastDLLMConfig(max_new_tokens=32, block_length=4, threshold=0.9, early_stop=True)),
    ],
)
def test_streamer_receives_the_generated_tokens(family, cfg):
    m = eos_model(family) if cfg.max_new_tokens == 32 else peaked(family)
    s = RecordingStreamer()
    out = _gen(m, PROMPT, cfg, streamer=s)
    gen = out.sequences[0, len(PROMPT) :].tolist()
    upto = gen[: gen.index(EOS_ID)] if EOS_ID in gen else gen
    assert s.ended == 1
    assert s.puts[0] == PROMPT  # as transformers' generate: the prompt first
    streamed = [t for chunk in s.puts[1:] for t in chunk]
    assert streamed == upto
    assert all(len(chunk) > 0 for chunk in s.puts)


def test_a_streamer_without_put_and_end_is_refused_before_any_forward():
    """An object without ``put``/``end`` failed with an AttributeError at the first agreed token."""
    m = peaked("llada")
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(TypeError, match="streamer must have put\\(token_ids\\) and end\\(\\) methods.*got object"):
        m.generate(torch.tensor([PROMPT]), streamer=object(), max_new_tokens=8)
    assert calls == []


def test_streamer_gets_ordinary_tensors_it_may_keep():
    """The decode runs in inference mode; a streamer that keeps what it is given gets ordinary host
    tensors (editable in place, as transformers' own generate gives it) that no later step of the
    run changes."""
    kept: list[torch.Tensor] = []

    class Keeping(RecordingStreamer):
        def put(self, value: torch.Tensor) -> None:
            super().put(value)
            kept.append(value)

    s = Keeping()
    _gen(peaked("llada"), PROMPT, BlockBatchConfig(max_new_tokens=G, block_sizes=[2, 4, 8], threshold=0.47), streamer=s)
    assert len(kept) > 1
    assert [t.reshape(-1).tolist() for t in kept] == s.puts  # unchanged since put
    for t in kept:
        assert not t.is_inference() and t.device.type == "cpu"
        t.add_(0)  # in place, outside inference mode


# ----------------------------------------------------------------------------- 8. errors before any forward
def _counting(model):
    calls = {"n": 0}
    fwd, win = model.forward, model.forward_windows

    def forward(*a, **k):
        calls["n"] += 1
        return fwd(*a, **k)

    def forward_windows(*a, **k):
        calls["n"] += 1
        return win(*a, **k)

    model.forward, model.forward_windows = forward, forward_windows
    return calls


BAD = [
    (lambda: BlockBatchConfig(block_sizes=[]), {}, ValueError, "block_sizes must name at least one"),
    (lambda: BlockBatchConfig(block_sizes=[4, 0]), {}, ValueError, "positive integer"),
    (lambda: BlockBatchConfig(block_sizes=[4, -8]), {}, ValueError, "positive integer"),
    (lambda: FastDLLMConfig(threshold=0), {}, ValueError, "threshold must be in (0, 1]"),
    (lambda: BlockBatchConfig(threshold=1.5), {}, ValueError, "threshold must be in (0, 1]"),
    (lambda: FastDLLMConfig(block_length=0), {}, ValueError, "block_length must be a positive integer"),
    (lambda: FastDLLMConfig(threshold=0.9, factor=1.0), {}, ValueError, "exactly one of threshold, factor"),
    (lambda: FastDLLMConfig(cache="full"), {}, ValueError, "cache must be 'none', 'prefix' or 'dual'"),
    (
        lambda: VanillaDiffusionConfig(steps=5, block_length=8, max_new_tokens=16),
        {},
        ValueError,
        "multiple of",
    ),
    (lambda: FastDLLMConfig(), {"no_such_option": 1}, TypeError, "Unknown option(s) for FastDLLMConfig: no_such_option"),
    (lambda: BlockBatchConfig(), {"block_size": 16}, TypeError, "Did you mean 'block_sizes' instead of 'block_size'?"),
    (lambda: FastDLLMConfig(), {"factor": 1.0, "threshold": 0.5}, ValueError, "exactly one of threshold, factor"),
    (lambda: GenerationConfig(max_new_tokens=8), {}, TypeError, "FastDLLMConfig or BlockBatchConfig"),
    (lambda: FastDLLMConfig(temperature=-1.0), {}, ValueError, "temperature must be >= 0"),
    (lambda: BlockBatchConfig(eos_confidence="max"), {}, ValueError, "eos_confidence must be 'completion' or 'commit'"),
    # options that would be ignored: a misspelt one, and standard fields with no meaning here
    (lambda: BlockBatchConfig(block_size=32), {}, TypeError, "Did you mean 'block_sizes' instead of 'block_size'?"),
    (lambda: FastDLLMConfig(treshold=0.5), {}, TypeError, "Did you mean 'threshold'"),
    (lambda: BlockBatchConfig(top_p=0.9), {}, ValueError, "does not use top_p=0.9: sampling is Gumbel-max"),
    (lambda: FastDLLMConfig(), {"top_k": 5}, ValueError, "does not use top_k=5"),
    (lambda: FastDLLMConfig(max_length=40), {}, ValueError, "set max_new_tokens (max_length minus the prompt"),
    (lambda: FastDLLMConfig(max_length=20), {}, ValueError, "max_length=20"),  # transformers' fill-in value acts too
    (lambda: BlockBatchConfig(temperature=0.5), {"top_k": 50}, ValueError, "does not use top_k=50"),
    (lambda: VanillaDiffusionConfig(num_beams=4, repetition_penalty=1.2), {}, ValueError, "repetition_penalty=1.2. Remove them."),
    (lambda: FastDLLMConfig(do_sample=True), {}, ValueError, "do_sample=True samples at `temperature`, which is 0"),
    (lambda: FastDLLMConfig(temperature=0.5), {"do_sample": False}, ValueError, "set temperature=0, or do_sample=True"),
    (lambda: BlockBatchConfig(num_return_sequences=2), {}, ValueError, "greedy decoding would return identical copies"),
    (lambda: BlockBatchConfig(temperature=0.5, num_return_sequences=0), {}, ValueError, "num_return_sequences must be"),
    # beyond the paper (issue 16)
    (lambda: BlockBatchConfig(prune_after_syncs=0), {}, ValueError, "prune_after_syncs must be a positive integer"),
    (lambda: BlockBatchConfig(prune_after_syncs=1.5), {}, ValueError, "prune_after_syncs must be a positive integer"),
    (lambda: BlockBatchConfig(prune_after_syncs=True), {}, ValueError, "prune_after_syncs must be a positive integer"),
    (lambda: BlockBatchConfig(prune_after_syncs=2, sync=False), {}, ValueError, "it needs sync=True"),
    (lambda: BlockBatchConfig(prune_after_syncs=2, block_sizes=[8]), {}, ValueError, "at least two block_sizes"),
    (lambda: BlockBatchConfig(merge_agreement=-1), {}, ValueError, "merge_agreement must be an integer >= 0"),
    (lambda: BlockBatchConfig(merge_agreement=1.0), {}, ValueError, "merge_agreement must be an integer >= 0"),
    (lambda: BlockBatchConfig(merge_agreement=1, merge=False), {}, ValueError, "it needs merge=True"),
    (lambda: BlockBatchConfig(merge_source_confidence=1.5), {}, ValueError, "merge_source_confidence must be in (0, 1]"),
    (lambda: BlockBatchConfig(merge_source_confidence="high"), {}, ValueError, "merge_source_confidence must be a number"),
    (lambda: BlockBatchConfig(merge_source_confidence=0.9, merge=False), {}, ValueError, "it needs merge=True"),
    (lambda: BlockBatchConfig(), {"prune_after_sync": 2}, TypeError, "Did you mean 'prune_after_syncs'"),
    (lambda: BlockBatchConfig(eos_prefer_widest=1), {}, ValueError, "eos_prefer_widest must be True or False"),
    (lambda: BlockBatchConfig(eos_prefer_widest=True, early_stop=False), {}, ValueError, "it needs early_stop=True"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(FastDLLMConfig, {"factor": 1.0}), (FastDLLMConfig, {"steps": 8}), (BlockBatchConfig, {"factor": 1.0}),
     (BlockBatchConfig, {"block_sizes": (4, 16)}), (BlockBatchConfig, {"block_sizes": 8})],
)
def test_generate_options_choose_the_rule_as_the_constructor_does(cls, kwargs):
    """``generate(factor=...)`` drops the default threshold, as ``FastDLLMConfig(factor=...)`` does; and
    ``generate(block_sizes=(4, 16))`` or ``block_sizes=8`` names the branches as the constructor does (a tuple
    or one size was refused as not a list)."""
    m, cfg = make_tiny_llada(), cls(max_new_tokens=16)
    out = m.generate(torch.tensor([PROMPT]), generation_config=cfg, return_dict_in_generate=True, **kwargs)
    direct = m.generate(torch.tensor([PROMPT]), generation_config=cls(max_new_tokens=16, **kwargs),
                        return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, direct.sequences) and torch.equal(out.nfe, direct.nfe)
    assert cfg.threshold == 0.9  # the caller's config is not changed


def test_a_plan_holds_the_parts_its_config_names():
    """``plan_from_config`` passes each option to the part that reads it: the probability map's size (the top
    ``ceil(1/t) - 1`` entries are exact: fewer than 1/t tokens can each hold more than t), the merge's guards, the
    threshold rule's many-masks count, and the reference variant's floor of 0.1 on what a merge takes."""
    from hf_blockbatch.generation.plans import map_size, plan_from_config
    from hf_blockbatch.generation.policies import Merge

    assert [map_size(t) for t in (0.9, 0.5, 0.3, 0.25, 0.2)] == [1, 1, 3, 3, 4]
    guarded = plan_from_config(BlockBatchConfig(max_new_tokens=16, block_sizes=[4, 8], merge_threshold=0.3,
                                                merge_agreement=2, merge_source_confidence=0.7), [EOS_ID], [])  # fmt: skip
    merges = [p for p in guarded.policies if isinstance(p, Merge)]
    assert merges == [Merge(0.3, 2, 0.7)] and guarded.map_k == 3
    many = plan_from_config(FastDLLMConfig(max_new_tokens=16, threshold=0.9, many_masks_threshold=0.7, many_masks=5),
                            [EOS_ID], [])  # fmt: skip
    assert (many.rule.threshold, many.rule.many_masks_threshold, many.rule.many_masks) == (0.9, 0.7, 5)
    ref = plan_from_config(BlockBatchConfig(max_new_tokens=16, block_sizes=[8, 4], merge_threshold=0.05,
                                            variant="reference"), [EOS_ID], [])  # fmt: skip
    assert ref.block_sizes == [4, 8] and [p for p in ref.policies if isinstance(p, Merge)] == [Merge(0.1)]
    assert ref.map_k == map_size(0.1) == 9


@pytest.mark.parametrize("make_cfg,kwargs,exc,message", BAD)
def test_bad_config_fails_before_any_forward(tiny_llada, make_cfg, kwargs, exc, message):
    calls = _counting(tiny_llada)
    with pytest.raises(exc) as err:
        tiny_llada.generate(torch.tensor([PROMPT]), generation_config=make_cfg(), **kwargs)
    assert message in str(err.value)
    assert calls["n"] == 0


def test_neutral_standard_options_are_accepted(tiny_llada):
    """Standard fields that ask for nothing here pass: no-op values, and use_cache (a speed switch
    in transformers, which model configs set; here the cache is the strategy's)."""
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4, use_cache=False, num_beams=1, top_p=1.0, top_k=0,
                         output_scores=False, do_sample=False, num_return_sequences=1, bos_token_id=1)  # fmt: skip
    assert tiny_llada.generate(torch.tensor([PROMPT]), generation_config=cfg).shape == (1, len(PROMPT) + 8)


def test_do_sample_follows_the_temperature_unless_given():
    """Stated in the config (pipelines read it), re-derived when a call overrides only the temperature."""
    m = peaked("llada", scale=3.0)
    greedy = FastDLLMConfig(max_new_tokens=8, block_length=4)
    assert greedy.do_sample is False and FastDLLMConfig(temperature=0.7).do_sample is True
    assert "do_sample" in greedy.to_diff_dict()
    gen = torch.Generator().manual_seed(3)
    out = m.generate(torch.tensor([PROMPT]), generation_config=greedy, temperature=0.9, generator=gen)
    hot = FastDLLMConfig(max_new_tokens=8, block_length=4, temperature=0.9)
    assert torch.equal(out, m.generate(torch.tensor([PROMPT]), generation_config=hot, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="set temperature=0, or do_sample=True"):
        m.generate(torch.tensor([PROMPT]), generation_config=greedy, temperature=0.9, do_sample=False)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_numpy_temperature_samples_as_the_same_float(dtype):
    """np.linspace gives np.float64 temperatures, whose ``> 0`` is a np.bool_: the config refused it as do_sample
    ("do_sample must be true or false, got np.True_"); a np.float32 given to generate() left do_sample at the greedy
    config's False ("do_sample=False asks for greedy decoding"). Either samples as the Python float does."""
    import numpy as np

    m = peaked("llada", scale=3.0)
    t = np.dtype(dtype).type(0.75)
    assert FastDLLMConfig(temperature=t).do_sample is True and FastDLLMConfig(temperature=t * 0).do_sample is False
    cfg = FastDLLMConfig(temperature=t)
    assert type(cfg.temperature) is float and '"temperature": 0.75' in cfg.to_json_string()  # np.float32 broke JSON
    greedy = FastDLLMConfig(max_new_tokens=8, block_length=4)
    out = m.generate(torch.tensor([PROMPT]), generation_config=greedy, temperature=t, seed=11)
    assert torch.equal(out, m.generate(torch.tensor([PROMPT]), generation_config=greedy, temperature=0.75, seed=11))


@pytest.mark.parametrize("make_cfg", [
    lambda: BlockBatchConfig(max_new_tokens=12, block_sizes=[4, 8], temperature=0.8),
    lambda: FastDLLMConfig(max_new_tokens=12, block_length=4, remasking="random", steps=6, threshold=None),
])  # fmt: skip
def test_num_return_sequences_expands_each_prompt(make_cfg):
    """As transformers: n samples per prompt, consecutive rows, i.e. the prompts repeated in place
    (left padding kept), each row its own request with its own draws and NFE."""
    m = peaked("llada", scale=3.0)
    ids = torch.tensor([[EOS_ID, EOS_ID, 1, 2, 3], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cfg = make_cfg()
    out = m.generate(ids, attention_mask=mask, generation_config=cfg, num_return_sequences=3, return_dict_in_generate=True,
                     generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert cfg.num_return_sequences is None  # the override applied to that call only
    by_hand = m.generate(ids.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0), generation_config=cfg,
                         return_dict_in_generate=True, generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert out.sequences.shape == (6, 5 + 12)
    assert torch.equal(out.sequences, by_hand.sequences)
    assert torch.equal(out.nfe, by_hand.nfe) and len(out.stats) == 6
    assert torch.equal(out.sequences[:, :5], ids.repeat_interleave(3, 0))
    assert len({tuple(r) for r in out.sequences[:3, 5:].tolist()}) > 1  # samples differ


def test_dream_model_card_api_points_to_generate():
    """Dream's model card calls model.diffusion_generate(...); our class replaces Dream's code, so the
    call must say what to use instead."""
    m = peaked("dream")
    with pytest.raises(NotImplementedError, match=r"Use model.generate\(input_ids"):
        m.diffusion_generate(torch.tensor([PROMPT]), max_new_tokens=8, steps=8, alg="entropy")


def test_bad_inputs_fail_before_any_forward(tiny_llada):
    calls = _counting(tiny_llada)
    cfg = FastDLLMConfig(max_new_tokens=G, block_length=4)
    with pytest.raises(ValueError, match="left-padded"):
        tiny_llada.generate(
            torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 1, 0]]), generation_config=cfg
        )
    with pytest.raises(ValueError, match="exceeds the model's context of 256 positions: shorten the prompt"):
        tiny_llada.generate(torch.ones(1, 250, dtype=torch.long), generation_config=cfg)
    with pytest.raises(ValueError, match="empty"):
        tiny_llada.generate(torch.zeros(1, 0, dtype=torch.long), generation_config=cfg)
    with pytest.raises(ValueError, match=r"Prompt\(s\) \[1\] of the batch are empty"):  # all padding, inside a batch
        tiny_llada.generate(torch.tensor([[1, 2, 3], [0, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
                            generation_config=cfg)  # fmt: skip
    tiny_llada.config.mask_token_id = None
    with pytest.raises(ValueError, match="no mask_token_id: set generation_config.mask_token_id"):
        tiny_llada.generate(torch.tensor([PROMPT]), generation_config=cfg)
    assert calls["n"] == 0


@pytest.mark.parametrize(
    "cfg",
    [
        FastDLLMConfig(max_new_tokens=10, block_length=4, threshold=0.47),
        BlockBatchConfig(max_new_tokens=10, block_sizes=[3, 4, 8], threshold=0.47),
        VanillaDiffusionConfig(max_new_tokens=10, steps=9, block_length=4),
    ],
    ids=lambda c: c.strategy,
)
def test_block_sizes_that_do_not_divide_are_supported(cfg):
    m = peaked("llada")
    out = _gen(m, PROMPT, cfg)
    assert out.sequences.shape == (1, len(PROMPT) + 10)
    assert MASK_ID not in out.sequences[0].tolist()


# ----------------------------------------------------------------------------- 9. save / load
CONFIGS = [
    VanillaDiffusionConfig(
        max_new_tokens=64, steps=32, block_length=16, remasking="random", logits_eos_inf=True
    ),
    FastDLLMConfig(
        max_new_tokens=48, cache="prefix", factor=1.5, threshold=None, early_stop=True, temperature=0.5
    ),
    BlockBatchConfig(
        block_sizes=[4, 16], merge=False, sync_threshold=3, refresh="divergence", output_trace=True,
        eos_confidence="commit",
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.strategy)
def test_config_round_trip(cfg, tmp_path):
    cfg.save_pretrained(tmp_path)
    loaded = type(cfg).from_pretrained(tmp_path)
    assert type(loaded) is type(cfg)
    for name in type(cfg)._ours + ("max_new_tokens", "temperature"):
        assert getattr(loaded, name) == getattr(cfg, name), name
    rebuilt = config_from_dict(cfg.to_dict())
    assert type(rebuilt) is type(cfg)
    for name in type(cfg)._ours + ("max_new_tokens", "temperature"):
        assert getattr(rebuilt, name) == getattr(cfg, name), name
    rebuilt.validate()


@pytest.mark.parametrize("sizes", [8, (4, 8), [4, 8]], ids=["one size", "tuple", "list"])
def test_block_sizes_read_as_a_list_however_they_are_set(sizes, tmp_path):
    """transformers' ways of setting a field (``update``, ``from_pretrained``/``from_dict`` with keywords, plain
    assignment) take one size or a tuple as the constructor does: they were refused by ``validate`` with "must be a
    block size or a list of them, ..., got 8 (int)"."""
    want = [sizes] if isinstance(sizes, int) else list(sizes)
    BlockBatchConfig(max_new_tokens=16).save_pretrained(tmp_path)
    updated = BlockBatchConfig(max_new_tokens=16)
    assert updated.update(block_sizes=sizes) == {}
    assigned = BlockBatchConfig(max_new_tokens=16)
    assigned.block_sizes = sizes
    for cfg in (updated, assigned, BlockBatchConfig.from_pretrained(tmp_path, block_sizes=sizes),
                BlockBatchConfig.from_dict(BlockBatchConfig(max_new_tokens=16).to_dict(), block_sizes=sizes)):  # fmt: skip
        assert cfg.block_sizes == want and type(cfg.block_sizes) is list
        cfg.validate()
        assert cfg == BlockBatchConfig(max_new_tokens=16, block_sizes=want)
    with pytest.raises(ValueError, match=r"block_sizes must be a block size or a list of them.*got '4,8' \(str\)"):
        updated.update(block_sizes="4,8")


@pytest.mark.parametrize("cls", [FastDLLMConfig, BlockBatchConfig])
def test_update_and_from_pretrained_read_a_rule_or_a_temperature_as_generate_does(cls, tmp_path):
    """``update(factor=1.0)`` on a config with the default threshold, and ``update(temperature=0.7)`` on a greedy one,
    were refused ("Give exactly one of threshold, factor or steps", "do_sample=False asks for greedy decoding"), as
    was ``from_pretrained(folder, factor=1.0)``, where the constructor and ``generate()``'s keywords take them: the
    keyword names the rule, and the temperature sets do_sample."""
    cls(max_new_tokens=16).save_pretrained(tmp_path)
    for options in ({"factor": 1.0}, {"temperature": 0.7}, {"factor": 2.0, "temperature": 0.5}):
        want = cls(max_new_tokens=16, **options)
        updated = cls(max_new_tokens=16)
        assert updated.update(**options) == {}
        assert updated == want and cls.from_pretrained(tmp_path, **options) == want
    greedy = cls(max_new_tokens=16, temperature=0.7)
    greedy.update(temperature=0.0)
    assert greedy == cls(max_new_tokens=16) and greedy.do_sample is False


def test_a_refused_update_leaves_the_config_as_it_was():
    """transformers' ``update`` sets the values before it validates them: a refused ``update`` left them set, so
    the config (threshold and factor both) was refused by every later ``generate``."""
    m = make_tiny_llada()
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4)
    with pytest.raises(ValueError, match=r"Give exactly one of threshold, factor or steps \(got \['threshold', 'factor'\]\)"):
        cfg.update(threshold=0.8, factor=1.0)
    with pytest.raises(ValueError, match="block_length must be a positive integer, got 0"):
        cfg.update(block_length=0, temperature=0.7)
    assert cfg == FastDLLMConfig(max_new_tokens=8, block_length=4)
    out = m.generate(torch.tensor([PROMPT]), generation_config=cfg, return_dict_in_generate=True)
    want = m.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=8, block_length=4),
                      return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, want.sequences)


@pytest.mark.parametrize("cls", [VanillaDiffusionConfig, FastDLLMConfig, BlockBatchConfig])
def test_config_from_model_config_takes_the_token_ids(cls):
    """transformers' ``from_model_config`` would copy the model's fields (``d_model``, ...) into the
    config and fail; ours takes the strategy's defaults and the model's token ids."""
    model_config = make_tiny_llada().config
    cfg = cls.from_model_config(model_config, max_new_tokens=16)
    assert type(cfg) is cls and cfg.max_new_tokens == 16
    assert cfg.mask_token_id == model_config.mask_token_id
    assert cfg.eos_token_id == model_config.eos_token_id
    assert not hasattr(cfg, "d_model")
    cfg.validate()
    assert cls.from_model_config(model_config.to_dict(), mask_token_id=7).mask_token_id == 7


@pytest.mark.parametrize("name", [hb.TINY_LLADA, hb.TINY_DREAM])
def test_answer_texts_end_at_the_first_end_token(name):
    """What a fixed-length canvas holds after the first EOS or end-of-turn token is not part of the
    answer (the CLI, the bench, the lm-eval adapter and the demo all score or show this text)."""
    model, tok = hb.load_model(name)
    eot = tok.convert_tokens_to_ids("<|eot_id|>" if name == hb.TINY_LLADA else "<|im_end|>")
    a, b = tok.encode("12 + 3", add_special_tokens=False), tok.encode(" #### 7", add_special_tokens=False)
    rows = [a + [eot] + b, a + [tok.eos_token_id] + b, a + b + b[:1] + b[:1] + [eot]]
    new = torch.tensor([r[:len(rows[0])] for r in rows])
    assert set(hb.end_token_ids(tok, model.config)) >= {tok.eos_token_id, eot}
    texts = hb.answer_texts(tok, new, hb.end_token_ids(tok, model.config))
    assert texts[:2] == [tok.decode(a)] * 2
    assert texts[2] == tok.decode(new[2].tolist(), skip_special_tokens=True)  # no end token: every token
    assert "7" in texts[2]


@pytest.mark.parametrize("name", [hb.TINY_LLADA, hb.TINY_DREAM])
def test_confidence_eos_eot_inf_covers_the_end_of_turn_token(name, monkeypatch):
    """The model config names the end-of-turn token (LLaDA's <|eot_id|>, Dream's <|im_end|>), and
    ``confidence_eos_eot_inf`` ranks its predictions last together with EOS, as LLaDA's sampler."""
    from hf_blockbatch.generation import mixin as mixin_mod

    model, tok = hb.load_model(name)
    eot = tok.convert_tokens_to_ids("<|eot_id|>" if name == hb.TINY_LLADA else "<|im_end|>")
    assert model.config.eot_token_id == eot
    plans = []
    real = mixin_mod.plan_from_config
    monkeypatch.setattr(mixin_mod, "plan_from_config", lambda *a: plans.append(real(*a)) or plans[-1])
    model.generate(torch.tensor([tok.encode("1 + 2")]), generation_config=VanillaDiffusionConfig(
        max_new_tokens=8, confidence_eos_eot_inf=True))  # fmt: skip
    assert sorted(plans[0].low_confidence_ids) == sorted({tok.eos_token_id, eot})


def test_a_model_split_over_gpus_is_refused_where_a_cache_is_needed():
    """With ``device_map`` over several GPUs the cache (one device) cannot serve every layer: the
    cached strategies say so before any forward; cache-free decoding still runs."""
    m = make_tiny_llada()
    m.hf_device_map = {"model.transformer.blocks.0": 0, "model.transformer.blocks.1": 1, "lm_head": 1}
    with pytest.raises(NotImplementedError, match=r"split over devices \['0', '1'\]"):
        m.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=8, block_length=4))
    out = m.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=8, block_length=4, cache="none"))
    assert out.shape == (1, len(PROMPT) + 8)
    m.hf_device_map = {"": 0}  # one device: the cache is fine
    m.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=8, block_length=4))


@pytest.mark.parametrize("family,tied", [("llada", False), ("llada", True), ("dream", False), ("dream", True)])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_model_offloaded_by_accelerate_decodes_as_loaded(family, tied, offload, tmp_path):
    """accelerate's offloading (``cpu_offload``, ``disk_offload``, a ``device_map`` with "disk") leaves the
    weights on ``meta`` between forwards: the decoders' state and cache must live on the hooks' execution
    device, and a tied LLaDA head must load the embedding's weight (a linear with a meta weight returns
    uninitialised memory, not an error). Every strategy decodes as the model did before it was offloaded."""
    from accelerate import cpu_offload, disk_offload

    if family == "llada":
        model = make_tiny_llada(weight_tying=True) if tied else make_tiny_llada()
    else:
        model = make_tiny_dream(tie_word_embeddings=True) if tied else make_tiny_dream()
    ids = torch.tensor([PROMPT, [9, 8, 7, 6, 5, 4, 3]])
    configs = [VanillaDiffusionConfig(max_new_tokens=12, steps=12), FastDLLMConfig(max_new_tokens=12, block_length=4),
               FastDLLMConfig.drafted(exact=False, max_new_tokens=12, block_length=4),
               BlockBatchConfig(max_new_tokens=12, block_sizes=[2, 4], threshold=0.5)]  # fmt: skip
    loaded = [model.generate(ids, generation_config=cfg) for cfg in configs]
    if offload == "cpu":
        cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        disk_offload(model, str(tmp_path), execution_device=torch.device("cpu"))
    assert next(model.parameters()).device.type == "meta" and model.device == torch.device("cpu")
    for cfg, expected in zip(configs, loaded):
        assert torch.equal(model.generate(ids, generation_config=cfg), expected), type(cfg).__name__


def test_the_execution_device_is_read_through_a_chain_of_hooks():
    """A module holding several accelerate hooks (``add_hook_to_module(..., append=True)`` over an offloading one)
    has a ``SequentialHook``, which has no execution device of its own: the one inside it is where the forward runs."""
    from accelerate import cpu_offload
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = make_tiny_llada()
    cpu_offload(model, execution_device=torch.device("cpu"))
    for module in [m for m in model.modules() if getattr(m, "_hf_hook", None) is not None]:
        add_hook_to_module(module, ModelHook(), append=True)
    assert type(model.model.transformer.wte._hf_hook).__name__ == "SequentialHook"
    assert next(model.parameters()).device.type == "meta" and model.device == torch.device("cpu")


def test_a_model_left_on_meta_is_refused_with_what_to_do():
    """Weights on ``meta`` with no accelerate hook (``init_empty_weights`` never loaded) cannot compute:
    said before any forward, not as torch's "cannot copy out of meta tensor"."""
    model = make_tiny_llada().to("meta")
    with pytest.raises(RuntimeError, match="meta device and no accelerate hook.*load them"):
        model.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=8, block_length=4))


def test_generate_takes_transformers_argument_names_and_refuses_left_to_right_ones():
    """``generate(inputs=...)`` is transformers' name for the prompts; its left-to-right arguments are
    refused with why (not reported as unknown config options), on the model's own ``generate`` and on a
    contract model made generative with ``enable``; empty processor lists ask for nothing and pass."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    model = make_tiny_llada()
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4)
    ids = torch.tensor([PROMPT])
    expected = model.generate(ids, generation_config=cfg)
    assert torch.equal(model.generate(inputs=ids, generation_config=cfg), expected)
    assert torch.equal(hb.enable(make_tiny_llada()).generate(inputs=ids, generation_config=cfg), expected)
    assert torch.equal(model.generate(ids, generation_config=cfg, logits_processor=LogitsProcessorList(),
                                      stopping_criteria=StoppingCriteriaList(), synced_gpus=False), expected)  # fmt: skip
    # a tokenizer that returns token_type_ids: generate(**tokenizer(...)) works while they are all 0
    assert torch.equal(model.generate(ids, token_type_ids=torch.zeros_like(ids), generation_config=cfg), expected)
    refused = {
        "inputs": (dict(input_ids=ids, inputs=ids), "given twice"),
        "stopping_criteria": (dict(input_ids=ids, stopping_criteria=[lambda *a: True]), "does not use stopping_criteria"),
        "inputs_embeds": (dict(inputs_embeds=torch.zeros(1, 7, 64)), "remove inputs_embeds and pass the prompts as token ids"),
        "position_ids": (dict(input_ids=ids, position_ids=torch.arange(7)[None]), "builds the canvas.*remove position_ids"),
        "token_type_ids": (dict(input_ids=ids, token_type_ids=torch.ones_like(ids)), "no token types"),
        # a second segment after the first (a pair encoded as two sentences): one token of another type is refused
        "token_type_ids_pair": (dict(input_ids=ids, token_type_ids=(torch.arange(7) >= 4).long()[None]), "no token types"),
    }  # fmt: skip
    for kwargs, message in refused.values():
        with pytest.raises(ValueError, match=message):
            model.generate(generation_config=cfg, **kwargs)


def test_padded_prompts_without_a_mask(caplog):
    """A left-padded batch given without its ``attention_mask`` (``model.generate(enc.input_ids)``): with a
    padding id of its own, the mask is inferred from the leading padding, as transformers does; when the
    padding id is the EOS id (LLaDA, Dream) it cannot be, and a warning says to pass the mask."""
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4)
    PAD = 91
    ids = torch.tensor([[PAD, PAD, 3, 4, 5], [1, 2, 3, 4, 5]])
    mask = (ids != PAD).long()
    own_pad = make_tiny_llada(pad_token_id=PAD)
    assert torch.equal(own_pad.generate(ids, generation_config=cfg), own_pad.generate(ids, mask, generation_config=cfg))
    model = make_tiny_llada()  # pad = EOS
    padded = ids.masked_fill(ids == PAD, EOS_ID)
    with caplog.at_level("WARNING", logger="hf_blockbatch.generation.mixin"):
        model.generate(padded, generation_config=cfg)
    assert f"row(s) [0] start with the padding id {EOS_ID}, which is also the EOS id" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_blockbatch.generation.mixin"):
        model.generate(padded, (padded != EOS_ID).long(), generation_config=cfg)  # given: nothing to say
        model.generate(padded[1:], generation_config=cfg)  # no row starts with it
    assert not caplog.records
    with caplog.at_level("WARNING", logger="hf_blockbatch.generation.mixin"):
        model.generate(padded.roll(-2, dims=1), generation_config=cfg)  # right padding, as transformers warns
    assert f"row(s) [0] end with the padding id {EOS_ID}: right padding" in caplog.text


def test_switches_and_masks_take_their_own_values(monkeypatch):
    """On/off arguments take True or False (a string such as "no" is truthy: it returned a dict), and the
    attention mask 0 and 1 (0.5 or 2 read as 1), each refused before any forward; a boolean mask, as some
    pipelines build it, is the same mask as its integers."""
    model, cfg = make_tiny_llada(), FastDLLMConfig(max_new_tokens=8, block_length=4)
    ids = torch.tensor([[EOS_ID, 3, 4, 5], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with monkeypatch.context() as patch:
        patch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("a forward ran before the refusal"))
        for name, value in (("return_dict_in_generate", "no"), ("return_dict_in_generate", 1), ("do_sample", "yes"),
                            ("pad_after_end", "no")):  # fmt: skip
            with pytest.raises(ValueError, match=f"^{name} must be true or false, got {value!r}"):
                model.generate(ids, mask, generation_config=cfg, **{name: value})
        for bad in (mask * 2, mask * 0.5, -mask):
            with pytest.raises(ValueError, match="attention_mask must hold 0 .padding. and 1 .a token. only"):
                model.generate(ids, bad, generation_config=cfg)
    assert torch.equal(model.generate(ids, mask.bool(), generation_config=cfg), model.generate(ids, mask, generation_config=cfg))
    assert torch.equal(model.generate(ids, mask.float(), generation_config=cfg), model.generate(ids, mask, generation_config=cfg))


def test_config_from_dict_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="Unknown strategy"):
        config_from_dict({"strategy": "beam"})


def test_config_from_dict_says_to_parse_a_json_string():
    """The JSON text itself (or None) failed with an AttributeError on ``.get``."""
    cfg = BlockBatchConfig(max_new_tokens=G)
    for data in (cfg.to_json_string(), None):
        with pytest.raises(TypeError, match=r"data must be a dict, e\.g\. json\.loads\(text\)"):
            config_from_dict(data)


def test_event_from_dict_refuses_an_unknown_or_missing_phase():
    """A dict without a phase raised a KeyError; an unknown phase was built into a CommitEvent."""
    from hf_blockbatch.generation.trace import CommitEvent, event_from_dict

    event = {"step": 1, "phase": "block", "branch": 0, "window": [0, 4], "committed": [1], "tokens": [5]}
    assert event_from_dict(event) == CommitEvent(1, "block", 0, [0, 4], [1], [5])
    with pytest.raises(ValueError, match=r"phase must be one of \('init', 'block', 'refresh', 'adopt', 'merge', 'sync'\)"):
        event_from_dict({"step": 1})
    with pytest.raises(ValueError, match="got 'blok'"):
        event_from_dict({**event, "phase": "blok"})
    with pytest.raises(TypeError, match=r"^event_from_dict: data must be a dict \(an event's to_dict\(\)\), got list\.$"):
        event_from_dict([event])


def test_model_generation_config_is_used_by_default():
    m = make_tiny_llada()
    m.generation_config = FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=0.5)
    out = m.generate(torch.tensor([PROMPT]), return_dict_in_generate=True)
    assert out.stats[0]["strategy"] == "fast_dllm"
    assert out.sequences.shape == (1, len(PROMPT) + 8)


def test_a_plain_model_generation_config_gives_its_defaults(caplog):
    """A checkpoint's generation_config.json without a strategy loads as transformers' plain class; what it
    sets that means the same here is the default decode's, as transformers reads it (it was dropped whole:
    ``model.generation_config.max_new_tokens = 16`` still decoded 128), and what it sets that cannot apply is
    named in a warning."""
    m = make_tiny_llada()
    m.generation_config = GenerationConfig(max_new_tokens=8, eos_token_id=EOS_ID, pad_token_id=EOS_ID, use_cache=False)
    out = m.generate(torch.tensor([PROMPT]), return_dict_in_generate=True)
    want = m.generate(torch.tensor([PROMPT]), generation_config=BlockBatchConfig(max_new_tokens=8), return_dict_in_generate=True)
    assert out.sequences.shape == (1, len(PROMPT) + 8) and out.stats[0]["strategy"] == "blockbatch"
    assert torch.equal(out.sequences, want.sequences) and torch.equal(out.nfe, want.nfe)
    m.generation_config.update(do_sample=True, temperature=0.9, top_k=5)
    with caplog.at_level("WARNING", logger="hf_blockbatch.generation.mixin"):
        got = m.generate(torch.tensor([PROMPT]), generator=torch.Generator().manual_seed(3))
    sampled = BlockBatchConfig(max_new_tokens=8, do_sample=True, temperature=0.9)
    assert torch.equal(got, m.generate(torch.tensor([PROMPT]), generation_config=sampled,
                                       generator=torch.Generator().manual_seed(3)))  # fmt: skip
    assert "top_k=5" in caplog.text and "does not use" in caplog.text


def test_generate_refuses_a_strategy_keyword():
    """``strategy=`` set on a config of another class decoded that class and only relabelled the stats."""
    m = make_tiny_llada()
    with pytest.raises(ValueError, match="strategy='blockbatch' is set on a FastDLLMConfig"):
        m.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=8), strategy="blockbatch")


def test_diffusion_generate_called_directly_has_generates_front_door():
    """hb.diffusion_generate is public: transformers' arguments get the messages generate() gives (they were
    "Unknown option(s)" there), and synced_gpus=False is accepted as by generate()."""
    m, ids = make_tiny_llada(), torch.tensor([PROMPT])
    with pytest.raises(ValueError, match="does not use logits_processor"):
        hb.diffusion_generate(m, ids, max_new_tokens=8, logits_processor=[lambda input_ids, scores: scores])
    with pytest.raises(ValueError, match="remove inputs_embeds"):
        hb.diffusion_generate(m, ids, max_new_tokens=8, inputs_embeds=torch.zeros(1, 3, 8))
    want = m.generate(ids, max_new_tokens=8)
    assert torch.equal(hb.diffusion_generate(m, inputs=ids, max_new_tokens=8, synced_gpus=False), want)


def test_token_ids_as_tensors_and_numpy_integers():
    """transformers passes eos_token_id as a tensor at times; it (and a numpy integer) reads as the same ids."""
    import numpy as np

    m, cfg = make_tiny_llada(), FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=0.5)
    want = m.generate(torch.tensor([PROMPT]), generation_config=cfg, eos_token_id=[EOS_ID])
    for eos in (torch.tensor([EOS_ID]), np.int64(EOS_ID)):
        assert torch.equal(m.generate(torch.tensor([PROMPT]), generation_config=cfg, eos_token_id=eos), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_generation_config_comes_back_with_the_model(family, tmp_path, caplog):
    """``save_pretrained`` writes the strategy config; ``from_pretrained`` (ours and the Auto class)
    must load it as its class, or the reloaded model would silently decode with the defaults; and the file read
    back by ``GenerationConfig.from_pretrained`` decodes as the config it was saved from."""
    from transformers import AutoModel

    m = peaked(family)
    m.generation_config = FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=0.5)
    want = m.generate(torch.tensor([PROMPT]), return_dict_in_generate=True)
    m.save_pretrained(tmp_path / "fd")
    for loaded in (type(m).from_pretrained(tmp_path / "fd"), AutoModel.from_pretrained(tmp_path / "fd")):
        assert type(loaded.generation_config) is FastDLLMConfig
        assert loaded.generation_config.block_length == 4
        got = loaded.generate(torch.tensor([PROMPT]), return_dict_in_generate=True)
        assert got.stats[0]["strategy"] == "fast_dllm"
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe)
    # the saved config read back as transformers' own class: generate() rebuilds ours from its strategy (was refused)
    generic = GenerationConfig.from_pretrained(tmp_path / "fd")
    assert type(generic) is GenerationConfig
    got = m.generate(torch.tensor([PROMPT]), generation_config=generic, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe)
    override = AutoModel.from_pretrained(tmp_path / "fd", generation_config=BlockBatchConfig(max_new_tokens=8))
    assert type(override.generation_config) is BlockBatchConfig
    # a strategy file this version refuses (another version's option) does not stop the model loading
    path = tmp_path / "fd" / "generation_config.json"
    path.write_text(path.read_text().replace('"block_length"', '"future_option": 1, "block_length"'))
    with caplog.at_level("WARNING", logger="hf_blockbatch.generation.mixin"):
        kept = AutoModel.from_pretrained(tmp_path / "fd")
    assert type(kept.generation_config) is GenerationConfig and "future_option" in caplog.text
    plain = peaked(family)  # no strategy saved: a plain GenerationConfig, and generate() defaults to BlockBatch
    plain.save_pretrained(tmp_path / "plain")
    reloaded = type(plain).from_pretrained(tmp_path / "plain")
    assert type(reloaded.generation_config) is GenerationConfig
    out = reloaded.generate(torch.tensor([PROMPT]), max_new_tokens=8, return_dict_in_generate=True)
    assert out.stats[0]["strategy"] == "blockbatch"


@pytest.mark.parametrize("make", [
    lambda: VanillaDiffusionConfig(max_new_tokens=8, steps=8, block_length=4),
    lambda: FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=0.5),
    lambda: FastDLLMConfig.drafted(exact=False, max_new_tokens=8, block_length=8),
    lambda: BlockBatchConfig.lean(max_new_tokens=8),
    lambda: BlockBatchConfig(max_new_tokens=8, remasking="random", seed=3),
    lambda: FastDLLMConfig(max_new_tokens=8, block_length=4, temperature=0.5, seed=1),
], ids=["vanilla", "fast_dllm", "drafted", "lean", "random remasking", "sampling"])  # fmt: skip
def test_a_saved_config_reads_back_quietly_as_transformers_class(make, tmp_path):
    """A greedy config's file held ``temperature: 0.0`` beside ``do_sample: false``, which transformers' own
    ``GenerationConfig.from_pretrained`` (and a transformers model's ``from_pretrained``) answered with "The
    following generation flags are not valid and may be ignored: ['temperature']" on every load. The file now
    leaves out that default temperature; both classes read it back as it was saved and it decodes the same."""
    import logging

    import transformers.utils.logging as transformers_logging

    cfg = make()
    cfg.save_pretrained(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # transformers' logger does not propagate to caplog's root handler
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    transformers_logging.warning_once.cache_clear()  # the warning is logged once per process: an earlier test's hid it
    try:
        generic = GenerationConfig.from_pretrained(tmp_path)
    finally:
        transformers_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
    assert type(cfg).from_pretrained(tmp_path) == cfg
    m = make_tiny_llada()
    got = m.generate(torch.tensor([PROMPT]), generation_config=generic)  # the sampled ones hash their noise (seed)
    assert torch.equal(got, m.generate(torch.tensor([PROMPT]), generation_config=cfg))


@pytest.mark.parametrize(("edit", "exc", "reason"), [
    (("\"block_length\": 4", "\"block_length\": 0"), ValueError, "block_length must be a positive integer, got 0."),
    (("\"block_length\"", "\"future_option\": 1, \"block_length\""), TypeError, "Unknown option(s) for FastDLLMConfig: future_option."),
], ids=["bad value", "another version's option"])  # fmt: skip
def test_a_saved_strategy_that_does_not_load_is_refused_where_it_came_from(edit, exc, reason, tmp_path, caplog):
    """A checkpoint whose generation_config.json holds a strategy config this version refuses loads anyway (as
    transformers' class); the load warning said generate() would then decode BlockBatch's defaults, but it
    refused with the file's error, which named an option the caller never passed. Both now say what happens:
    generate() without a config refuses, naming the checkpoint's file; given a config, it decodes."""
    from transformers import AutoModel

    m = make_tiny_llada()
    m.generation_config = FastDLLMConfig(max_new_tokens=8, block_length=4)
    m.save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    path.write_text(path.read_text().replace(*edit))
    with caplog.at_level("WARNING", logger="hf_blockbatch.generation.mixin"):
        loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded.generation_config) is GenerationConfig
    assert "'fast_dllm' config saved in" in caplog.text and reason in caplog.text
    assert "generate() refuses to decode until given a generation_config" in caplog.text
    with pytest.raises(exc) as err:
        loaded.generate(torch.tensor([PROMPT]))
    assert str(err.value).startswith(
        "model.generation_config (the checkpoint's generation_config.json) holds a 'fast_dllm' config that does not load: "
        + reason
    ) and str(err.value).endswith("Pass a generation_config (hb.FastDLLMConfig, hb.BlockBatchConfig, ...), or set "
                                  "model.generation_config to one.")  # fmt: skip
    with pytest.raises(exc) as own:  # the caller's own config read back as transformers' class: its error as it is
        loaded.generate(torch.tensor([PROMPT]), generation_config=GenerationConfig.from_pretrained(tmp_path))
    assert str(own.value).startswith(reason)
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4)
    assert torch.equal(loaded.generate(torch.tensor([PROMPT]), generation_config=cfg),
                       m.generate(torch.tensor([PROMPT]), generation_config=cfg))  # fmt: skip


def test_text_generation_pipeline_runs_our_strategies():
    """transformers' pipeline calls generate() with its own sampling defaults, or keeps a strategy
    config's greedy decoding (the config states do_sample, so the pipeline adds none)."""
    from transformers import pipeline

    model, tok = hb.load_model("tiny-llada")
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    assert pipe("1+2=", max_new_tokens=8)[0]["generated_text"].startswith("1+2=")  # samples at the pipeline's 0.7
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4)
    ids = tok("1+2=", return_tensors="pt").input_ids
    greedy = tok.decode(model.generate(ids, generation_config=cfg)[0, ids.shape[1] :], skip_special_tokens=True)
    assert pipe("1+2=", generation_config=cfg, return_full_text=False)[0]["generated_text"] == greedy
    model.generation_config = cfg  # the model's own strategy config: the pipeline keeps it greedy too
    assert pipe("1+2=", return_full_text=False)[0]["generated_text"] == greedy


class _ContractOnly(torch.nn.Module):
    """A model that is not one of ours but implements the forward contract by delegation."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.logit_shift = inner.logit_shift

    @property
    def device(self):
        return self.inner.device

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def forward_windows(self, *args, **kwargs):
        return self.inner.forward_windows(*args, **kwargs)

    def new_cache(self, *args, **kwargs):
        return self.inner.new_cache(*args, **kwargs)


CONTRACT_CONFIGS = [
    hb.BlockBatchConfig(max_new_tokens=12, block_sizes=[4, 8], threshold=0.05),
    hb.BlockBatchConfig(max_new_tokens=12, block_sizes=[4, 8, 12], threshold=0.3, early_stop=True),
    hb.FastDLLMConfig(max_new_tokens=12, block_length=4, threshold=0.3, cache="dual", early_stop=True),
    hb.FastDLLMConfig(max_new_tokens=12, block_length=8, threshold=0.3, cache="prefix"),
    hb.FastDLLMConfig(max_new_tokens=12, block_length=8, threshold=0.3, cache="none"),
    hb.VanillaDiffusionConfig(max_new_tokens=12, steps=6, block_length=4),
]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cfg", CONTRACT_CONFIGS, ids=lambda c: f"{c.strategy}-{getattr(c, 'cache', '')}")
def test_enable_gives_any_contract_model_the_same_generate(family, cfg):
    """A contract model without ``supports_logits_mask`` gets dense logits, selected by the
    decoder: the same tokens and NFE as ours, whose forwards compute only the logits read."""
    from _generation_helpers import peaked

    model = peaked(family)
    other = hb.enable(_ContractOnly(model))
    prompt = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 3, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    ours = model.generate(prompt, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    theirs = other.generate(prompt, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    assert not hasattr(other, "supports_logits_mask") and model.supports_logits_mask
    ours = model.generate(prompt, generation_config=cfg, return_dict_in_generate=True)
    theirs = other.generate(prompt, generation_config=cfg, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.nfe, theirs.nfe)


def test_generator_on_another_device_is_refused_before_any_forward(tiny_llada):
    """A CPU generator for a GPU model would fail deep inside torch.rand: say what to make instead."""
    calls = _counting(tiny_llada)

    class OnCuda(_ContractOnly):
        device = torch.device("cuda")  # only read, before anything moves: no GPU needed

    with pytest.raises(ValueError, match=r"generator is on cpu but the model on cuda: make it with torch.Generator\(device='cuda'\)"):
        hb.diffusion_generate(OnCuda(tiny_llada), torch.tensor([PROMPT]), generation_config=FastDLLMConfig(temperature=0.5),
                              generator=torch.Generator())  # fmt: skip
    assert calls["n"] == 0


def test_hub_custom_generate_runs_the_strategies():
    """A model whose generate() is transformers' own loads the repository's
    ``custom_generate/generate.py`` (as from the Hub) and decodes exactly as ours."""
    from pathlib import Path

    from transformers import GenerationMixin

    model = peaked("llada")

    class TransformersGenerate(GenerationMixin, _ContractOnly):
        """Not ours: its generate() is transformers' GenerationMixin.generate."""

    other = TransformersGenerate(model)
    repo = str(Path(__file__).resolve().parents[1])  # this checkout: custom_generate/generate.py
    prompt, mask = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 3, 2]]), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    cfg = CONTRACT_CONFIGS[1]
    ours = model.generate(prompt, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    theirs = other.generate(prompt, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True,
                            custom_generate=repo, trust_remote_code=True)  # fmt: skip
    assert torch.equal(ours.sequences, theirs.sequences) and torch.equal(ours.nfe, theirs.nfe)
    with pytest.raises(ValueError, match="does not use stopping_criteria"):
        other.generate(prompt, generation_config=cfg, stopping_criteria=[lambda *a: True], custom_generate=repo,
                       trust_remote_code=True)  # fmt: skip
    # as a model repo binds it (functools.partial(generate, model=...)): positional prompts, empty processor lists
    from transformers import LogitsProcessorList, StoppingCriteriaList

    bound = functools.partial(hb.custom_generate, model=other)
    again = bound(prompt, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True,
                  logits_processor=LogitsProcessorList(), stopping_criteria=StoppingCriteriaList())  # fmt: skip
    assert torch.equal(again.sequences, ours.sequences)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cfg", CONTRACT_CONFIGS[:3], ids=lambda c: f"{c.strategy}-{getattr(c, 'cache', '')}")
def test_greedy_decoding_runs_the_head_only_where_it_reads(family, cfg, monkeypatch):
    """Our models get a logits mask: fewer hidden states go through the head than with the dense
    logits a contract-only model returns (same tokens, checked above)."""
    from _generation_helpers import peaked

    model = peaked(family)
    seen: list[int] = []
    head = type(model)._head

    def counting(self, hidden):
        seen.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return head(self, hidden)

    monkeypatch.setattr(type(model), "_head", counting)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    model.generate(prompt, generation_config=cfg)
    masked_rows, seen[:] = sum(seen), []
    hb.enable(_ContractOnly(model)).generate(prompt, generation_config=cfg)
    assert 0 < masked_rows < sum(seen)


def test_enable_refuses_a_model_without_the_contract():
    with pytest.raises(TypeError, match="forward contract"):
        hb.enable(torch.nn.Linear(2, 2))


def test_finished_requests_retire_then_leave_the_cache(monkeypatch):
    """Requests that end at different steps (3 to 14 forwards here): each still equals its run
    alone (so no later forward carried it: its NFE would grow), and the cache drops whole
    requests' rows once half the rows are retired."""
    model, cfg = peaked("llada"), PADDED_CONFIGS[4]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9], [7, 9, 3, 2], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3]]
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kept: list[int] = []
    keep_rows = hb.BranchCache.keep_rows

    def spy(self, rows):
        kept.append(len(rows))
        return keep_rows(self, rows)

    monkeypatch.setattr(hb.BranchCache, "keep_rows", spy)
    batch = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    assert len(set(batch.nfe.tolist())) > 1, "the prompts must finish at different steps for this test"
    rows = len(cfg.block_sizes)
    assert kept and all(n % rows == 0 and n <= len(prompts) * rows // 2 for n in kept)
    for i, p in enumerate(prompts):
        alone = _gen(model, p, cfg)
        assert batch.sequences[i, width - len(p) :].tolist() == alone.sequences[0].tolist()
        assert int(batch.nfe[i]) == int(alone.nfe[0])


@pytest.mark.parametrize("mode", ["completion", "commit"])
def test_eos_ranking_in_a_padded_batch_equals_alone(mode):
    """Both EOS readings give each request of a padded batch what it gets alone: tokens, NFE,
    winner and the probabilities that ranked its hitters (requests stop at different steps, so rows
    are retired and dropped while the others go on)."""
    model = eos_model("llada")
    cfg = BlockBatchConfig(max_new_tokens=32, block_sizes=[2, 4, 8, 16], threshold=0.3, eos_confidence=mode)
    prompts = [[5, 3, 8, 1, 9, 2], [7, 7, 1, 4], [2, 9, 6, 3, 8], [11, 4, 6, 1, 1, 5, 3], [8, 2, 2, 9]]
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    assert sum(s["stopped_by"] == "eos" for s in batch.stats) >= 3
    for i, p in enumerate(prompts):
        alone = _gen(model, p, cfg)
        assert batch.sequences[i, width - len(p) :].tolist() == alone.sequences[0].tolist()
        assert int(batch.nfe[i]) == int(alone.nfe[0])
        got, want = batch.stats[i], alone.stats[0]
        assert got["winner_branch"] == want["winner_branch"]
        for b, w in zip(got["branches"], want["branches"]):
            assert b["eos_hit"] == w["eos_hit"]
            if w["eos_hit"]:  # float32 rounding differs with the batch's shapes
                assert b["eos_probability"] == pytest.approx(w["eos_probability"], rel=1e-4)
            else:
                assert b["eos_probability"] is None


def test_generate_options_override_a_copy_of_the_config():
    """``generate(..., max_new_tokens=...)`` overrides the config for that call only."""
    m = make_tiny_llada()
    cfg = FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=0.5)
    out = m.generate(torch.tensor([PROMPT]), generation_config=cfg, max_new_tokens=12)
    assert out.shape == (1, len(PROMPT) + 12)
    assert cfg.max_new_tokens == 8
    assert m.generate(torch.tensor([PROMPT]), generation_config=cfg).shape == (1, len(PROMPT) + 8)


def test_answer_lengths_and_texts_stop_at_the_first_end_token():
    """Tokens before each row's first end token (the row's length without one). An empty slice of new tokens gives
    empty answers: argmax over zero columns raised torch's IndexError."""
    from hf_blockbatch.generation.outputs import answer_lengths

    class Decoder:
        def batch_decode(self, rows, skip_special_tokens):
            return [" ".join(map(str, row)) for row in rows]

    new = torch.tensor([[5, 9, 7, 9], [5, 6, 7, 8], [9, 4, 1, 2]])
    assert answer_lengths(new, [9, 4]).tolist() == [1, 4, 0]
    assert hb.answer_texts(Decoder(), new, [9]) == ["5", "5 6 7 8", ""]
    assert answer_lengths(new[:, :0], [9]).tolist() == [0, 0, 0]
    assert hb.answer_texts(Decoder(), new[:, :0], [9]) == ["", "", ""]
    # one end id as the tokenizer gives it (tokenizer.eos_token_id), and one row as out.sequences[0, Lp:] gives it
    assert hb.answer_texts(Decoder(), new, 9) == ["5", "5 6 7 8", ""] and answer_lengths(new, 9).tolist() == [1, 4, 0]
    assert hb.answer_texts(Decoder(), new[1], [9]) == ["5 6 7 8"]
    with pytest.raises(ValueError, match="end_ids must be an integer token id"):
        hb.answer_texts(Decoder(), new, 9.5)
    with pytest.raises(ValueError, match=r"new_tokens must be \[batch, new\] token ids"):
        hb.answer_texts(Decoder(), new[None], [9])


def test_retiring_a_request_clears_its_eos_hits_so_the_stop_rule_skips_it(monkeypatch):
    """``DecodeState.retire`` marks whole requests retired and done, fills their masks, and clears their EOS hits:
    a retired request that stopped at EOS stays in the state until half the rows are retired, and with its hit
    kept the stop rule's quick check (``ready``) would look for finished requests after every later step."""
    from hf_blockbatch.generation import stop
    from hf_blockbatch.generation.state import DecodeState

    prompt = torch.tensor([[1, 2]] * 3)
    s = DecodeState.start(prompt, torch.ones_like(prompt), [2, 4], 4, MASK_ID)  # 3 requests of 2 rows
    s.canvas[0:2, 2:4] = torch.tensor([EOS_ID, EOS_ID])
    s.eos_hit[[0, 1, 2]] = True  # request 0 ended at EOS; row 2 (request 1) hit EOS too, its request goes on
    s.retire(s.request == 0, EOS_ID)
    assert s.retired.tolist() == s.done.tolist() == [True, True, False, False, False, False]
    assert s.eos_hit.tolist() == [False, False, True, False, False, False]
    assert not (s.canvas[:2] == MASK_ID).any() and (s.canvas[2:, 2:] == MASK_ID).all()
    s.eos_hit[2] = False
    calls, real = [], stop.finished_requests
    monkeypatch.setattr(stop, "finished_requests", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert stop.StopRule(early_stop=True).ending(s, 3, EOS_ID) is None and not calls


def test_canvas_positions_keeps_a_bounded_number_of_lengths():
    """Every prompt length gives a new canvas length: a long-running server must not keep one positions
    tensor per length it ever decoded (unbounded, 67 MB at a 4k context, held on the device)."""
    from hf_blockbatch.generation.state import CANVAS_POSITIONS_CACHED, canvas_positions

    canvas_positions.cache_clear()
    for length in range(1, 4 * CANVAS_POSITIONS_CACHED):
        assert torch.equal(canvas_positions(length, torch.device("cpu")), torch.arange(length))
    assert canvas_positions.cache_info().currsize == CANVAS_POSITIONS_CACHED
    first = canvas_positions(7, torch.device("cpu"))
    assert canvas_positions(7, torch.device("cpu")) is first  # still built once per length while in use


def test_rule_bounds_take_their_edges():
    """The edges of the rules' ranges: a threshold of exactly 1 is in (0, 1] (commit only certain tokens, one forced
    per step), an entropy budget of 0 nats and ``many_masks=0`` are >= 0; a factor or a divergence threshold of 0 is
    not > 0 and is refused by name."""
    for cfg in (FastDLLMConfig(threshold=1.0), BlockBatchConfig(threshold=1.0), BlockBatchConfig(merge_threshold=1.0),
                FastDLLMConfig(rule="entropy", entropy_bound=0.0), BlockBatchConfig(rule="entropy", entropy_bound=0),
                FastDLLMConfig(many_masks_threshold=0.85, many_masks=0)):  # fmt: skip
        cfg.validate()
    for make, name in ((lambda: FastDLLMConfig(factor=0.0), "factor"), (lambda: BlockBatchConfig(factor=0), "factor"),
                       (lambda: BlockBatchConfig(divergence_threshold=0.0), "divergence_threshold")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be > 0, got 0"):
            make()


def test_end_token_ids_and_token_ids_read_every_source_and_refuse_a_bool():
    """``end_token_ids`` joins the model config's end of turn (``eot_token_id``) to the EOS ids and the tokenizer's
    end-of-turn tokens; ``as_token_ids`` refuses ``True`` (an int to ``operator.index``, so token 1)."""
    from types import SimpleNamespace

    from hf_blockbatch.generation.outputs import as_token_ids

    tok = SimpleNamespace(eos_token_id=2, get_vocab=lambda: {"<|im_end|>": 7, "<|eot_id|>": 8, "a": 9})
    assert hb.end_token_ids(tok) == [2, 7, 8]
    assert hb.end_token_ids(tok, SimpleNamespace(eos_token_id=[3, 4], eot_token_id=5)) == [2, 3, 4, 5, 7, 8]
    assert as_token_ids(torch.tensor([4, 5])) == [4, 5] and as_token_ids(None) == []
    for bad in (True, [4, False]):
        with pytest.raises(ValueError, match="eos_token_id must be an integer token id"):
            as_token_ids(bad)


def test_the_defaults_are_the_documented_ones():
    """Each strategy's defaults as its docstring and README state them (the paper's and the official codes'):
    a changed default changes every decode that leaves the field unset, and no other test pins most of them."""
    for cls in (VanillaDiffusionConfig, FastDLLMConfig, BlockBatchConfig):
        cfg = cls()
        assert (cfg.max_new_tokens, cfg.temperature, cfg.do_sample, cfg.remasking, cfg.seed, cfg.output_trace) == (
            128, 0.0, False, "low_confidence", None, False)  # fmt: skip
    assert VanillaDiffusionConfig().resolved() == (128, 128)
    fast = FastDLLMConfig()
    assert {k: getattr(fast, k) for k in ("cache", "threshold", "factor", "steps", "block_length", "early_stop",
                                          "skip_completed_block_step", "window_queries", "requery_radius", "lookahead")} == {
        "cache": "dual", "threshold": 0.9, "factor": None, "steps": None, "block_length": 32, "early_stop": False,
        "skip_completed_block_step": False, "window_queries": "all", "requery_radius": 3, "lookahead": 0}  # fmt: skip
    bb = BlockBatchConfig()
    assert {k: getattr(bb, k) for k in ("block_sizes", "threshold", "factor", "merge", "merge_threshold", "sync",
                                        "sync_threshold", "refresh", "refresh_interval", "divergence_threshold",
                                        "early_stop", "eos_confidence", "skip_completed_block_step", "variant")} == {
        "block_sizes": [4, 8, 16, 32, 64, 128], "threshold": 0.9, "factor": None, "merge": True, "merge_threshold": 0.5,
        "sync": True, "sync_threshold": 8, "refresh": "periodic", "refresh_interval": 32, "divergence_threshold": 0.1,
        "early_stop": True, "eos_confidence": "completion", "skip_completed_block_step": False, "variant": "ours"}  # fmt: skip


def test_seed_takes_the_whole_64_bit_range_only():
    """``seed`` is hashed as 64 bits: 0 and 2**64 - 1 are seeds, 2**64 and -1 are refused by name."""
    for seed in (0, 2**64 - 1):
        FastDLLMConfig(seed=seed).validate()
    for seed in (2**64, -1):
        with pytest.raises(ValueError, match=r"seed must be None or an integer in \[0, 2\*\*64\)"):
            FastDLLMConfig(seed=seed)


def test_a_canvas_that_fills_the_context_exactly_decodes():
    """Prompt + max_new_tokens equal to the model's context fits (positions 0..context - 1); one more is refused,
    naming the prompt alone once the prompt fills the context by itself."""
    from types import SimpleNamespace

    from hf_blockbatch.generation.mixin import check_context

    config = SimpleNamespace(context_length=16)
    check_context(config, 8, 8)
    check_context(SimpleNamespace(context_length=None), 10**6, 10**6)  # no stated context: nothing to check
    with pytest.raises(ValueError, match=r"= 17 exceeds the model's context of 16 positions: shorten the prompt or lower"):
        check_context(config, 8, 9)
    with pytest.raises(ValueError, match=r"context of 16 positions: shorten the prompt\.$"):
        check_context(config, 16, 1)
    m = make_tiny_llada(max_sequence_length=16)
    assert m.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=16 - len(PROMPT),
                                                                                block_length=3)).shape == (1, 16)  # fmt: skip


def test_a_plain_config_that_samples_without_a_temperature_samples_at_1():
    """transformers' ``do_sample=True`` with the temperature left unset samples at 1.0, its default: the default
    decode takes that temperature (the diff of a plain config leaves the default out)."""
    from hf_blockbatch.generation.mixin import _from_model_defaults

    cfg = _from_model_defaults(GenerationConfig(do_sample=True, max_new_tokens=8))
    assert (type(cfg), cfg.do_sample, cfg.temperature, cfg.max_new_tokens) == (BlockBatchConfig, True, 1.0, 8)
    assert _from_model_defaults(GenerationConfig(do_sample=True, temperature=0.5)).temperature == 0.5
    assert _from_model_defaults(GenerationConfig(max_new_tokens=8)).do_sample is False


def test_padding_falls_back_to_the_first_eos_id():
    """With no pad id in the generation or model config, padding is the first EOS id, as transformers' generate
    takes ``eos_token_id[0]``; a given pad id wins, the generation config's before the model's."""
    from types import SimpleNamespace

    from hf_blockbatch.generation.mixin import _token_ids

    model_config = SimpleNamespace(mask_token_id=9, eos_token_id=[4, 3], pad_token_id=None)
    assert _token_ids(FastDLLMConfig(), model_config) == (9, [4, 3], 4)
    assert _token_ids(FastDLLMConfig(eos_token_id=[6, 5]), model_config) == (9, [6, 5], 6)
    model_config.pad_token_id = 7
    assert _token_ids(FastDLLMConfig(), model_config) == (9, [4, 3], 7)
    assert _token_ids(FastDLLMConfig(pad_token_id=8, mask_token_id=2), model_config) == (2, [4, 3], 8)


def test_special_ids_one_past_the_vocabulary_are_refused_before_any_forward(tiny_llada):
    """The mask, EOS and padding ids must index the embedding table: the id equal to its size is the first one
    outside, refused by name before any forward (as is -1)."""
    size = tiny_llada.get_input_embeddings().num_embeddings
    calls = _counting(tiny_llada)
    for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
        for bad in (size, -1):
            with pytest.raises(ValueError, match=rf"^{name}={bad} is outside this model's vocabulary of {size} ids"):
                tiny_llada.generate(torch.tensor([PROMPT]), generation_config=FastDLLMConfig(max_new_tokens=4), **{name: bad})
    assert calls["n"] == 0


def test_return_dict_in_generate_from_the_config_unless_the_call_says(tiny_llada):
    """A config's ``return_dict_in_generate=True`` returns the output object (sequences, NFE, stats), as in
    transformers; the call's own ``return_dict_in_generate`` wins either way."""
    from hf_blockbatch.generation.outputs import DiffusionGenerateOutput

    ids = torch.tensor([PROMPT])
    on, off = (FastDLLMConfig(max_new_tokens=4, block_length=4, return_dict_in_generate=flag) for flag in (True, False))
    out = tiny_llada.generate(ids, generation_config=on)
    assert isinstance(out, DiffusionGenerateOutput) and out.sequences.shape == (1, len(PROMPT) + 4)
    assert out.nfe.tolist() == [out.stats[0]["nfe"]]
    plain = tiny_llada.generate(ids, generation_config=on, return_dict_in_generate=False)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out.sequences)
    assert isinstance(tiny_llada.generate(ids, generation_config=off), torch.Tensor)
    assert isinstance(tiny_llada.generate(ids, generation_config=off, return_dict_in_generate=True), DiffusionGenerateOutput)


@pytest.mark.parametrize(("cls", "field", "others"), [
    ("FastDLLMConfig", "many_masks", dict(many_masks_threshold=0.8)),
    ("FastDLLMConfig", "requery_radius", dict(window_queries="sparse")),
    ("FastDLLMConfig", "refresh_after_commits", {}),
    ("FastDLLMConfig", "lookahead", {}),
    ("FastDLLMConfig", "lookahead_max_masks", dict(lookahead=2)),
    ("FastDLLMConfig", "lookahead_draft_radius", dict(lookahead=2, window_queries="sparse", lookahead_accept="contained")),
    ("BlockBatchConfig", "merge_agreement", {}),
    ("BlockBatchConfig", "sync_threshold", {}),
])  # fmt: skip
def test_every_integer_option_refuses_a_numpy_integer_saying_convert_it(cls, field, others):
    """A count computed with NumPy was refused with "must be an integer ..., got np.int64(2)", a message that
    contradicts itself, on these eight options; the others (max_new_tokens, seed, ...) say to convert it."""
    import numpy as np

    with pytest.raises(ValueError) as err:
        getattr(hb, cls)(max_new_tokens=8, **others, **{field: np.int64(2)}).validate()
    assert str(err.value) == f"{field} must be a Python int, got np.int64(2) (int64): convert it with int()."


def test_a_model_without_a_generation_config_decodes_blockbatch_at_its_defaults():
    """``model.generation_config = None`` (a model built by hand, or the attribute cleared): the default decode, as
    with a plain transformers config that sets nothing."""
    model, ids = make_tiny_llada(), torch.tensor([[5, 6, 7]])
    want = model.generate(ids, generation_config=hb.BlockBatchConfig(), return_dict_in_generate=True)
    model.generation_config = None
    got = model.generate(ids, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe)


def test_num_return_sequences_without_an_attention_mask_repeats_each_prompt_unpadded():
    """With no attention_mask, the repeated prompts get an all-ones mask: the same samples as passing one."""
    model, ids = make_tiny_llada(), torch.tensor([[5, 6, 7], [8, 9, 10]])
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, temperature=1.0, seed=3, num_return_sequences=2)
    got = model.generate(ids, generation_config=cfg)
    assert got.shape == (4, 11) and torch.equal(got[:, :3], ids.repeat_interleave(2, 0))
    assert torch.equal(got, model.generate(ids, torch.ones_like(ids), generation_config=cfg))


def test_an_empty_list_for_a_standard_option_asks_for_nothing():
    """transformers' list and dict options (``bad_words_ids``, ``sequence_bias``) set empty ask for nothing, as
    unset: accepted; set, refused by name, since no strategy here applies them."""
    hb.BlockBatchConfig(bad_words_ids=[], sequence_bias={}).validate()
    with pytest.raises(ValueError, match=r"^BlockBatchConfig does not use bad_words_ids=\[\[5\]\]"):
        hb.BlockBatchConfig(bad_words_ids=[[5]]).validate()


def test_token_ids_are_not_checked_against_a_model_that_names_no_vocabulary():
    """A contract model with neither an embedding accessor nor a config ``vocab_size``: nothing to check against."""
    from types import SimpleNamespace

    from hf_blockbatch.checks import check_token_ids, vocabulary_size

    model = SimpleNamespace(config=SimpleNamespace())
    assert vocabulary_size(model) is None
    assert check_token_ids(model, torch.tensor([[10**9, -1]])) is None


def test_a_model_that_names_no_vocabulary_decodes_without_the_id_checks():
    """A contract model with no embedding accessor and no config ``vocab_size``: generate's checks of the prompt's
    and the special tokens' ids have nothing to check against, and the decode is unchanged."""
    model, ids = make_tiny_llada(), torch.tensor([[5, 6, 7]])
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=4)
    want = model.generate(ids, generation_config=cfg)

    def no_accessor():
        raise NotImplementedError

    model.get_input_embeddings = no_accessor
    model.config.vocab_size = None
    assert torch.equal(model.generate(ids, generation_config=cfg), want)
