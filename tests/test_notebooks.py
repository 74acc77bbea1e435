"""The notebooks execute top to bottom (nbclient, a real kernel), on the embedded tiny checkpoint.

They skip with a message while the embedded weights are absent (the tiny checkpoints are trained
separately); ``HF_BLOCKBATCH_MODEL`` points them at another checkpoint, e.g. a smoke run, so the
notebooks can be checked before the weights land. The kernel gets one CPU thread: CI shares its
cores, and the notebooks' tiny models do not gain from more.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")

import hf_blockbatch as hb  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _model_or_skip() -> str:
    override = os.environ.get("HF_BLOCKBATCH_MODEL")
    if override:
        return override
    if not (Path(hb.TINY_LLADA) / "config.json").exists():
        pytest.skip(
            f"the embedded tiny-llada checkpoint has no weights yet ({hb.TINY_LLADA}/config.json is absent); "
            "set HF_BLOCKBATCH_MODEL to a LLaDA/Dream folder to run the notebooks anyway"
        )
    return "tiny-llada"


def _execute(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    model = _model_or_skip()
    monkeypatch.setenv("HF_BLOCKBATCH_MODEL", model)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute()
    return book


def _text(book) -> str:
    parts = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    book = _execute("quickstart.ipynb", tmp_path, monkeypatch)
    text = _text(book)
    for name in ("Vanilla", "Fast-dLLM", "BlockBatch"):
        assert f"{name}" in text and "NFE" in text
    # the padded-batch cell pads some prompt, and every prompt decodes alone as in the batch
    assert "same tokens alone: [True, True, True]" in text and "padding in the batch: [" in text
    assert "padding in the batch: [0, 0, 0]" not in text
    # the drafts: Fast-dLLM's own tokens, each adopted draft one forward less
    assert "same tokens: True  NFE + adopted == NFE without drafts: True" in text
    assert "sampled at T 0.7 with seed=0, same tokens with drafts: True" in text
    assert "... contained (drafted(exact=False))" in text  # and the contained drafts' row
    images = [o for c in book.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the NFE bar chart and the branch trace plot"


def test_benchmark_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_BLOCKBATCH_BENCH_OUT", str(tmp_path / "bench"))
    book = _execute("benchmark.ipynb", tmp_path, monkeypatch)
    assert (tmp_path / "bench" / "summary.md").exists()
    assert "BlockBatch" in (tmp_path / "bench" / "summary.md").read_text(encoding="utf-8")
    assert any("text/markdown" in o.get("data", {}) for c in book.cells for o in c.get("outputs", []))
