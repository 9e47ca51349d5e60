"""GPU training beside the peers (target T11): plain torch + DDP, ddpkit's own loop and Accelerate, the same training.

One command, from the repository root, on a machine with a GPU::

    python benchmarks/gpu_peers.py                  # 2 alternated rounds of ResNet-18 and the MLP on 1 GPU
    python benchmarks/gpu_peers.py --smoke          # tiny sizes on the CPU (gloo): what the tests run

Each peer is a small script in ``benchmarks/peers/`` started as a whole
process by its users' launcher, as they run it:

- ``torch_ddp.py`` under ``torchrun --standalone --nproc-per-node N``;
- ``ddpkit_loop.py`` under ``ddpkit run nproc=N``;
- ``accelerate_loop.py`` under plain ``python`` (``torchrun`` for N > 1),
  skipped with a note where Accelerate is not installed.

The same training in each (``benchmarks/peers/workload.py``): 25,000
CIFAR-size uint8 images read one sample at a time with a random crop and
flip, 8 loader workers, batch 256 per process, bf16 autocast, SGD with
momentum, 3 epochs of ResNet-18 and 8 of the MLP (the first a warm-up:
about 3 s timed on an H200 for each), and a checkpoint saved at every epoch
end as each framework's users save it (``torch.save`` on rank 0,
``ddpkit.Checkpointer`` holding the loader, ``accelerator.save_state``).
Two models: ResNet-18 (CIFAR variant, 11.2M parameters: launch-bound on a
large GPU) and an MLP 3072-1024-10 (loader-bound).

Reported per model and peer (median, min, max over the rounds): images/s
over the timed epochs with their saves included (from the first batch of
epoch 1, when every peer has saved epoch 0 or started to, until the last
checkpoint is complete), the time from the command to the end of the first
optimizer step with its breakdown (launch: interpreter and launcher until
the script's first line; imports; CUDA init; process group; setup of the
model, optimizer, loader and checkpointer; first batch; first step), and the
GPU's peak memory. The ratio ddpkit / best peer is T11's (target >= 1.0). Writes
``benchmarks/gpu-peers-<gpu>-<date>.json`` and ``.md``.

On a GPU machine whose python3 has torch with CUDA (and Accelerate), from
the repository root, the GPU tests and this benchmark in one go (README,
"GPU"; where omegaconf is missing, install its wheel first)::

    python3 -m pip install --no-deps --no-build-isolation -e . && python3 -m pytest tests/gpu -m gpu -n 6 -q; python3 benchmarks/gpu_peers.py

Twelve runs (2 rounds x 2 models x 3 peers) of about 20-40 s each on an
H100; ``--rounds 1`` halves that. ``--output-dir`` chooses where the JSON
and Markdown go (default: ``benchmarks/``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ddpkit
from ddpkit.bench.report import file_stem, write_report
from ddpkit.bench.system import machine_info, machine_tag, summarize

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE / "peers"
T0_VARIABLE = "GPU_PEERS_T0"  # workload.T0_VARIABLE (the scripts' module, not imported here)

PEERS = {"torch": "torch_ddp.py", "ddpkit": "ddpkit_loop.py", "accelerate": "accelerate_loop.py"}
"""Each peer's script in benchmarks/peers/."""

EPOCHS = {"resnet18": 3, "mlp": 8}
"""Epochs per model by default: the MLP's are short (0.35 s on an H200), and a window of 2 was noise."""

SMOKE = {"samples": 256, "epochs": 2, "batch_size": 32, "num_workers": 1, "width": 8, "precision": "fp32"}
"""--smoke: sizes that train in a few seconds per script on a CPU."""


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (gloo), 1 round")
    parser.add_argument("--models", default="resnet18,mlp")
    parser.add_argument("--peers", default="torch,ddpkit,accelerate")
    parser.add_argument("--rounds", type=int, default=None, help="alternated rounds (default 2; 1 with --smoke)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per peer")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--samples", type=int, default=25_000)
    parser.add_argument("--epochs", type=int, default=None, help="for every model (default: EPOCHS, 2 with --smoke)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--output-dir", default=str(HERE))
    parser.add_argument("--tag", default="", help="added to the file name")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        args.device = "cpu" if args.device == "auto" else args.device
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 2
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() else "cpu"  # NVML's count: CUDA stays uninitialized here
    return args


def peer_command(peer: str, nproc: int, device: str, script_args: list[str]) -> list[str]:
    """The command that starts ``peer``'s script as its users start it."""
    script = str(PEERS_DIR / PEERS[peer])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if peer == "torch" or (peer == "accelerate" and nproc > 1):
        return [*torchrun, script, *script_args]
    if peer == "ddpkit":
        return [
            sys.executable,
            "-m",
            "ddpkit",
            "run",
            f"nproc={nproc}",
            f"device={'cpu' if device == 'cpu' else 'auto'}",
            script,
            *script_args,
        ]
    return [sys.executable, script, *script_args]


def script_arguments(args: argparse.Namespace, model: str, out: Path, result: Path) -> list[str]:
    return [
        f"--model={model}",
        f"--samples={args.samples}",
        f"--epochs={args.epochs or EPOCHS[model]}",
        f"--batch-size={args.batch_size}",
        f"--num-workers={args.num_workers}",
        f"--device={args.device}",
        f"--precision={args.precision}",
        f"--width={args.width}",
        f"--out={out}",
        f"--result={result}",
    ]


def child_environ() -> dict[str, str]:
    """This environment, with this ddpkit importable in the peers' processes (python -m ddpkit included)."""
    source = str(Path(ddpkit.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": source + (os.pathsep + path if path else "")}


def run_peer(args: argparse.Namespace, peer: str, model: str, scratch: Path, round_: int) -> dict[str, Any]:
    """One whole run of ``peer`` training ``model``: its result, or its failure."""
    out, result = scratch / f"{round_}-{model}-{peer}", scratch / f"{round_}-{model}-{peer}.json"
    command = peer_command(peer, args.nproc, args.device, script_arguments(args, model, out, result))
    started = time.time()
    environ = {**child_environ(), T0_VARIABLE: repr(started)}
    try:
        done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=args.timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        returncode, output = -1, f"timed out after {args.timeout:g}s\n{e.stderr or ''}"
    wall = time.time() - started
    if returncode != 0 or not result.exists():
        return {"peer": peer, "model": model, "round": round_, "failed": returncode, "output_tail": output[-4000:]}
    measured = json.loads(result.read_text())
    subprocess.run(["rm", "-rf", str(out)], check=False)  # the checkpoints: the next run starts with a clean disk
    return {**measured, "peer": peer, "round": round_, "wall_s": wall, "command": shlex.join(command)}


def missing_peers(peers: list[str]) -> dict[str, str]:
    """Peers that cannot run here, with why."""
    if "accelerate" in peers and importlib.util.find_spec("accelerate") is None:
        return {"accelerate": "Accelerate is not installed in this python (pip install accelerate to include it)"}
    return {}


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi (not torch: this process leaves CUDA to the peers), or ''."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""


def machine_slug(device: str, name: str) -> str:
    """``h100``-style for a GPU (its model's first word with a digit), else ddpkit's CPU tag."""
    if device == "cuda" and name:
        words = [w.lower() for w in name.split() if any(c.isdigit() for c in w)]
        return words[0] if words else "gpu"
    return machine_tag()


def summarize_runs(runs: list[dict[str, Any]], models: list[str], peers: list[str]) -> dict[str, Any]:
    """Per model and peer: medians, minima and maxima over the rounds; the ratio ddpkit / best peer."""
    summary: dict[str, Any] = {}
    for model in models:
        per_peer: dict[str, Any] = {}
        for peer in peers:
            mine = [run for run in runs if run["model"] == model and run["peer"] == peer and run.get("images_per_s")]
            if not mine:
                continue
            phases = mine[0]["startup_phases_s"]
            per_peer[peer] = {
                "images_per_s": summarize([run["images_per_s"] for run in mine]),
                "time_to_first_step_s": summarize([run["time_to_first_step_s"] for run in mine]),
                "startup_phases_s": {
                    name: summarize([run["startup_phases_s"][name] for run in mine])["median"] for name in phases
                },
                "max_gpu_allocated_bytes": max((run["gpu_memory"] or {}).get("max_allocated_bytes", 0) for run in mine),
                "checkpoint_bytes": mine[-1]["checkpoint_bytes"],
            }
        others = [value["images_per_s"]["median"] for peer, value in per_peer.items() if peer != "ddpkit"]
        ratio = per_peer["ddpkit"]["images_per_s"]["median"] / max(others) if "ddpkit" in per_peer and others else None
        summary[model] = {"peers": per_peer, "ratio_ddpkit_over_best_peer": ratio}
    return summary


def epochs_said(epochs: int | None) -> str:
    """``3 epochs``, or each model's default where ``--epochs`` was not given."""
    if epochs:
        return f"{epochs} epochs"
    return ", ".join(f"{count} epochs of {model}" for model, count in EPOCHS.items())


PEER_NAMES = {"torch": "torch + DDP (torchrun)", "ddpkit": "ddpkit (ddpkit run)", "accelerate": "Accelerate (python)"}


def render_markdown(report: dict[str, Any]) -> str:
    config, machine = report["config"], report["machine"]
    lines = [
        f"# GPU training beside the peers ({report['date']})",
        "",
        f"`{report['command']}`",
        "",
        f"{machine.get('gpu') or 'no GPU'}; {machine['cores']} cores ({machine['cpu_model']}); torch "
        f"{machine['torch']}; Accelerate {machine.get('accelerate') or 'not installed'}. Device {config['device']}, "
        f"{config['nproc']} process(es) per peer, {config['samples']} images, {epochs_said(config['epochs'])} (the "
        f"first a warm-up), batch {config['batch_size']} per process, {config['num_workers']} loader workers, "
        f"{config['precision']}, {config['rounds']} round(s), peers alternated.",
        "",
    ]
    for peer, why in report["skipped"].items():
        lines += [f"Skipped: {PEER_NAMES[peer]}: {why}.", ""]
    phases = ("launch", "imports", "cuda_init", "process_group", "setup", "first_batch", "first_step")
    for model, result in report["summary"].items():
        lines += [
            f"## {model}",
            "",
            "| peer | images/s, saves included (median, min-max) | command to first step (s) | "
            + " | ".join(phases)
            + " | peak GPU memory (GiB) | checkpoint (MB) |",
            "|---|---|---|" + "---|" * len(phases) + "---|---|",
        ]
        for peer, value in result["peers"].items():
            rate, first = value["images_per_s"], value["time_to_first_step_s"]
            breakdown = " | ".join(f"{value['startup_phases_s'].get(name, 0.0):.2f}" for name in phases)
            lines.append(
                f"| {PEER_NAMES[peer]} | {rate['median']:,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f}) | "
                f"{first['median']:.1f} ({first['min']:.1f}-{first['max']:.1f}) | {breakdown} | "
                f"{value['max_gpu_allocated_bytes'] / 2**30:.2f} | {value['checkpoint_bytes'] / 1e6:.1f} |"
            )
        ratio = result["ratio_ddpkit_over_best_peer"]
        lines += ["", f"ddpkit / best peer (images/s medians): {ratio:.2f} (T11: >= 1.0)" if ratio else "", ""]
    for failure in report["failures"]:
        lines += [
            f"Failed: {failure['peer']} on {failure['model']}, round {failure['round']} (exit {failure['failed']}).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    models, peers = args.models.split(","), args.peers.split(",")
    skipped = missing_peers(peers)
    for peer, why in skipped.items():
        print(f"gpu_peers: skipping {peer}: {why}", file=sys.stderr)
    peers = [peer for peer in peers if peer not in skipped]
    runs, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu-peers-") as scratch:
        for round_ in range(args.rounds):
            for model in models:
                for peer in peers if round_ % 2 == 0 else peers[::-1]:
                    run = run_peer(args, peer, model, Path(scratch), round_)
                    (failures if "failed" in run else runs).append(run)
                    what = (
                        f"failed ({run['failed']})" if "failed" in run else f"{run['images_per_s'] or 0:,.0f} images/s"
                    )
                    print(f"gpu_peers: round {round_} {model} {peer}: {what}", file=sys.stderr, flush=True)
    name = gpu_name() if args.device == "cuda" else ""
    machine = {**machine_info(), "gpu": name}
    if "accelerate" not in skipped and "accelerate" in args.peers:
        machine["accelerate"] = importlib.metadata.version("accelerate")
    date = datetime.date.today().isoformat()
    words = ["python", "benchmarks/gpu_peers.py", *(sys.argv[1:] if argv is None else argv)]
    report = {
        "benchmark": "gpu_peers",
        "date": date,
        "command": shlex.join(words),
        "machine": machine,
        "config": vars(args),
        "skipped": skipped,
        "summary": summarize_runs(runs, models, peers),
        "runs": runs,
        "failures": failures,
    }
    stem = file_stem(f"gpu-peers-{machine_slug(args.device, name)}-{date}", args.smoke, args.tag)
    for path in write_report(report, args.output_dir, stem, render_markdown):
        print(path)
    for failure in failures:
        print(f"gpu_peers: {failure['peer']} {failure['model']} failed:\n{failure['output_tail']}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
