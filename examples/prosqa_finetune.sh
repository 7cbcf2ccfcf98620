#!/bin/bash
# ProsQA fine-tuning from a pretrained 150M checkpoint (LIMe paper §5.3.1) in one command:
#   bash examples/prosqa_finetune.sh lime checkpoints/lime_150m_full     # or: llama checkpoints/llama_150m
#   MODEL CHECKPOINT [SEED (1)] [OUT (runs/prosqa)]; env: EPOCHS (10), SEQ (1024), PUBLISHED (Coconut's
#   prosqa_train.json and prosqa_test.json directory, instead of generated questions)
# About 18,000 training questions (17,886 as Coconut publishes), 500 held out; the paper's schedule:
# EPOCHS epochs at batch 128, lr 1e-4 with linear decay and warm-up over the first epoch, loss on
# the steps and the answer only (--sft); then answer and step accuracy by greedy generation.
# CHECKPOINT is the --save directory of examples/lime_150m_full.yaml or llama_150m.yaml (any layout);
# the run launches on this node's GPUs with examples/launch.sh and resumes from OUT if interrupted.
set -euo pipefail
MODEL=${1:?lime or llama}; CHECKPOINT=${2:?pretrained checkpoint directory}; SEED=${3:-1}; OUT=${4:-runs/prosqa}
EPOCHS=${EPOCHS:-10}; SEQ=${SEQ:-1024}; BATCH=128  # Coconut's longest question: 564 GPT-2 tokens
cd "$(dirname "$0")/.."
case "$MODEL" in lime) CONFIG=examples/lime_150m_full.yaml;; llama) CONFIG=examples/llama_150m.yaml;;
  *) echo "MODEL must be lime or llama (got $MODEL)" >&2; exit 2;; esac
if [ ! -f "$OUT/prosqa_response_document.idx" ]; then
  if [ -n "${PUBLISHED:-}" ]; then
    python tools/make_prosqa_data.py --output-dir "$OUT" --from-coconut "$PUBLISHED"
  else
    python tools/make_prosqa_data.py --output-dir "$OUT" --train-samples 17886 --test-samples 500
  fi
  python tools/preprocess_data.py --input "$OUT/prosqa_train.jsonl" --output-prefix "$OUT/prosqa" \
    --prompt-key prompt --json-keys response --tokenizer-type GPT2BPETokenizer
fi
EXAMPLES=$(python -c "from megatron.core.datasets.indexed_dataset import IndexedDataset as D
print(len(D('$OUT/prosqa_response_document').document_indices) - 1)")
ITERS=$(( (EPOCHS * EXAMPLES + BATCH - 1) / BATCH )); WARMUP=$(( (EXAMPLES + BATCH - 1) / BATCH ))
RUN="$OUT/ckpt-$MODEL-$SEED"
bash examples/launch.sh "$CONFIG" --sft --data-path "$OUT/prosqa_response_document" --split 100,0,0 \
  --data-cache-path "$OUT/cache" --seq-length "$SEQ" --global-batch-size $BATCH --train-iters "$ITERS" \
  --lr 1e-4 --min-lr 0 --lr-decay-style linear --lr-warmup-iters "$WARMUP" --seed "$SEED" --eval-iters 0 \
  --pretrained-checkpoint "$CHECKPOINT" --save "$RUN" --load "$RUN" --save-interval 500 \
  --tensorboard-dir "$OUT/tensorboard" --wandb-exp-name "prosqa-$MODEL-$SEED" --metrics-file "$OUT/$MODEL-$SEED.jsonl"
python tools/score_generation.py "$RUN" --task prosqa --test-file "$OUT/prosqa_test.json" \
  --max-new-tokens 128 --output "$OUT/scores-$MODEL-$SEED.json"
