#!/usr/bin/env bash
# Set up (first run only) and train: W1, the MLP on Fashion-MNIST, with 2 workers.
# Any key=value words are passed on to `ddpkit train`, e.g. scripts/train.sh model=cnn epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A new folder per run (later words win, so output_dir=... overrides it): a run
# never meets the checkpoints of an earlier one; resume one with
# output_dir=runs/<its folder> resume=auto.
exec "${DDPKIT_VENV:-.venv}/bin/ddpkit" train nproc=2 "output_dir=runs/$(date +%Y%m%d-%H%M%S)" "$@"
