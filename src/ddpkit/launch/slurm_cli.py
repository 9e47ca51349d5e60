"""``ddpkit slurm``: write, print or submit the sbatch script of a training job.

Options name the Slurm resources and how to launch; the remaining words
(bare ``key=value`` words, and everything after ``--``) are the training
config overrides that every worker's ``python -m ddpkit train`` receives::

    ddpkit slurm --nodes 2 --tasks-per-node 4 --gpus-per-node 4 --time 2:00:00 \\
        --launch torchrun --preempt-signal USR1 model=mlp epochs=5
    ddpkit slurm ... --output-script train.sbatch    # write it
    ddpkit slurm ... --submit                        # sbatch it, print the job id

The environment is the virtual environment ddpkit runs from unless
``--venv``, ``--module`` or ``--apptainer`` says otherwise. See
:mod:`ddpkit.launch.sbatch` for what the script does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from ddpkit.launch.sbatch import ENV_MODES, LAUNCH_MODES, SbatchSpec, render_sbatch

EXIT_USER_ERROR = 2
SBATCH_MISSING = "sbatch not found: install Slurm's client or run without --submit"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ddpkit slurm``."""
    defaults = SbatchSpec.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="ddpkit slurm",
        description="Write, print or submit an sbatch script that trains with ddpkit.",
        epilog="Words after the options (key=value, or anything after --) are passed to `ddpkit train`.",
    )
    res = p.add_argument_group("resources")
    res.add_argument("--nodes", "-N", type=int, default=1, help="number of nodes (default 1)")
    res.add_argument("--tasks-per-node", "--ntasks-per-node", type=int, default=1, metavar="T",
                     help="workers per node (default 1)")
    res.add_argument("--gpus-per-node", type=int, default=0, metavar="G", help="GPUs per node (default 0)")
    res.add_argument("--cpus-per-task", "-c", type=int, default=1, metavar="C", help="CPU cores per worker (default 1)")
    res.add_argument("--partition", "-p", default="")
    res.add_argument("--account", "-A", default="")
    res.add_argument("--qos", default="")
    res.add_argument("--time", "-t", default="", help="time limit, e.g. 90 (minutes), 2:00:00, 1-12:00")
    res.add_argument("--job-name", "-J", default=defaults["job_name"].default)
    res.add_argument("--output", "-o", default=defaults["output"].default, help="stdout file (%%j: job id)")
    res.add_argument("--error", "-e", default="", help="stderr file (default: with stdout)")

    run = p.add_argument_group("launch and environment")
    run.add_argument("--launch", choices=LAUNCH_MODES, default="srun",
                     help="srun: a task per worker; torchrun: a torchrun per node; mpirun: OpenMPI ranks")
    run.add_argument("--env", choices=ENV_MODES, default=None,
                     help="software environment (default: apptainer with --apptainer, modules with only "
                          "--module, else venv)")
    run.add_argument("--venv", default="", help="virtual environment to activate (default: the one running ddpkit)")
    run.add_argument("--module", action="append", default=[], metavar="NAME", help="module to load (repeatable)")
    run.add_argument("--apptainer", default="", metavar="IMAGE", help="Apptainer image to run every worker in")
    run.add_argument("--project-root", default="", metavar="DIR", help="where the job runs (default: here)")
    run.add_argument("--python", default="python", help="Python executable of the workers (default python)")
    run.add_argument("--command", default="", metavar="CMD",
                     help="run CMD instead of `python -m ddpkit train`, e.g. 'python my_train.py'")

    opt = p.add_argument_group("options")
    opt.add_argument("--nccl-debug", default="", metavar="LEVEL", help="NCCL_DEBUG: VERSION, WARN, INFO or TRACE")
    opt.add_argument("--nccl-debug-subsys", default="", metavar="LIST", help="NCCL_DEBUG_SUBSYS, e.g. INIT,NET")
    opt.add_argument("--stage-data", default="", metavar="DIR", help="copy DIR to node-local storage first")
    opt.add_argument("--stage-data-to", default=defaults["stage_data_to"].default, metavar="DIR",
                     help="node-local copy (default %(default)s)")
    opt.add_argument("--stage-data-key", default=defaults["stage_data_key"].default, metavar="KEY",
                     help="config key given the node-local path (default %(default)s)")
    opt.add_argument("--preempt-signal", default="", metavar="SIG",
                     help="signal the training processes before the time limit, e.g. USR1; then requeue")
    opt.add_argument("--preempt-grace", type=int, default=defaults["preempt_grace_seconds"].default,
                     metavar="SECONDS", help="seconds before the time limit (default %(default)s)")
    opt.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None,
                     help="make the job requeueable (default: with --preempt-signal)")

    out = p.add_argument_group("output")
    out.add_argument("--output-script", default="", metavar="PATH", help="write the script to PATH")
    out.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    p.add_argument("train_args", nargs="*", metavar="key=value", help=argparse.SUPPRESS)
    return p


def spec_from_args(args: argparse.Namespace, train_args: Sequence[str]) -> SbatchSpec:
    """The SbatchSpec that parsed options describe; ValueError if they do not make one."""
    env_mode = args.env or _infer_env_mode(args)
    venv = args.venv
    if env_mode == "venv" and not venv:
        venv = _running_venv()
        if not venv:
            raise ValueError("no environment to run in: pass --venv PATH, --module NAME or --apptainer IMAGE")
    signal_name = args.preempt_signal.upper().removeprefix("SIG")
    return SbatchSpec(
        job_name=args.job_name,
        nodes=args.nodes,
        tasks_per_node=args.tasks_per_node,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time=args.time,
        output=args.output,
        error=args.error,
        launch_mode=args.launch,
        env_mode=env_mode,
        venv=_absolute(venv),
        modules=tuple(args.module),
        apptainer_image=_absolute(args.apptainer),
        project_root=_absolute(args.project_root or os.getcwd()),
        nccl_debug=args.nccl_debug.upper(),
        nccl_debug_subsys=args.nccl_debug_subsys,
        stage_data_from=_absolute(args.stage_data),
        stage_data_to=args.stage_data_to,
        stage_data_key=args.stage_data_key,
        preempt_signal=signal_name,
        preempt_grace_seconds=args.preempt_grace,
        requeue=bool(signal_name) if args.requeue is None else args.requeue,
        train_args=tuple(train_args),
        python=args.python,
        command=tuple(shlex.split(args.command)),
    )


def main(argv: Sequence[str]) -> int:
    """Run ``ddpkit slurm`` with argv (the words after "slurm").

    Args:
        argv: Options, then training overrides (bare key=value words or
            anything after ``--``).

    Returns:
        0 on success, 2 for bad input or a missing sbatch, sbatch's status
        when it fails.
    """
    argv = list(argv)
    head, tail = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(head)
    except SystemExit as e:  # argparse has printed usage and the error
        return int(e.code or 0)
    try:
        spec = spec_from_args(args, [*args.train_args, *tail])
    except ValueError as e:
        print(f"ddpkit slurm: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    script = render_sbatch(spec)
    if args.output_script:
        with open(args.output_script, "w") as f:
            f.write(script)
        os.chmod(args.output_script, 0o755)
        print(f"wrote {args.output_script}", file=sys.stderr)
    if args.submit:
        _make_log_folders(spec)
        return _submit(script, args.output_script)
    if not args.output_script:
        sys.stdout.write(script)
    return 0


def _submit(script: str, path: str) -> int:
    """sbatch the script (the written file, else on stdin) and print the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"ddpkit slurm: error: {SBATCH_MISSING}", file=sys.stderr)
        return EXIT_USER_ERROR
    command = [sbatch, "--parsable", *([path] if path else [])]
    result = subprocess.run(command, input=None if path else script, capture_output=True, text=True)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
        print(f"ddpkit slurm: error: sbatch failed: {reason}", file=sys.stderr)
        return result.returncode
    # --parsable prints "jobid" or "jobid;cluster".
    print(result.stdout.strip().split(";")[0])
    return 0


def _make_log_folders(spec: SbatchSpec) -> None:
    """Create the folders of the output files: Slurm does not, and the job would fail without a word."""
    for path in (spec.output, spec.error):
        folder = os.path.dirname(path)
        if folder and "%" not in folder:
            os.makedirs(os.path.join(spec.project_root, folder), exist_ok=True)


def _infer_env_mode(args: argparse.Namespace) -> str:
    if args.apptainer:
        return "apptainer"
    if args.module and not args.venv:
        return "modules"
    return "venv"


def _running_venv() -> str:
    """The virtual environment of this Python, or "" outside one."""
    return sys.prefix if sys.prefix != sys.base_prefix else ""


def _absolute(path: str) -> str:
    # Paths are resolved where the script is written; the job may run elsewhere.
    # $VAR paths are left for the batch shell.
    return os.path.abspath(os.path.expanduser(path)) if path and not path.startswith("$") else path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
