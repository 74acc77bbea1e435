"""Record the decoding regression file: ``python tests/regression/record.py`` (about a minute).

Run it only when a change is meant to alter decoding; the replay test then checks the new outputs.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "outputs.json.gz"


def main() -> None:
    torch.set_num_threads(1)
    record: dict[str, dict] = {}
    for model_name, suite, n, gen_length, config, batch in cases.all_cases():
        tokens, nfe = cases.decode(model_name, suite, n, gen_length, config, batch)
        record[cases.key(model_name, suite, config, batch)] = {"tokens": tokens, "nfe": nfe}
    with gzip.open(OUTPUT, "wt") as f:
        json.dump(record, f, separators=(",", ":"), sort_keys=True)
    print(f"wrote {len(record)} cases to {OUTPUT}")


if __name__ == "__main__":
    main()
