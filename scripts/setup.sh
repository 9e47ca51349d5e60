#!/usr/bin/env bash
# Set up ddpkit on a fresh machine: system packages (where apt is available),
# a virtual environment in .venv with torch and ddpkit (its compiled parts built).
#
#   bash scripts/setup.sh          # what training needs
#   bash scripts/setup.sh --test   # plus the test tools and the real cluster software the tests start
#
# Environment:
#   DDPKIT_TORCH   pip requirement for torch (default torch==2.13.0, the CPU build;
#                  on a GPU machine set e.g. DDPKIT_TORCH="torch" for the CUDA build)
#   DDPKIT_VENV    where the virtual environment goes (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
[[ "${1:-}" == "--test" ]] && with_tests=1

venv="${DDPKIT_VENV:-.venv}"
torch_req="${DDPKIT_TORCH:-torch==2.13.0}"

apt_packages=(dataset-fashion-mnist)

if command -v apt-get >/dev/null 2>&1; then
  missing=()
  for p in "${apt_packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if (( ${#missing[@]} )); then
    sudo_cmd=()
    [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    echo "setup: installing ${missing[*]}" >&2
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || echo "setup: could not install ${missing[*]} with apt-get; ddpkit will download the dataset instead" >&2
  fi
fi

if (( with_tests )); then
  bash scripts/cluster-setup.sh   # Slurm, munge, OpenMPI, iproute2: the tests start them for real
fi

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $torch_req" >&2
  "$py" -m pip install -q "$torch_req"
fi
extras=""
(( with_tests )) && extras="[test]"
"$py" -m pip install -q -e ".$extras"
# Byte-compile ddpkit's sources, as pip does for the packages it installs: an editable install leaves
# that to the first import, which writes nothing where PYTHONDONTWRITEBYTECODE is set, and then every
# fresh process compiles them again (about 0.1 s of CPU each).
"$py" -m compileall -q src >/dev/null
echo "setup: ready ($("$py" -c 'import torch, ddpkit; print("torch", torch.__version__, "ddpkit", ddpkit.__version__)'))" >&2
