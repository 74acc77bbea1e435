"""docs/bad_inputs.md stays true: every row's input (tests/bad_inputs_cases.py) gets exactly the
message the table shows (``…`` matches any text), and every case has a row."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bad_inputs_cases import CASES  # noqa: E402

TABLE = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
ROW = re.compile(r"^\| `(?P<id>[a-z0-9-]+)` \| .* \| (?P<message>[^|]+) \|$")


def _rows() -> dict[str, str]:
    rows = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m["id"] not in rows, f"row {m['id']} appears twice"
            rows[m["id"]] = m["message"].strip()
    return rows


ROWS = _rows()


def test_every_case_has_a_row_and_every_row_a_case():
    assert sorted(ROWS) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_the_table_shows_the_message(name, capsys, tmp_path, monkeypatch):
    message = CASES[name](capsys=capsys, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert "\n" not in message, "one line"
    pattern = ".*".join(re.escape(part) for part in ROWS[name].split("…"))
    assert re.fullmatch(pattern, message), f"\n table: {ROWS[name]}\nactual: {message}"
