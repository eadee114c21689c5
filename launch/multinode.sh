#!/usr/bin/env bash
# Two-node harness run with c10d rendezvous. Run the same line on both nodes:
#
#   node A:  launch/multinode.sh NODE_A_ADDR [verify options...]
#   node B:  launch/multinode.sh NODE_A_ADDR [verify options...]
#
# NODE_A_ADDR is an address of node A that node B can reach; the rendezvous
# store listens there on RDZV_PORT. Environment knobs:
#   NPROC_PER_NODE  ranks per node (default: GPUs on this node, or 2 without GPUs)
#   RDZV_PORT       rendezvous port on node A (default 29400)
#   RUN_ID          rendezvous id, the same on both nodes (default cp-blocktables-verify)
#   PYTHON          interpreter with cp_blocktables installed (default python3)
# With one GPU per rank the ranks use NCCL; otherwise gloo on CPU.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
rdzv_host=$1
shift

python=${PYTHON:-python3}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    NPROC_PER_NODE=$(( gpus > 0 ? gpus : 2 ))
fi

exec "$python" -m torch.distributed.run \
    --nnodes 2 \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$rdzv_host:${RDZV_PORT:-29400}" \
    --rdzv-id "${RUN_ID:-cp-blocktables-verify}" \
    --max-restarts 0 \
    "$(dirname "$0")/verify.py" "$@"
