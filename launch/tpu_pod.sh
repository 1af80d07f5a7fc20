#!/usr/bin/env bash
# Run ragen_jax on every host of a Cloud TPU pod slice (multi-host JAX).
#
#   launch/tpu_pod.sh TPU_NAME ZONE configs/sokoban.py --config.model.preset=qwen2.5-3b \
#       --config.model.path=/data/Qwen2.5-3B-Instruct --config.workdir=gs://bucket/runs/sokoban
#
# Every host runs the same command; jax.distributed.initialize() (--distributed) discovers the
# pod topology from the TPU metadata, so no coordinator address is needed. The repository and the
# model directory must exist at the same path on every host (e.g. a shared disk or a prior scp).
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
