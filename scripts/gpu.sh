#!/usr/bin/env bash
# On a machine with a GPU whose python3 has torch with CUDA (and Accelerate): the GPU tests and the GPU
# benchmarks in one go, each bounded in time, their results in OUTDIR (default: benchmarks/).
#   bash scripts/gpu.sh [OUTDIR]
# ddpkit is installed into that python3 (the GPU tests start `python -m ddpkit` with their own environment,
# so a PYTHONPATH is not enough); where omegaconf is missing and the machine is offline, put its wheel
# (pure Python) in .whl/ first. Written: gpu.txt (the GPU and torch), gpu-run.log (the tests' report,
# gpu_batch_issue.py's lines and every benchmark's progress), t10-gpu.json (T10 on the GPU),
# gpu-peers-<gpu>-<date>.json and .md (T11), gpu-loop-parts.txt (T11's loop in one process, one ddpkit
# part at a time), gpu-importtime.txt (the imports' times). About 7 minutes on an H200.
# GPU_STEPS=tests,peers GPU_PEERS_ROUNDS=2 GPU_PEERS_S=400: some parts only, in that order (each step's
# time limit: GPU_TESTS_S, GPU_ISSUE_S, GPU_PARTS_S, GPU_PEERS_S, GPU_T10_S).
set -u
cd "$(dirname "$0")/.."
# GPU_STEPS chooses and orders the parts (default: all, the suite first: a failure there makes the figures moot).
steps=${GPU_STEPS:-tests,issue,parts,peers,t10}
for step in ${steps//,/ }; do
    case $step in
    tests | issue | parts | peers | t10) ;;
    *) echo "gpu.sh: GPU_STEPS has '$step'; choose among tests, issue, parts, peers, t10 (comma-separated)" >&2; exit 2 ;;
    esac
done
out=${1:-benchmarks}
mkdir -p "$out"
log="$out/gpu-run.log"
: >"$log"
export PYTHONUNBUFFERED=1
if ! python3 -c "import omegaconf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" >>"$out/gpu.txt" 2>&1
# Start-up there: what importing torch and torch._dynamo costs (ddpkit's worker server preloads both).
python3 -X importtime -c "import torch, torch._dynamo" 2>"$out/gpu-importtime.txt"

for step in ${steps//,/ }; do
    case $step in
    tests) # about 40 tests, 2 minutes
        timeout "${GPU_TESTS_S:-200}" python3 -m pytest tests/gpu -m gpu -n 6 -q -p no:cacheprovider 2>&1 \
            | grep -v PytestBenchmarkWarning | tee -a "$log" ;;
    issue) # what handing out a 16 MiB batch costs the loop's thread, and whether its copy overlaps the step
        timeout "${GPU_ISSUE_S:-60}" python3 benchmarks/gpu_batch_issue.py 2>&1 | tee -a "$log" ;;
    parts) # T11's MLP loop in one process: torch's loop and ddpkit's, part by part, alternated
        timeout "${GPU_PARTS_S:-100}" python3 benchmarks/gpu_loop_parts.py --model mlp --rounds 2 \
            >"$out/gpu-loop-parts.txt" 2>>"$log" ;;
    peers) # T11: plain torch + DDP, ddpkit's own loop and Accelerate, the same training, as separate commands
        timeout "${GPU_PEERS_S:-270}" python3 benchmarks/gpu_peers.py --rounds "${GPU_PEERS_ROUNDS:-1}" \
            --output-dir "$out" 2>&1 | tee -a "$log" ;;
    t10) # T10 on a GPU: 10 steps of a batch of 32768 take about 0.9 s, as real steps of tens of milliseconds do
        timeout "${GPU_T10_S:-70}" python3 -m ddpkit.bench.checkpoint_stall device=cuda batch_size=32768 rounds=8 \
            >"$out/t10-gpu.json" 2>>"$log" ;;
    esac
done
