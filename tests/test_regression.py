"""Replays the decoding regression file: every strategy decodes exactly as when it was recorded.

The file (``tests/regression/outputs.json.gz``, written by ``tests/regression/record.py``) holds the
new tokens and the NFE of each case of ``tests/regression/cases.py``: both embedded checkpoints,
every suite, vanilla, Fast-dLLM (each cache mode, early stop, factor) and BlockBatch (defaults and
its refresh / merge / sync / rule variants), alone and in a left-padded batch of 8. A refactor of the
decoding core must leave all of it unchanged.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "regression"
sys.path.insert(0, str(HERE))
import cases  # noqa: E402

with gzip.open(HERE / "outputs.json.gz", "rt") as _f:
    RECORD = json.load(_f)

CASES = list(cases.all_cases())


def test_the_record_covers_every_case():
    assert sorted(RECORD) == sorted(cases.key(m, s, c, b) for m, s, _, _, c, b in CASES)


@pytest.mark.parametrize(
    "model_name,suite,n,gen_length,config",
    sorted({(m, s, n, g, c) for m, s, n, g, c, _ in CASES}),
    ids=lambda v: str(v),
)
def test_decoding_matches_the_record(model_name, suite, n, gen_length, config):
    for batch in (1, cases.BATCH):
        tokens, nfe = cases.decode(model_name, suite, n, gen_length, config, batch)
        want = RECORD[cases.key(model_name, suite, config, batch)]
        assert nfe == want["nfe"], f"NFE changed at batch {batch}"
        assert tokens == want["tokens"], f"tokens changed at batch {batch}"
