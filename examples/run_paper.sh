#!/usr/bin/env bash
# Run a group of the paper's experiments one after the other through examples/launch.sh (same
# environment variables; on a multi-node job run it on every node).
#
#   examples/run_paper.sh GROUP [pretrain_lime.py flags for every run ...]
#
# Groups: 1b (Tables 2/3: LIMe, LLaMA and Hyper-Connections, GQA and MHA), v1 (the first version's Table 1:
# LLaMA, static and dynamic LIMe, HC at 1.2B MHA), ablation (App. D: the 150M routers), deep (§5.5: 32/64/128
# layers with pipeline parallelism), all.
set -euo pipefail

configs() {
    case "$1" in
        1b) echo lime_1b_gqa8 llama_1b_gqa8 hc_1b_gqa8 lime_1b_mha llama_1b_mha hc_1b_mha ;;
        v1) echo llama_1b_mha lime_1b_mha lime_1b_dynamic hc_1b_mha ;;
        ablation) echo llama_150m lime_150m_full lime_150m_average lime_150m_last2 \
                       lime_150m_last4 lime_150m_last6 lime_150m_first2 lime_150m_first4 \
                       lime_150m_first6 ;;
        deep) echo lime_deep32 llama_deep32 lime_deep64 llama_deep64 lime_deep128 llama_deep128 ;;
        all) echo "$(configs 1b) lime_1b_dynamic $(configs ablation) $(configs deep)" ;;
        *) return 1 ;;
    esac
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! names=$(configs "${1-}"); then
    echo "usage: $0 {1b|v1|ablation|deep|all} [pretrain_lime.py flags ...]" >&2
    exit 2
fi
shift
for name in $names; do
    "$here/launch.sh" "$here/$name.yaml" "$@"
done
