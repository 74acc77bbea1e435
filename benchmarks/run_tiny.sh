#!/usr/bin/env bash
# All methods on the tiny suites (arith, code, lists) with the Fast-dLLM block-size sweep, on the
# embedded tiny checkpoints: the README's benchmark command. Writes, per model,
# benchmarks/results/tiny/<model>/{samples.jsonl,summary.md,summary.json,run.json,*.png}.
#
#   benchmarks/run_tiny.sh                      # full test splits (500 items per suite)
#   benchmarks/run_tiny.sh --limit 8            # a quick look; extra arguments go to `bench`
#   MODELS=path/to/ckpt benchmarks/run_tiny.sh  # any LLaDA/Dream checkpoint(s), space-separated
#
# Batch size 16 by default, so the full splits finish on a CPU in reasonable time; latency is
# per-batch wall time / batch size (the paper measures batch 1: BATCH_SIZE=1 for that).
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="${MODELS:-tiny-llada tiny-dream}"
OUT="${OUT:-benchmarks/results/tiny}"
BATCH_SIZE="${BATCH_SIZE:-16}"
PY="${PYTHON:-python}"
for model in $MODELS; do
  name="$(basename "$model")"
  echo "== $model -> $OUT/$name"
  "$PY" -m hf_blockbatch.cli bench --model "$model" --task arith code lists \
    --methods vanilla fast_dllm fast_dllm_early_stop blockbatch --sweep-blocks 4,8,16,32,64 \
    --batch-size "$BATCH_SIZE" --output-dir "$OUT/$name" "$@"
done
