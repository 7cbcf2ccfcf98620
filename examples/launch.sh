#!/usr/bin/env bash
# Launch pretrain_lime.py with torchrun on this node; on a multi-node job run it on every node.
#
#   examples/launch.sh CONFIG.yaml [pretrain_lime.py flags overriding the config ...]
#
# Environment, with defaults:
#   GPUS_PER_NODE  processes on this node   [the GPUs nvidia-smi lists, else 1]
#   NNODES         nodes of the job          [$SLURM_NNODES, else 1]
#   NODE_RANK      this node's index         [$SLURM_NODEID, else 0]
#   MASTER_ADDR    address of node 0         [localhost]
#   MASTER_PORT    a free port on node 0     [6000]
set -euo pipefail

if [[ $# -lt 1 || ! -f "$1" ]]; then
    echo "usage: $0 CONFIG.yaml [pretrain_lime.py flags ...]  (config file missing: '${1-}')" >&2
    exit 2
fi
config=$1
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
GPUS_PER_NODE=${GPUS_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
# megatron-core orders tensor-parallel communication and computation with a single CUDA stream
# connection (as Megatron-LM's launch scripts do).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if command -v torchrun >/dev/null 2>&1; then
    launcher=(torchrun)
else
    launcher=(python -m torch.distributed.run)
fi
echo "launching $config on node $NODE_RANK of $NNODES ($GPUS_PER_NODE processes, master $MASTER_ADDR:$MASTER_PORT)" >&2
exec "${launcher[@]}" --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$repo/pretrain_lime.py" --config "$config" "$@"
