#!/bin/bash
# The paper's arithmetic-expression task run (§5.3.2, App. A-B) in one command:
#   bash examples/aet_paper.sh lime 1      # or: llama 1; MODEL SEED [EPOCHS (200)] [OUT (runs/aet)]
# 50,000 training expressions per tier (4, 5, 6 operands), 1,500 held-out test expressions; a
# 4-layer model of width 32 with 4 heads, lr 1e-3 with linear decay, EPOCHS passes over the
# training tokens; then greedy generation accuracy per tier (tools/score_generation.py).
set -euo pipefail
MODEL=${1:?lime or llama}; SEED=${2:-1}; EPOCHS=${3:-200}; OUT=${4:-runs/aet}
cd "$(dirname "$0")/.."
TOK=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer/tokenizer.model" --make-vocab-size-divisible-by 64)
if [ ! -f "$OUT/train_text_document.idx" ]; then
  python tools/make_arithmetic_data.py --output "$OUT/train.jsonl" --num-samples 150000 --min-operands 4 \
    --max-operands 6 --test-output "$OUT/test.jsonl" --test-samples 1500
  python tools/train_tokenizer.py --input "$OUT/train.jsonl" --kind sentencepiece --vocab-size 48 \
    --character-coverage 1.0 --no-byte-fallback --output-dir "$OUT/tokenizer"
  python tools/preprocess_data.py --input "$OUT/train.jsonl" --output-prefix "$OUT/train" --append-eod "${TOK[@]}"
fi
SEQ=128; BATCH=64
ITERS=$(python -c "from megatron.core.datasets.indexed_dataset import IndexedDataset as D
print(-(-$EPOCHS * int(D('$OUT/train_text_document').sequence_lengths.sum()) // ($SEQ * $BATCH)))")
FLAG=(); [ "$MODEL" = lime ] && FLAG=(--lime)
python pretrain_lime.py "${FLAG[@]}" --num-layers 4 --hidden-size 32 --ffn-hidden-size 128 --num-attention-heads 4 \
  --seq-length $SEQ --micro-batch-size $BATCH --global-batch-size $BATCH --lr 1e-3 --min-lr 0 --lr-decay-style linear \
  --lr-warmup-iters 50 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --train-iters "$ITERS" \
  --split 99,1,0 --eval-interval 1000 --eval-iters 2 --log-interval 100 --seed "$SEED" \
  --data-path "$OUT/train_text_document" --data-cache-path "$OUT/cache" "${TOK[@]}" \
  --save "$OUT/ckpt-$MODEL-$SEED" --metrics-file "$OUT/$MODEL-$SEED.jsonl"
python tools/score_generation.py "$OUT/ckpt-$MODEL-$SEED" --test-file "$OUT/test.jsonl" \
  --output "$OUT/scores-$MODEL-$SEED.json"
