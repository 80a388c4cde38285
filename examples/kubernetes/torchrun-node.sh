#!/bin/bash
# One node (pod) of a stagewise train job on Kubernetes: reads what the operator set and runs torchrun.
#
#   torchrun-node.sh --model gpt-1.3b --pp 8 --dp 2 --out /shared/runs/1b
#
# The arguments are `stagewise train` flags. Used by pytorchjob.yaml (Kubeflow's training operator sets
# PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, MASTER_ADDR and MASTER_PORT) and by jobset.yaml (JobSet
# sets JOB_COMPLETION_INDEX; the manifest sets NNODES, NPROC_PER_NODE and MASTER_ADDR, the first pod's host
# name). STAGEWISE_JOB_ID is the job's own id, the same in every pod (the manifests take the job's uid or name).
set -euo pipefail

nnodes=${PET_NNODES:-${NNODES:?set NNODES, the number of pods (nodes) of the job}}
nproc_per_node=${PET_NPROC_PER_NODE:-${NPROC_PER_NODE:?set NPROC_PER_NODE, the processes (GPUs) of each pod}}
node_rank=${PET_NODE_RANK:-${JOB_COMPLETION_INDEX:-${RANK:?set JOB_COMPLETION_INDEX or RANK, this pod\'s index}}}
master_addr=${MASTER_ADDR:?set MASTER_ADDR, the host name of the job\'s first pod}
master_port=${MASTER_PORT:-29500}
job_id=${STAGEWISE_JOB_ID:?set STAGEWISE_JOB_ID, an id of this job\'s own, the same in every pod}

# Every pod's torchrun meets at the first pod, which keeps the job's store (is_host): the pods need not
# resolve their own names to tell. Anyone who reaches that host and port can join or disturb the job: keep
# the pods on a trusted network (a NetworkPolicy that admits only the job's pods).
if [[ $node_rank == 0 ]]; then is_host=1; else is_host=0; fi

exec torchrun --nnodes "$nnodes" --nproc-per-node "$nproc_per_node" \
    --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port" --rdzv-id "$job_id" \
    --rdzv-conf "is_host=$is_host" \
    -m stagewise train "$@"
