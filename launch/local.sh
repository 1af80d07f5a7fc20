#!/usr/bin/env bash
# Single machine (CPU, one GPU or one TPU VM host): the plain launcher.
#
#   launch/local.sh configs/frozen_lake.py --config.trainer.total_steps=50
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG [--config.key=value ...]" >&2
  exit 2
fi
CONFIG=$1; shift
cd "$(dirname "$0")/.."
exec python3 -m ragen_jax.launch --config "$CONFIG" "$@"
