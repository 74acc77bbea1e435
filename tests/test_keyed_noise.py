"""Keyed sampling noise (``seed``, hf_blockbatch/generation/noise.py): the hash itself, the law of what it samples,
and what it is for: a request decodes the same samples alone or in any batch, and with exact sparse drafts as
without them."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from _generation_helpers import eos_model, homogeneity_p, peaked, run_padded
from conftest import MASK_ID, load_benchmark, make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb
from hf_blockbatch.generation import noise, sampling

M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """C. Wellons' lowbias32 in Python's exact integers."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0xD35A2D97) & M32
    return x ^ (x >> 15)


def _inverse_lowbias32(h: int) -> int:
    """The 32-bit input that :func:`_lowbias32` maps to ``h`` (it is a bijection): each step undone in reverse."""
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(0xD35A2D97, -1, 2**32)) & M32
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(0x21F0AAAD, -1, 2**32)) & M32
    return h ^ (h >> 16)


def test_the_hash_is_lowbias32_in_exact_integers():
    """The in-place int64 hash (whose products pass 2^63 and wrap) and the int32 one (whose shifts copy the sign bit
    and whose products wrap at 2^31) give Python's exact numbers, for every 32-bit edge and 2,000 random values, and
    the uniforms are those numbers plus a half over 2^32."""
    rng = random.Random(0)
    values = [0, 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 2, M32] + [rng.randrange(2**32) for _ in range(2000)]
    assert noise.mix32(torch.tensor(values)).tolist() == [_lowbias32(v) for v in values]
    # the vocabulary-wide hash, on int32 bit patterns (negative where the top bit is set): the same bits
    bits = noise._mix32_bits(torch.tensor(values).to(torch.int32))
    assert (bits.long() & M32).tolist() == [_lowbias32(v) for v in values]
    # an int32 tensor gave another hash (its products wrap at 2^31, its shifts copy the sign bit): refused
    with pytest.raises(TypeError, match="mix32 hashes an int64 tensor in place, got torch.int32"):
        noise.mix32(torch.tensor(values[:8]).to(torch.int32))
    keys = torch.tensor(values[:40])
    got = noise.uniform(keys, 7)
    want = [[(_lowbias32(k ^ _lowbias32(v + noise._TOKEN)) + 0.5) / 2**32 for v in range(7)] for k in values[:40]]
    assert got.tolist() == want
    assert float(got.min()) > 0.0 and float(got.max()) < 1.0


def test_the_row_slot_and_confidence_keys_are_their_parts_hashed_in_exact_integers():
    """Each key part is taken in as ``lowbias32(key ^ lowbias32(part + offset))``, with the part's own offset: a
    row's lane, then a slot's step and its offset in the generated region, in that order; random remasking's
    confidence of a slot is its key with the confidence part taken in (0), as a uniform. These numbers are what a
    seeded decode draws, so Python's exact integers pin them."""

    def absorb(key: int, part: int, offset: int) -> int:
        return _lowbias32(key ^ _lowbias32((part + offset) & M32))

    rng = random.Random(1)
    keys, steps, offsets = ([rng.randrange(2**32) for _ in range(50)] + [0, M32] for _ in range(3))
    lanes = [rng.randrange(4) for _ in range(52)]
    t = torch.tensor
    assert noise.lane_keys(t(keys), t(lanes)).tolist() == [absorb(k, b, noise._LANE) for k, b in zip(keys, lanes)]
    slots = noise.slot_keys(t(keys), t(steps), t(offsets)).tolist()
    assert slots == [absorb(absorb(k, s, noise._STEP), o, noise._POSITION) for k, s, o in zip(keys, steps, offsets)]
    got = noise.confidence_uniform(t(keys)).tolist()
    assert got == [(absorb(k, 0, noise._CONFIDENCE) + 0.5) / 2**32 for k in keys]


def test_keyed_uniforms_are_uniform_and_independent():
    """2^18 uniforms of 4,096 slots (consecutive steps and positions of one row) × 64 token ids: the 64 bins of a
    chi-square test hold them evenly, and neighbouring token ids, positions and steps are uncorrelated (a hash that
    passed its input through would correlate them fully)."""
    row = noise.lane_keys(noise.request_keys(3, torch.tensor([[5, 6, 7]]), torch.ones(1, 3)), torch.zeros(1, dtype=torch.long))
    step, offset = torch.arange(64).repeat_interleave(64), torch.arange(64).repeat(64)
    u = noise.uniform(noise.slot_keys(row.expand(4096), step, offset), 64)  # [4096 slots, 64 ids]
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    stat = float(((counts - u.numel() / 64) ** 2 / (u.numel() / 64)).sum())
    assert float(torch.special.gammaincc(torch.tensor(31.5, dtype=torch.float64), torch.tensor(stat / 2))) > 1e-4
    grid = u.view(64, 64, 64)  # [step, position, token id]
    for a, b in [(grid[..., :-1], grid[..., 1:]), (grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])]:
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.02


def test_request_keys_follow_the_prompt_not_the_batch():
    """A request's key is its prompt's (padding ignored), with its copy number among identical prompts: the same
    in any batch, different for another prompt, a reordered prompt, another seed or a later copy."""
    def keys(prompts: list[list[int]], seed: int = 1) -> list[int]:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return noise.request_keys(seed, ids, mask).tolist()

    alone = keys([[5, 6, 7]])[0]
    batch = keys([[9, 9, 9, 9, 9], [5, 6, 7], [7, 6, 5], [5, 6, 7], [6, 7]])
    assert batch[1] == alone and batch[3] != alone  # the second copy draws apart
    assert len({alone, batch[0], batch[2], batch[3], batch[4], keys([[5, 6, 7]], seed=2)[0]}) == 6


def test_copy_numbers_count_the_identical_prompts_before():
    """A request's copy number is how many identical (padded) prompts come before it in the batch: against a
    pure-Python count on 300 random batches of small rows, where repeats are common."""
    rng = random.Random(3)
    for _ in range(300):
        rows = torch.tensor([[rng.randrange(-1, 3) for _ in range(4)] for _ in range(rng.randint(1, 12))])
        expected = [sum(rows[j].tolist() == rows[i].tolist() for j in range(i)) for i in range(rows.shape[0])]
        assert noise._copy_numbers(rows).tolist() == expected


def _decoders() -> dict[str, hb.DiffusionGenerationConfig]:
    """One config of every decoder that samples, with a seed."""
    fd = dict(max_new_tokens=16, block_length=8, threshold=0.9, seed=11)
    sparse = dict(window_queries="sparse", requery_radius=3)
    return {
        "vanilla": hb.VanillaDiffusionConfig(max_new_tokens=16, steps=16, block_length=8, temperature=0.7, seed=11),
        "vanilla-random": hb.VanillaDiffusionConfig(max_new_tokens=16, steps=16, block_length=8, remasking="random",
                                                    seed=11),  # fmt: skip
        "fast-dllm": hb.FastDLLMConfig(**fd, temperature=0.7),
        "fast-dllm-random-remasking": hb.FastDLLMConfig(**fd, temperature=1.0, remasking="random"),
        "sparse": hb.FastDLLMConfig(**fd, **sparse, temperature=0.7),
        "drafted": hb.FastDLLMConfig(**fd, **sparse, temperature=0.7, lookahead=3),
        "drafted-contained": hb.FastDLLMConfig(**fd, **sparse, temperature=0.7, lookahead=3, lookahead_accept="contained"),
        "drafted-runner-up": hb.FastDLLMConfig(**fd, **sparse, temperature=0.7, lookahead=3, lookahead_runner_up=True),
        "blockbatch": hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[4, 8, 16], temperature=0.7, seed=11),
        "blockbatch-lean": hb.BlockBatchConfig.lean(max_new_tokens=16, block_sizes=[4, 16], temperature=0.7, seed=11),
    }


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("decoder", sorted(_decoders()))
def test_seeded_decodes_are_the_same_alone_or_in_a_batch(family, decoder):
    """With a seed, each request of a left-padded batch (prompts of 1-6 tokens, one prompt twice) decodes the
    tokens, forwards and stats it decodes alone; the second copy of a prompt is a second sample, so it decodes as
    that copy does in a batch of the two copies. Run twice, the batch decodes the same."""
    model = eos_model(family)
    cfg = _decoders()[decoder]
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [5, 6, 7]]
    out = run_padded(model, prompts, cfg)
    assert torch.equal(out.sequences, run_padded(model, prompts, cfg).sequences)
    for i, p in enumerate(prompts[:3]):
        alone = run_padded(model, [p], cfg)
        assert out.sequences[i, -16:].tolist() == alone.sequences[0, -16:].tolist(), (decoder, i)
        assert int(out.nfe[i]) == int(alone.nfe[0])
        assert out.stats[i].get("lookahead_adopted", 0) == alone.stats[0].get("lookahead_adopted", 0)
    copies = run_padded(model, [prompts[0], prompts[0]], cfg)
    assert out.sequences[3, -16:].tolist() == copies.sequences[1, -16:].tolist()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_seeded_drafts_decode_the_same_samples(family):
    """With a seed, exact drafts draw the noise of the step they stand for and are adopted only as their parent's
    next step, so the decoder with drafts decodes the samples of the decoder without them (not only their law): the
    same tokens, and NFE + adopted = the plain NFE, for every request of 12 random settings (sampling at 0.5 or 1,
    1-6 drafts, runner-up drafts or not, dense steps or sparse ones at radius 0-6, early stop or not, padded batches of
    1-8 prompts), whose first request decodes alone as in its batch. Drafts are adopted. The seeds draw a dense
    setting where a two-token draft matched the very next step (adopting it there, as before, decoded other
    samples)."""
    assert _check_seeded_samples(peaked(family), seed={"llada": 27, "dream": 9}[family]) > 100


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_seeded_samples_sweep(family):
    """The check above on ``HB_SWEEP_SEEDS`` seeds of 12 settings each (default 24, from ``HB_SWEEP_SEED``,
    default 5000; ``pytest -m slow``), on a float64 model: a padded batch's float32 forward is not bit-identical to
    a row's alone, and a near tie of two noisy scores could then sample differently (as a greedy near tie commits
    differently, RESULTS §22); in float64 a failure is the decoder's."""
    import os

    model = peaked(family).double()
    first = int(os.environ.get("HB_SWEEP_SEED", "5000"))
    for seed in range(first, first + int(os.environ.get("HB_SWEEP_SEEDS", "24"))):
        _check_seeded_samples(model, seed)


def _check_seeded_samples(model, seed: int, settings: int = 12) -> int:
    """``settings`` random seeded settings drawn from ``seed`` (see the test above); returns the drafts adopted."""
    rng, spare, adopted = random.Random(seed), random.Random(seed + 2), 0  # runner-up drafts: their own draws
    for trial in range(settings):
        prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 8))]
        options = dict(max_new_tokens=rng.choice([13, 24]), block_length=rng.choice([4, 8, 16]),
                       threshold=rng.choice([0.5, 0.9]), temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(2**40),
                       early_stop=rng.random() < 0.5)  # fmt: skip
        if rng.random() < 0.5:  # sparse steps (else dense: every step queries its whole window)
            options.update(window_queries="sparse", requery_radius=rng.choice([0, 3, 6]))
        plain = run_padded(model, prompts, hb.FastDLLMConfig(**options))
        k = rng.randint(1, 6)
        drafts = hb.FastDLLMConfig(**options, lookahead=k, lookahead_runner_up=k >= 3 and spare.random() < 0.5)
        drafted = run_padded(model, prompts, drafts)
        took = torch.tensor([st["lookahead_adopted"] for st in drafted.stats])
        assert torch.equal(plain.sequences, drafted.sequences), (seed, trial, options)
        assert torch.equal(plain.nfe, drafted.nfe + took), (seed, trial, options)
        alone = run_padded(model, prompts[:1], drafts)
        G = options["max_new_tokens"]
        assert alone.sequences[0, -G:].tolist() == drafted.sequences[0, -G:].tolist(), (seed, trial, options)
        adopted += int(took.sum())
    return adopted


def test_keyed_sampling_draws_the_samplers_law():
    """2,000 copies of one prompt decoded with a seed (each copy its own sample) against 2,000 draws from a
    generator: one distribution of (sequence, NFE) by a chi-square test, while the same test tells temperature 0.7
    from 0.8 apart (its power). A seed picks samples; it must not change their law."""
    model = peaked("llada")
    ids = torch.tensor([[5, 6, 7]] * 2000)

    def draws(temperature: float = 0.7, **how) -> Counter:
        cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=8, threshold=0.9, temperature=temperature,
                                window_queries="sparse", seed=how.pop("seed", None))  # fmt: skip
        out = model.generate(ids, generation_config=cfg, return_dict_in_generate=True, **how)
        assert not bool((out.sequences == MASK_ID).any())
        return Counter(map(tuple, torch.cat([out.sequences[:, 3:], out.nfe[:, None]], 1).tolist()))

    keyed = draws(seed=0)
    assert homogeneity_p(keyed, draws(generator=torch.Generator().manual_seed(1))) > 1e-3
    assert homogeneity_p(keyed, draws(0.8, seed=1)) < 1e-5


def test_a_seed_is_a_sample():
    """Another seed draws other samples (8 prompts at temperature 1: some decode differently); greedy decoding
    with a seed is greedy decoding."""
    model = make_tiny_dream()
    prompts = [[i, i + 1, i + 2] for i in range(5, 13)]
    a, b = (run_padded(model, prompts, hb.FastDLLMConfig(max_new_tokens=12, block_length=4, temperature=1.0, seed=s))
            for s in (0, 1))  # fmt: skip
    assert not torch.equal(a.sequences, b.sequences)
    greedy = hb.FastDLLMConfig(max_new_tokens=12, block_length=4)
    model = make_tiny_llada()
    assert torch.equal(run_padded(model, prompts, greedy).sequences,
                       run_padded(model, prompts, hb.FastDLLMConfig(max_new_tokens=12, block_length=4, seed=3)).sequences)  # fmt: skip


def test_the_seed_saves_and_loads(tmp_path):
    """``seed`` is a config field: saved, loaded, and taken as ``generate()``'s keyword too."""
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, temperature=0.7, seed=2**40 + 3)
    cfg.save_pretrained(tmp_path)
    loaded = hb.FastDLLMConfig.from_pretrained(tmp_path)
    assert loaded.seed == 2**40 + 3
    model, ids = make_tiny_llada(), torch.tensor([[5, 6, 7]])
    assert torch.equal(model.generate(ids, generation_config=loaded), model.generate(ids, generation_config=cfg))
    plain = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, temperature=0.7)
    assert torch.equal(model.generate(ids, generation_config=plain, seed=2**40 + 3), model.generate(ids, generation_config=cfg))


# ----------------------------------------------------------------------------- pruned keyed draws
def _counting(fn, calls: list):
    """``fn``, noting each call in ``calls``."""

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def _draws(logits: torch.Tensor, temperature: float, keys: torch.Tensor, mask_id: int | None, monkeypatch) -> tuple:
    """The keyed draw pruned (every share allowed) and over the whole vocabulary, and whether the pruned one
    scored the whole vocabulary."""
    full_draws = []
    with monkeypatch.context() as mp:
        mp.setattr(sampling, "_full_draw", _counting(sampling._full_draw, full_draws))
        mp.setattr(sampling, "PRUNED_DRAW_MIN_NUMEL", 0)
        mp.setattr(sampling, "SCREENED_DRAW_MIN_NUMEL", 0)
        pruned = sampling.gumbel_tokens(logits, temperature, None, keys, mask_id, max_share=1.0)
    return pruned, sampling.gumbel_tokens(logits, temperature, None, keys, mask_id, max_share=0.0), bool(full_draws)


def _draw_settings(scales: tuple[float, ...], mask_on_top: bool = False):
    """150 keyed draws of 400 rows to check against the full draw, as ``((V, scale, T, dtype), logits, keys)``:
    vocabularies 96 and 1,024, the logit ``scales``, temperatures 0.05-2, float32, bfloat16 and float64 logits, -inf
    logits, mask id 7 just below each row's top logit (within any spread: never drawn all the same), and with
    ``mask_on_top`` above it in 37 rows. Drawn from torch's global generator (the caller seeds it)."""
    for V in (96, 1024):
        for scale in scales:
            for t in (0.05, 0.2, 0.5, 1.0, 2.0):
                for dtype in (torch.float32, torch.bfloat16, torch.float64):
                    logits = torch.randn(400, V) * scale
                    logits[:3, 5] = float("-inf")
                    logits[:, 7] = logits.index_fill(1, torch.tensor([7]), float("-inf")).amax(-1) - 0.01 * scale
                    if mask_on_top:
                        logits[3:40, 7] += 0.5 * scale
                    yield (V, scale, t, dtype), logits.to(dtype), torch.randint(0, 2**32, (400,))


def test_a_pruned_keyed_draw_is_the_full_draw(monkeypatch):
    """Only ids within the noise's spread of a row's top logit can win a keyed draw, so scoring those alone picks
    the full draw's tokens: 150 settings of 400 rows (vocabularies 96 and 1,024, logit scales 1-1,000, temperatures
    0.05-2, float32, bfloat16 and float64 logits, -inf logits, a mask id just below the top logit, never drawn). On
    the peaked settings the pruned draw ran without the full one; on the flat ones it kept most ids (then it is the
    full draw anyway)."""
    torch.manual_seed(0)
    pruned_runs = 0
    for (V, scale, t, dtype), logits, keys in _draw_settings((1.0, 5.0, 20.0, 100.0, 1000.0)):
        pruned, full, whole = _draws(logits, t, keys, 7, monkeypatch)
        assert torch.equal(pruned, full), (V, scale, t, dtype)
        assert not bool((pruned == 7).any())
        pruned_runs += not whole
        if scale / t >= 100:  # a peaked draw: pruned
            assert not whole, (V, scale, t, dtype)
    assert pruned_runs >= 60


def test_a_pruned_keyed_draw_keeps_an_id_only_the_least_noise_on_the_top_id_lets_win(monkeypatch):
    """The bound is the noise's full spread, both ends: an id whose logit lies further below the top logit than
    the largest noise can lift it (22.9 T) still wins when the top id draws noise below zero. The key is built
    (by inverting the hash) so that the low id draws the largest uniform there is, and its logit is set so that it
    wins by 1e-3: a bound without the least noise's term drops it."""
    t, V, low = 0.5, 64, 10
    part = _lowbias32(low + noise._TOKEN)
    key = _inverse_lowbias32(M32) ^ part  # key ^ part hashes to 2^32 - 1: the low id's uniform is UNIFORM_MAX
    keys = torch.tensor([key])
    u = noise.uniform(keys, V)[0]
    assert float(u[low]) == noise.UNIFORM_MAX
    top = next(i for i in range(V) if i != low and float(u[i]) < 0.3)  # an id whose noise is below zero
    lift = [-t * torch.log(-torch.log(u[i])).item() for i in (low, top)]
    logits = torch.full((1, V), -1000.0, dtype=torch.float64)
    logits[0, top] = 0.0
    logits[0, low] = lift[1] - lift[0] + 1e-3
    assert -logits[0, low] > lift[0]  # further below the top logit than the largest noise lifts
    pruned, full, whole = _draws(logits, t, keys, None, monkeypatch)
    assert int(full) == low and int(pruned) == low and not whole
    logits[0, low] -= 2e-3  # and the top id wins when the low one falls short
    pruned, full, whole = _draws(logits, t, keys, None, monkeypatch)
    assert int(full) == top and int(pruned) == top and not whole


def test_a_pruned_keyed_draw_leaves_non_finite_rows_to_the_full_draw(monkeypatch):
    """A NaN or +inf logit, a row of -inf but one id, a row of -inf: the same ids as the full draw."""
    logits = torch.randn(40, 1000) * 10
    logits[0, 3] = float("nan")
    logits[1, 4] = float("inf")
    logits[2] = float("-inf")
    logits[2, 9] = 0.0
    logits[3] = float("nan")
    logits[4] = float("-inf")
    keys = torch.randint(0, 2**32, (40,), generator=torch.Generator().manual_seed(0))
    pruned, full, _ = _draws(logits, 0.5, keys, None, monkeypatch)
    assert torch.equal(pruned, full) and pruned[:3].tolist() == [3, 4, 9]


def test_a_screened_keyed_draw_is_the_full_draw():
    """The noise screen scores an id only where its noise can still lift it to a score its row reaches, so it picks
    the full draw's tokens: the 150 settings of the pruned draw's test, run through the screen itself (every share
    allowed), and rows whose top logit is the mask id's. On flat rows, where the logit bound keeps most ids, it keeps
    a few percent."""
    torch.manual_seed(1)
    for (V, scale, t, dtype), logits, keys in _draw_settings((0.3, 1.0, 5.0, 20.0, 1000.0), mask_on_top=True):
        screened = sampling._screened_draw(logits, t, noise.uniform_codes(keys, V), 7, 1.0)
        full = sampling.gumbel_tokens(logits, t, None, keys, 7, max_share=0.0)
        assert screened is not None and torch.equal(screened, full), (V, scale, t, dtype)
        assert not bool((screened == 7).any())
        if V == 1024 and scale <= 1.0 and t >= 0.5:  # flat: the screen keeps few ids
            assert sampling._screened_draw(logits, t, noise.uniform_codes(keys, V), 7, 0.05) is not None


@pytest.mark.parametrize("level", [0, 1])
def test_a_screened_keyed_draw_keeps_an_id_just_below_a_level_that_wins(level):
    """Each of the screen's levels bounds the lift of the codes below it, both ways: an id one code below the level,
    whose logit is below the top logit and lets it win by 1e-3, is kept and wins (its key built by inverting the
    hash); with 2e-3 less it loses to the top id. A level whose lift were rounded down by more than 1e-3 / T would
    drop it."""
    t, V, low = 0.5, 64, 10
    code = sampling._SCREEN_CODES[level] - 1
    part = _lowbias32(low + noise._TOKEN)
    key = _inverse_lowbias32(code + 2**31) ^ part  # the low id's code: one below the level
    keys = torch.tensor([key])
    codes = noise.uniform_codes(keys, V)
    assert int(codes[0, low]) == code
    u = noise.code_uniforms(codes)[0]
    top = next(i for i in range(V) if i != low and float(u[i]) < 0.3)  # a top logit whose noise is below zero
    lift = [-torch.log(-torch.log(u[i])).item() for i in (low, top)]
    assert lift[0] < sampling._SCREEN_LIFTS[level] < lift[0] + 1e-6
    logits = torch.full((1, V), -1000.0, dtype=torch.float64)
    logits[0, top] = 0.0
    logits[0, low] = t * (lift[1] - lift[0]) + 1e-3
    assert float(logits[0, low]) < 0.0  # below the top logit
    for margin, winner in ((0.0, low), (-2e-3, top)):
        lg = logits.clone()
        lg[0, low] += margin
        full = sampling.gumbel_tokens(lg, t, None, keys, None, max_share=0.0)
        screened = sampling._screened_draw(lg, t, codes, None, 1.0)
        assert int(full) == winner and screened is not None and int(screened) == winner


def test_a_screened_keyed_draw_leaves_non_finite_rows_to_the_full_draw():
    """A NaN, an infinite or an all -inf row: the screen declines, and the default draw is still the full draw's."""
    keys = torch.randint(0, 2**32, (40,), generator=torch.Generator().manual_seed(0))
    for fill in (float("nan"), float("inf")):
        logits = torch.randn(40, 1000) * 0.5
        logits[5, 3] = fill
        assert sampling._screened_draw(logits, 1.0, noise.uniform_codes(keys, 1000), None, 1.0) is None
    logits = torch.randn(40, 1000) * 0.5
    logits[6] = float("-inf")
    assert sampling._screened_draw(logits, 1.0, noise.uniform_codes(keys, 1000), None, 1.0) is None


def test_hot_seeded_draws_go_through_the_screen(monkeypatch):
    """At T 1 the tiny vocabularies' logit bound keeps most ids, so the default draw hashes every id and screens it:
    the same tokens as the full draw, on rows of a flat and of a peaked distribution, without scoring every id."""
    g = torch.Generator().manual_seed(3)
    for scale in (0.5, 4.0):
        logits = torch.randn(64, 1024, generator=g) * scale
        keys = torch.randint(0, 2**32, (64,), generator=g)
        screened, full_draws = [], []
        with monkeypatch.context() as mp:
            mp.setattr(sampling, "_screened_draw", _counting(sampling._screened_draw, screened))
            mp.setattr(sampling, "SCREENED_DRAW_MIN_NUMEL", 0)
            mp.setattr(sampling, "_full_draw", _counting(sampling._full_draw, full_draws))
            got = sampling.gumbel_tokens(logits, 1.0, None, keys, 1023)
        assert screened and not full_draws, scale
        assert torch.equal(got, sampling.gumbel_tokens(logits, 1.0, None, keys, 1023, max_share=0.0))


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("way", ["pruned", "screened"])
def test_seeded_decodes_are_the_same_with_pruned_or_screened_draws(family, way, monkeypatch):
    """Sampled decodes with a seed (sparse Fast-dLLM and the contained drafts, T 0.3 and 1.0, a peaked model)
    decode the same sequences, with the same forwards, with each draw over the whole vocabulary as with each draw
    pruned by the logit bound (some draws were), or as with each draw through the noise screen (the bound made to
    keep every id; the screen decided draws)."""
    model = peaked(family)
    prompts = [[i, i + 1, i + 2] for i in range(5, 13)]
    full_draws, draws, decided, screened_draw = [], [], [], sampling._screened_draw

    def screen(*args):
        tokens = screened_draw(*args)
        decided.append(tokens is not None)
        return tokens

    patches = {"PRUNED_DRAW_MIN_NUMEL": 0, "_full_draw": _counting(sampling._full_draw, full_draws),
               "gumbel_tokens": _counting(sampling.gumbel_tokens, draws)}  # fmt: skip
    if way == "pruned":
        patches["PRUNED_DRAW_MAX_SHARE"] = 1.0
    else:
        patches.update(SCREENED_DRAW_MIN_NUMEL=0, PRUNED_DRAW_MAX_SHARE=0.5, _screened_draw=screen,
                       keyed_floor=lambda logits, _: torch.full(logits.shape[:1], float("-inf")))  # fmt: skip
    for t in (0.3, 1.0):
        for cfg in (hb.FastDLLMConfig(max_new_tokens=16, block_length=8, temperature=t, seed=4, window_queries="sparse"),
                    hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=16, block_length=8, temperature=t, seed=4)):
            with monkeypatch.context() as mp:
                mp.setattr(sampling, "PRUNED_DRAW_MAX_SHARE", 0.0)
                full = run_padded(model, prompts, cfg)
            with monkeypatch.context() as mp:
                for name, value in patches.items():
                    mp.setattr(sampling, name, value)
                before = len(full_draws), len(draws), sum(decided)
                got = run_padded(model, prompts, cfg)
            assert torch.equal(got.sequences, full.sequences) and torch.equal(got.nfe, full.nfe), (t, cfg)
            if way == "pruned":  # some draws were pruned
                assert len(full_draws) - before[0] < len(draws) - before[1], (t, cfg)
            else:
                assert sum(decided) > before[2], (t, cfg)


def test_the_keyed_draw_benchmark_replays_real_draws():
    """``benchmarks/keyed_draw.py`` records the keyed draws of a seeded decode of training items (logits, keys, the
    mask id), times them both ways and counts which way decided each; on flat rows the noise screen decides, keeping
    a few percent of the ids, and picks the full draw's tokens."""
    bench = load_benchmark("keyed_draw")
    model, tokenizer = hb.load_model("tiny-llada", device="cpu")
    draws = bench.capture(model, tokenizer, "lists", 2, 0.5, 2)
    assert draws and all(k.shape == (lg.shape[0],) and m == model.config.mask_token_id for lg, k, m in draws)
    assert sampling.gumbel_tokens is not None and sampling.gumbel_tokens.__name__ == "gumbel_tokens"  # put back
    row = bench.timed(draws, 0.5, 1)
    assert row["same_tokens"] and row["draws"] == len(draws) and sum(row["decided"].values()) == len(draws)
    assert sampling._screened_draw.__name__ == "_screened_draw" and sampling._full_draw.__name__ == "_full_draw"
    flat = bench.timed(bench.flat(32, 8192), 1.0, 1)  # an untrained model's rows: the logit bound keeps every id
    assert flat["same_tokens"] and flat["kept_share"] > 0.99 and flat["screened_share"] < 0.03
    assert flat["decided"] == {"by_bound": 0, "screened": 1, "full": 0}
    row = bench.timed(bench.synthetic(8, 4096), 0.5, 1)
    assert row["same_tokens"] and row["kept_share"] < 0.05


def test_the_noise_designs_benchmark_measures_what_it_says():
    """``benchmarks/noise_designs.py``'s two designs: the block-maxima uniforms are independent uniforms in law (their
    mean, their lower tail, each block's maximum and where it sits), its pruned draw picks its full draw's tokens and
    prunes flat and peaked rows; the inverse-CDF draw never picks the mask id and follows the softmax at T."""
    bench, replayed = load_benchmark("noise_designs"), load_benchmark("keyed_draw")
    keys = torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0))
    top, at = bench._block_noise(keys, 16)
    u = bench._block_uniforms(noise.uniform(keys, 1024).view(-1, bench.BLOCK), top.view(-1), at.view(-1))
    assert abs(float(u.mean()) - 0.5) < 2e-3 and abs(float((u < 0.1).double().mean()) - 0.1) < 2e-3
    # the maximum of 64 uniforms: P(max <= x) = x^64
    assert abs(float((top <= 0.99).double().mean()) - 0.99**64) < 0.01
    assert torch.equal(u.argmax(-1), at.view(-1)) and abs(float(at.double().mean()) - 31.5) < 0.5
    for draws in (replayed.flat(8, 8192), replayed.synthetic(4, 126464)):
        for t in (0.5, 1.0):
            logits, k, _ = draws[0]
            tokens, pruned = bench.block_draw(logits, t, k, 3)
            assert pruned and torch.equal(tokens, bench.block_full_draw(logits, t, k, 3)) and not bool((tokens == 3).any())
    # the inverse CDF at T 0.5: 20,000 draws of one row of 8 ids, the mask id (the likeliest) never drawn
    logits = torch.tensor([[1.0, 0.5, 0.0, 3.0, -0.5, 0.2, 0.8, -1.0]]).expand(20000, -1)
    keys = torch.randint(0, 2**32, (20000,), generator=torch.Generator().manual_seed(1))
    tokens = bench.cdf_draw(logits, 0.5, keys, mask_id=3)
    p = (logits[0] / 0.5).softmax(-1).index_fill(0, torch.tensor([3]), 0.0)
    freq = torch.bincount(tokens, minlength=8).double() / 20000
    assert freq[3] == 0 and torch.allclose(freq, (p / p.sum()).double(), atol=0.01)


def test_a_pruned_draw_breaks_a_tie_by_the_first_id_as_the_full_draw_does():
    """A pruned or screened draw scores only some (row, id) pairs, then takes each row's best: on a tie the first id,
    which is what the full draw's row max picks, whatever the order of the pairs' ids; a row without a finite score
    is left to the full draw (None)."""
    rows, ids = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([2, 5, 7, 1, 3])
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    assert sampling._first_best(rows, ids, scores, 2, 10).tolist() == [5, 1]
    assert sampling.row_max(torch.tensor([[0.0, 3.0, 3.0], [2.0, 2.0, 0.0]]))[1].tolist() == [1, 0]  # the same rule
    assert sampling._first_best(rows, ids, scores.index_fill(0, torch.tensor([3, 4]), -float("inf")), 2, 10) is None


def test_keyed_floor_keeps_a_bounded_number_of_temperatures():
    """Each temperature a keyed draw runs at gave the noise's spread a cache entry kept for the process's life: a
    server whose clients ask for any temperature grew it by about 200 bytes per value, without bound."""
    from hf_blockbatch.generation.sampling import SPREADS_CACHED, _spread, keyed_floor

    _spread.cache_clear()
    logits = torch.tensor([[0.0, 1.0, 3.0]])
    for i in range(4 * SPREADS_CACHED):
        t = 0.5 + i / 1024
        assert keyed_floor(logits, t).item() < 3.0 - 26.0 * t  # below the top logit less the spread (26.0 T)
    assert _spread.cache_info().currsize == SPREADS_CACHED
    assert keyed_floor(logits, 0.5).item() == keyed_floor(logits, 0.5).item()
