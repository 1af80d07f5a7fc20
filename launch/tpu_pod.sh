#!/usr/bin/env bash
# Run ragen_jax on every host of a Cloud TPU pod slice (multi-host JAX).
#
#   launch/tpu_pod.sh TPU_NAME ZONE configs/sokoban_ragen.py --config.model.preset=qwen2.5-3b \
#       --config.model.path=/data/Qwen2.5-3B-Instruct --config.workdir=/mnt/shared/runs/sokoban \
#       --config.mesh.fsdp=-1
#
# What runs: over `gcloud compute tpus tpu-vm ssh --worker=all`, every host of the slice runs
#     cd REPO_DIR && python3 -m ragen_jax.launch --distributed --config CONFIG OVERRIDES...
# jax.distributed.initialize() (--distributed) discovers the pod topology from the TPU metadata (no
# coordinator address needed) and the hosts form one mesh over every chip (config.mesh; default
# data parallel, fsdp=-1 shards weights and optimizer states over all of them). Host 0 writes
# TensorBoard, transcripts and the summary; every host writes its shards of each checkpoint. The
# repository, the model directory and the workdir must be at the same path on every host, the
# workdir on a filesystem all of them share (a Filestore or GCS FUSE mount: workdirs are local
# paths, not gs:// URLs).
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 TPU_NAME ZONE CONFIG [--config.key=value ...]" >&2
  exit 2
fi
TPU_NAME=$1; ZONE=$2; CONFIG=$3; shift 3
REPO_DIR=${REPO_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
printf -v OVERRIDES '%q ' "$@"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
  "cd $REPO_DIR && python3 -m ragen_jax.launch --distributed --config $CONFIG $OVERRIDES"
