#!/usr/bin/env bash
# launch/train.py on several nodes with torchrun's c10d rendezvous. Run this same command on every node;
# the ranks find each other through the endpoint (any node's address; node 0's by convention):
#
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=node0.cluster MASTER_PORT=29500 \
#       bash launch/multinode.sh --model llama-7b --seq-len 65536 --batch-size 1 --steps 1000 --lr 3e-4 \
#       --remat --save-every 50 --ckpt-dir /shared/runs/7b
#
# Every rank of the job (NNODES x NPROC_PER_NODE) holds 1/world of each sequence (or --sp-size of them do,
# the rest being data parallel). --ckpt-dir must be on a file system all nodes share. torchrun restarts
# all ranks up to MAX_RESTARTS times after a failure, and --resume (always passed here) makes them continue
# from the latest checkpoint. Extra arguments go to launch/train.py.
#
# Environment: NNODES (required), MASTER_ADDR (required), NPROC_PER_NODE (default: one rank per GPU, or
# 1 without GPUs), MASTER_PORT (29500), RDZV_ID (a job id shared by the nodes; default distattn-train),
# MAX_RESTARTS (3).
set -euo pipefail
: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host (e.g. node 0)}"
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$(python -c "import torch; print(torch.cuda.device_count() or 1)")
fi
exec python -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-distattn-train}" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    "$(dirname "$0")/train.py" --resume "$@"
