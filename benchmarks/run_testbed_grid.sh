#!/usr/bin/env bash
# Does block size matter on the tiny testbed? Fast-dLLM (dual cache, no early stop, as the paper's
# baseline) over block sizes 4..64 and thresholds 0.5/0.7/0.9 on one suite's full test split
# (500 items), with Wilson intervals in the summary table. Issue 4 asks that some setting loses
# >= 10 points against the best; the model cards quote this table.
#
#   benchmarks/run_testbed_grid.sh                 # tiny-llada, arith
#   MODEL=tiny-dream TASK=arith benchmarks/run_testbed_grid.sh --limit 100
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-tiny-llada}"
TASK="${TASK:-arith}"
OUT="${OUT:-benchmarks/results/grid/$(basename "$MODEL")-$TASK}"
METHODS=$(python -c "import json; print(' '.join(json.load(open('benchmarks/testbed_grid.json'))))")
# shellcheck disable=SC2086
"${PYTHON:-python}" -m hf_blockbatch.cli bench --model "$MODEL" --task "$TASK" --methods $METHODS \
  --configs benchmarks/testbed_grid.json --batch-size "${BATCH_SIZE:-32}" --output-dir "$OUT" --no-plots "$@"
