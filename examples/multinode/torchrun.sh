#!/usr/bin/env bash
# Run examples/train_gpt.py under torchrun on one or several machines: start this script once on every machine.
#
#   # 2 machines of 4 GPUs (4 replicas of a 2-stage pipeline); the address is node 0's
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=4 MASTER_ADDR=10.0.0.1 examples/multinode/torchrun.sh   # on node 0
#   NNODES=2 NODE_RANK=1 NPROC_PER_NODE=4 MASTER_ADDR=10.0.0.1 examples/multinode/torchrun.sh   # on node 1
#
#   # one machine, 2 CPU processes (the defaults: torchrun --standalone picks a free port itself)
#   examples/multinode/torchrun.sh --max-steps 20
#
# Settings (environment variables, with their defaults): NNODES=1, NPROC_PER_NODE=2 (processes per machine, one per
# GPU: Lightning's devices), NODE_RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500, PIPELINE_PARALLEL_SIZE=2 (stages
# per pipeline; the other processes are data-parallel replicas), ACCELERATOR=auto (GPUs where there are, else CPU).
# Arguments after the script's name go to train_gpt.py (--max-steps, --schedule, --log-dir, ...; see its --help).
#
# Lightning reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR, ...): the Trainer is
# only told --devices and --num-nodes, which must equal torchrun's --nproc-per-node and --nnodes. Where the machines
# have several network interfaces, set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.
set -euo pipefail

NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
PIPELINE_PARALLEL_SIZE="${PIPELINE_PARALLEL_SIZE:-2}"
ACCELERATOR="${ACCELERATOR:-auto}"
EXAMPLES="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ "$NNODES" == 1 ]]; then
    rendezvous=(--standalone)
else
    rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi

exec torchrun "${rendezvous[@]}" --nproc-per-node "$NPROC_PER_NODE" "$EXAMPLES/train_gpt.py" \
    --accelerator "$ACCELERATOR" --devices "$NPROC_PER_NODE" --num-nodes "$NNODES" \
    --pipeline-parallel-size "$PIPELINE_PARALLEL_SIZE" "$@"
