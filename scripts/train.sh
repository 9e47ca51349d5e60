#!/usr/bin/env bash
# Set up (first run only) and train: W1, the MLP on Fashion-MNIST, with 2 workers.
# Any key=value words are passed on to `ddpkit train`, e.g. scripts/train.sh model=cnn epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Every run gets its own folder runs/<model>-<dataset>/<date-time> (runs/latest points to it);
# scripts/train.sh resume=auto continues the latest one.
exec "${DDPKIT_VENV:-.venv}/bin/ddpkit" train nproc=2 "$@"
