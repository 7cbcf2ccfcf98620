#!/usr/bin/env bash
# The paper's Table 1 (LM Evaluation Harness, 3-shot) on a trained checkpoint, without conversion:
#   examples/lm_eval_table1.sh CHECKPOINT [OUTPUT_DIR] [extra lm-eval flags...]
# MultiRC, WiC (SuperGLUE), QNLI (GLUE), ARC-Easy, ARC-Challenge, and BIG-bench Key-Value Maps,
# Mathematical Induction and Logical Deduction (three objects). Data parallel over NPROC ranks
# (default: every GPU). Offline use (datasets fetched once, then HF_*_OFFLINE=1): docs/evaluation.md.
set -euo pipefail
checkpoint=${1:?usage: $0 CHECKPOINT [OUTPUT_DIR] [extra lm-eval flags]}
output=${2:-lm_eval_results}
shift $(( $# > 1 ? 2 : 1 ))
here=$(cd "$(dirname "$0")" && pwd)
nproc=${NPROC:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
tasks=multirc,wic,qnli,arc_easy,arc_challenge,bigbench_key_value_maps_multiple_choice
tasks=$tasks,bigbench_mathematical_induction_multiple_choice,lime_bigbench_logical_deduction_three_objects
exec torchrun --nproc-per-node "$nproc" "$here/../tools/evaluate.py" \
    --model lime_megatron --model_args "checkpoint=$checkpoint" --batch_size "${BATCH_SIZE:-16}" \
    --tasks "$tasks" --num_fewshot 3 --include_path "$here/lm_eval_tasks" \
    --output_path "$output" "$@"
