#!/bin/bash
# The paper's arithmetic-expression task run (§5.3.2, App. A-B) in one command:
#   bash examples/aet_paper.sh lime 1      # or: llama 1; MODEL SEED [EPOCHS (200)] [OUT (runs/aet)]
# The protocol of bench/bench_reasoning.py --task aet, which this runs for one model and seed: the
# main job's data stages with the paper's tiers (50,000 training expressions per tier of 4, 5 and 6
# operators, 1,500 held-out test expressions, a 48-piece tokenizer), one example per sequence with
# the loss on the solution (--sft), a 4-layer model of width 32 with 4 heads at lr 1e-3 with linear
# decay for EPOCHS passes over the training examples, then exact-match accuracy per tier by greedy
# generation (tools/score_generation.py).
set -euo pipefail
MODEL=${1:?lime or llama}; SEED=${2:-1}; EPOCHS=${3:-200}; OUT=${4:-runs/aet}
case "$MODEL" in lime) NAME=LIMe ;; llama) NAME=LLaMA ;; *) echo "MODEL is lime or llama, not $MODEL" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
python bench/bench_reasoning.py --task aet --models "$NAME" --seeds "$SEED" --epochs "$EPOCHS" \
  --test-samples 1500 --output-dir "$OUT"
