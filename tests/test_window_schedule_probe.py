"""``benchmarks/window_schedule_probe.py``: sliding windows (after DSB) against fixed blocks, RESULTS §35.

The windows must be the ones the schedules define, every commit must fall inside its step's window, the
prompt must stay as given, and a decode must end with an answer that holds no mask before its end token;
``fixed`` must be the probe's baseline loop itself, so that the ratios compare schedules, not loops.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark

import hf_blockbatch as hb
from hf_blockbatch.eval.runner import _encode, load_task
from hf_blockbatch.generation.outputs import end_token_ids

rules_probe = load_benchmark("commit_rules_probe")  # the schedules' probe imports its loop and summary from it
probe = load_benchmark("window_schedule_probe")


def masks(spec: str) -> torch.Tensor:
    return torch.tensor([c == "m" for c in spec])


@pytest.mark.parametrize(
    ("canvas", "spec", "expected"),
    [
        ("ddmdmmdmmm", "sliding:4", (2, 6)),  # four positions from the first mask
        ("ddmdmmdmmm", "sliding:16", (2, 10)),  # clipped at the end
        ("ddmdmmdmmm", "masks:3", (2, 6)),  # first to third mask: the decoded ones between count for nothing
        ("ddmdmmdmmm", "masks:3:3", (2, 5)),  # capped at three positions
        ("ddmdmmdmmm", "masks:9", (2, 10)),  # fewer masks than asked: every one
        ("dddddddddm", "masks:2", (9, 10)),
    ],
)
def test_windows_are_the_schedules(canvas: str, spec: str, expected: tuple[int, int]) -> None:
    assert probe.window(masks(canvas), probe.Schedule.parse(spec)) == expected


@pytest.mark.parametrize("spec", ["slide:4", "sliding", "sliding:0", "sliding:4:8", "masks:4:0", "fixed:x", "masks:1:2:3"])
def test_a_misspelt_schedule_says_how_to_write_one(spec: str) -> None:
    with pytest.raises(ValueError, match="write fixed:B, sliding:B or masks:B"):
        probe.Schedule.parse(spec)


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def loaded(request):
    model, tokenizer = hb.load_model(request.param, device="cpu")
    return model, tokenizer, torch.tensor(end_token_ids(tokenizer, model.config))


@torch.inference_mode()
@pytest.mark.parametrize("spec", ["sliding:16", "masks:8", "masks:8:12"])
def test_sliding_decodes_commit_inside_their_windows(loaded, spec: str) -> None:
    model, tokenizer, end = loaded
    schedule = probe.Schedule.parse(spec)
    task = load_task("lists")
    mask_id = model.config.mask_token_id
    for item in task.items("train", limit=3):
        ids, _ = _encode(tokenizer, [task.prompt(item, tokenizer, chat=True)], torch.device("cpu"))
        P, gen = ids.shape[1], int(task.default_gen_length)
        steps: list = []
        x, nfe, queries = probe.decode(model, ids, gen, schedule, mask_id, end, steps=steps)
        assert nfe == len(steps) and queries == nfe * (P + gen)
        assert torch.equal(x[0, :P], ids[0])
        canvas = torch.full((gen,), mask_id)
        for s, e, committed in steps:
            masked = canvas == mask_id
            assert (s, e) == probe.window(masked, schedule) and bool(masked[s])  # the window starts at the first mask
            assert committed and all(s <= p < e and bool(masked[p]) for p in committed)  # at least one, each a mask inside
            canvas[committed] = x[0, P + torch.tensor(committed)]
        assert torch.equal(canvas, x[0, P:])  # nothing changed but the commits
        gen_x = x[0, P:]
        first_end = int(torch.isin(gen_x, end).byte().argmax()) if bool(torch.isin(gen_x, end).any()) else gen
        assert not bool((gen_x[:first_end] == mask_id).any())  # no mask before the end token


@torch.inference_mode()
def test_fixed_is_the_rules_probes_baseline(loaded) -> None:
    model, tokenizer, end = loaded
    task = load_task("code")
    item = task.items("train", limit=1)[0]
    ids, _ = _encode(tokenizer, [task.prompt(item, tokenizer, chat=True)], torch.device("cpu"))
    gen = int(task.default_gen_length)
    ours = probe.decode(model, ids, gen, probe.Schedule.parse("fixed:32"), model.config.mask_token_id, end)
    theirs = rules_probe.decode(model, ids, gen, 32, rules_probe.Rule.parse(rules_probe.BASELINE), model.config.mask_token_id, end)
    assert torch.equal(ours[0], theirs[0]) and ours[1:] == theirs[1:]


def test_main_refuses_a_split_a_later_suite_lacks_before_any_decode(tmp_path, monkeypatch, capsys) -> None:
    """As the rules' probe: ``--suites arith gsm8k`` was refused when gsm8k's turn came, after arith had decoded."""
    from hf_blockbatch.eval.script_args import run_main

    monkeypatch.setattr(probe, "decode", lambda *a, **k: pytest.fail("a decode ran before the refusal"))
    status = run_main(lambda: probe.main(["--model", "tiny-llada", "--suites", "arith", "gsm8k", "--limit", "2",
                                          "--out", str(tmp_path)]))  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1] == "error: gsm8k: only the 'test' split is provided (the shots are built in)"
    assert not list(tmp_path.iterdir())
