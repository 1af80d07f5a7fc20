#!/usr/bin/env bash
# One offline command for an accelerator machine whose image ships its own JAX stack (jax + the CUDA or
# TPU plugin, flax, optax, orbax-checkpoint, chex, transformers, ...) and no package index:
#
#   benchmarks/accelerator_check.sh [WHEEL_DIR]          # default WHEEL_DIR: ./wheels
#
# 1. installs this project with --no-deps (the image's JAX is never replaced; where pip cannot build
#    offline the checkout is used in place through PYTHONPATH);
# 2. installs the runtime requirements the image lacks (typically ml-collections, tensorboardX, gguf)
#    from WHEEL_DIR, offline;
# 3. runs benchmarks/accelerator_check.py (about 8 minutes), which writes
#    benchmarks/results_accelerator.md. Extra arguments after WHEEL_DIR go to it.
#
# Preparing WHEEL_DIR on a connected machine, for the image's Python (3.12 here) and platform:
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d wheels ml-collections tensorboardX gguf
#
# (add any other name that `python benchmarks/accelerator_check.py --missing` prints on the image),
# then copy the folder next to the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
# $PYTHON, else `python`, else `python3` (images often ship only the latter).
python="${PYTHON:-$(command -v python || command -v python3)}"
wheels="${1:-wheels}"
[ $# -gt 0 ] && shift

echo "accelerator check: $("$python" -c 'import jax, sys; print("jax", jax.__version__, "on", jax.devices()[0].device_kind, "| Python", sys.version.split()[0])')"

if ! "$python" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null; then
  echo "accelerator check: pip could not install the checkout offline; using it in place (PYTHONPATH)"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

missing="$("$python" benchmarks/accelerator_check.py --missing)"
if [ -n "$missing" ]; then
  if [ ! -d "$wheels" ]; then
    echo "accelerator check: this Python lacks $missing and there is no wheel folder '$wheels';" \
         "prepare one on a connected machine (see the top of $0)" >&2
    exit 2
  fi
  echo "accelerator check: installing $missing from $wheels (offline)"
  # shellcheck disable=SC2086 # one word per distribution
  "$python" -m pip install -q --no-index --find-links "$wheels" $missing
fi

exec "$python" benchmarks/accelerator_check.py "$@"
