"""T15: elastic recovery, the time from a node's loss to the survivors' first training step after it.

Two emulated nodes (:mod:`ddpkit.bench.netns`: namespaces A at 10.78.0.1 and
B at 10.78.0.2), each running one launcher with one worker, join one job of
``nnodes=1:2`` whose rendezvous store is on A. Once the job has trained
``kill_after`` steps on both nodes, node B's launcher and workers are
SIGKILLed at once (every process of B, as a lost machine); A's workers must
notice, its launcher re-rendezvous alone, and its workers go on from the
newest checkpoint. Each run is one of two launches of the same training
loop:

- ``ddpkit``: ``ddpkit run nnodes=1:2 nproc=1 master_addr=A master_port=P``
  of a script with a ``ddpkit.DataLoader`` and a ``ddpkit.Checkpointer``
  (an elastic launch allows one restart per node that may leave);
- ``torchrun``: ``torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d
  --rdzv-endpoint=A:P --max-restarts=3`` of a plain script (DDP, a
  DistributedSampler) that saves and loads its own checkpoint, as torchrun's
  elastic tutorial does (A gets
  ``--rdzv-conf=is_host=1`` and each node ``--local-addr``: both namespaces
  share one host name, so torch cannot tell from it which agent serves the
  store, nor where the other node's workers are; and ``GLOO_SOCKET_IFNAME``
  names the node's interface, which ddpkit finds by itself).

Every worker appends timestamped events (JSON lines, wall clock) to its
node's file: ``start`` (the process began, before importing torch),
``init`` (the process group is ready), ``loaded`` (the checkpoint is
loaded), ``step`` (an optimizer step ended) and ``failed`` (a step raised:
the worker saw the loss). The parts of a recovery are the gaps between the
kill and the survivors' next events (:func:`recovery_parts`):

==============  =====================================================
detection       kill -> a survivor's step fails (its collective errs)
rendezvous      -> a new worker process starts (the launcher noticed,
                stopped its workers, met the others again, spawned)
restart         -> its process group is ready (imports, gloo)
checkpoint      -> the model, optimizer and loader are built and the
                newest checkpoint is loaded
first step      -> its first optimizer step after the loss ends
==============  =====================================================

A launcher that keeps its workers and re-forms the group in place skips
``start`` (and perhaps ``failed``); a missing event merges its part into the
next. Rounds alternate the two launches (ddpkit first in even rounds).

Caveat of the emulation: a SIGKILLed process's sockets are closed by the
one kernel both namespaces share, so the survivors see the connection
reset at once; a machine that loses power sends nothing and its loss is
found only by timeouts (the collective timeout, the rendezvous heartbeat).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.bench.netns import ADDRESSES, Host, two_hosts

PARTS = ("detection", "rendezvous", "restart", "checkpoint", "first_step")
"""The parts of a recovery, in order; they add up to ``total``."""
_PART_EVENTS = (("detection", "failed"), ("rendezvous", "start"), ("restart", "init"), ("checkpoint", "loaded"))
LAUNCHES = ("ddpkit", "torchrun")
"""The two launches of a round, see the module docstring."""

_COMMON = """\
import json, os, sys, time
T0 = time.time()
EVENTS, STEPS, KEEP = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ROUND = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"  # new in every rendezvous round


def event(name, **fields):
    # One JSON line per event, appended and flushed at once: the process may be SIGKILLed at any time.
    line = json.dumps({"event": name, "t": time.time(), "pid": os.getpid(), "round": ROUND, **fields})
    with open(EVENTS, "a") as f:
        f.write(line + "\\n")


event("start", started=T0)
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

NUM_SAMPLES, GLOBAL_BATCH = 1280, 32  # 40 steps an epoch at any world size
generator = torch.Generator().manual_seed(5)
x = torch.randn(NUM_SAMPLES, 64, generator=generator)
dataset = TensorDataset(x, (x[:, :10].argmax(1)), torch.arange(NUM_SAMPLES))


def network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def train_step(model, optimizer, xb, yb, step):
    try:
        loss = nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    except Exception as e:
        event("failed", step=step, error=type(e).__name__)
        raise
"""

TORCHRUN_SCRIPT = (
    _COMMON
    + """
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
event("init", rank=rank, world_size=world_size)
model = nn.parallel.DistributedDataParallel(network())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sampler = DistributedSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)
path, step = os.path.join(KEEP, "checkpoint.pt"), 0
if os.path.exists(path):  # torchrun's elastic tutorial: every (re)start loads the newest checkpoint
    state = torch.load(path)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
event("loaded", step=step)
epoch, skip = divmod(step, len(loader))  # the position, counted in batches of this world size
while step < STEPS:
    sampler.set_epoch(epoch)
    for i, (xb, yb, indices) in enumerate(loader):
        if i < skip or step >= STEPS:
            continue
        train_step(model, optimizer, xb, yb, step)
        step += 1
        if rank == 0 and step % 5 == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
        event("step", step=step, epoch=epoch, world_size=world_size, indices=indices.tolist())
        time.sleep(0.05)
    epoch, skip = epoch + 1, 0
dist.destroy_process_group()
"""
)
"""The plain script torchrun runs: DDP, a DistributedSampler, its own checkpoint every 5 steps, loaded at every
start, skipping the batches of the epoch it had trained."""

DDPKIT_SCRIPT = (
    _COMMON
    + """
import ddpkit

ctx = ddpkit.init()
event("init", rank=ctx.rank, world_size=ctx.world_size)
model = ddpkit.prepare_model(network())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = ddpkit.DataLoader(dataset, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=3)
ckpt = ddpkit.Checkpointer(KEEP, model=model, optimizer=optimizer, loader=loader, every_steps=5)
start = ckpt.resume("auto")
event("loaded", step=ckpt.global_step)
for epoch in range(start.epoch, STEPS):
    loader.set_epoch(epoch)
    for xb, yb, indices in loader:
        if ckpt.global_step >= STEPS:
            break
        train_step(model, optimizer, xb, yb, ckpt.global_step)
        ckpt.step()
        event("step", step=ckpt.global_step, epoch=epoch, world_size=ctx.world_size, indices=indices.tolist())
        time.sleep(0.05)
    if ckpt.global_step >= STEPS:
        break
    ckpt.epoch_end()
ckpt.close()
"""
)
"""The same loop as a ddpkit user writes it: a ddpkit.DataLoader and a ddpkit.Checkpointer saving every 5 steps."""


@dataclass(frozen=True)
class RecoverySpec:
    """One run's shape: how long it trains, when node B is lost, how long it may take."""

    steps: int = 60
    """Optimizer steps of the whole run."""
    kill_after: int = 22
    """Node B is killed once node A has ended this many steps on two nodes (mid-way between two checkpoints)."""
    timeout: float = 240.0
    """Seconds one run may take before it counts as hung."""
    port: int = 29640
    """Rendezvous port on node A: free there, as every run makes its namespaces anew (each its own ports)."""
    last_call: int = 30
    """Seconds a rendezvous waits for more nodes once the fewest are there (torch's last_call_timeout, its default
    and ddpkit's): given to both launches, ``rdzv_last_call=`` and ``--rdzv-conf=last_call_timeout=``."""


def command(
    launch: str, host: Host, store: Host, script: Path, events: Path, keep: Path, spec: RecoverySpec
) -> list[str]:
    """The launcher command of ``launch`` on ``host``, the store being on ``store``."""
    program = [str(script), str(events), str(spec.steps), str(keep)]
    if launch == "torchrun":
        is_host = int(host == store)
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={store.address}:{spec.port}", "--rdzv-id=t15",
            f"--rdzv-conf=is_host={is_host},last_call_timeout={spec.last_call}", f"--local-addr={host.address}",
            "--max-restarts=3", *program,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "ddpkit", "run", "nnodes=1:2", "nproc=1", f"master_addr={store.address}",
        f"master_port={spec.port}", f"rdzv_last_call={spec.last_call}", *program,
    ]  # fmt: skip


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one node's file, in the order written; a line cut by the kill is left out."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def recovery_parts(events: Sequence[Mapping[str, Any]], killed_at: float) -> dict[str, float | None]:
    """The parts of the survivor's recovery (seconds), from its events and the time of the kill.

    Each part ends at the first event of its kind after the previous part's end; a part whose event is
    missing is None and its time counts in the next part. ``total`` is from the kill to the end of the
    first optimizer step after it; ``steps_redone`` the steps trained again (lost since the newest checkpoint).

    Raises:
        ValueError: no step ended after the kill.
    """
    before = [e for e in events if e["event"] == "step" and e["t"] <= killed_at]
    size = before[-1]["world_size"] if before else 0
    after = [e for e in events if e["t"] > killed_at]
    # A step whose all_reduce ended before the kill may end after it: the first step of the recovery is the
    # first at the smaller size.
    steps = [e for e in after if e["event"] == "step" and e["world_size"] < size]
    if not steps:
        raise ValueError("the survivor ended no step at a smaller world size after the kill")
    parts: dict[str, float | None] = {}
    mark, remaining = killed_at, [e for e in after if e["t"] <= steps[0]["t"]]
    for part, kind in _PART_EVENTS:
        found = next((e for e in remaining if e["event"] == kind), None)
        parts[part] = None if found is None else round(found["t"] - mark, 3)
        if found is not None:
            mark, remaining = found["t"], [e for e in remaining if e["t"] >= found["t"]]
    parts["first_step"] = round(steps[0]["t"] - mark, 3)
    parts["total"] = round(steps[0]["t"] - killed_at, 3)
    parts["steps_redone"] = float(max(e["step"] for e in before) - (steps[0]["step"] - 1))
    return parts


def each_sample_once(events: Sequence[Mapping[str, Any]], num_samples: int = 1280) -> bool:
    """Whether every sample of each epoch was trained exactly once by the steps that count (every node's events).

    A global step counts as the rendezvous round that trained it last did it (a step redone after a restart
    replaces the lost one); an epoch before the last must hold every one of ``num_samples`` samples.
    """
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"])
    last_round = {e["step"]: e["round"] for e in steps}
    counts: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for e in steps:
        if e["round"] == last_round[e["step"]]:
            counts[e["epoch"]].update(e["indices"])
    return all(
        set(c.values()) <= {1} and (epoch == max(counts) or len(c) == num_samples) for epoch, c in counts.items()
    )


def run_once(launch: str, spec: RecoverySpec, folder: Path, addresses: tuple[str, str] = ADDRESSES) -> dict[str, Any]:
    """One run of ``launch`` on two fresh emulated nodes (at ``addresses``), node B killed mid-run; its parts."""
    folder.mkdir(parents=True)
    script = folder / "train.py"
    script.write_text(DDPKIT_SCRIPT if launch == "ddpkit" else TORCHRUN_SCRIPT)
    keep = folder / "checkpoints"
    keep.mkdir()
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}
    with two_hosts(addresses) as (a, b):
        procs = {}
        for name, host in (("a", a), ("b", b)):
            argv = command(launch, host, a, script, folder / f"events-{name}.jsonl", keep, spec)
            log = open(folder / f"launcher-{name}.log", "w")  # noqa: SIM115  # closed with the process
            # gloo's interface: ddpkit picks the one that routes to master_addr; a torchrun user names it.
            env = {**environ, "GLOO_SOCKET_IFNAME": host.interface} if launch == "torchrun" else environ
            procs[name] = (subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=env), log)
        killed_at = None
        try:
            killed_at = _kill_b_after(b, folder / "events-a.jsonl", spec)
            returncode = procs["a"][0].wait(timeout=spec.timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            for host in (a, b):
                kill_host(host)
            for proc, log in procs.values():
                proc.wait()
                log.close()
    events = read_events(folder / "events-a.jsonl")
    row: dict[str, Any] = {"launch": launch, "returncode": returncode}
    try:
        if killed_at is None:
            raise ValueError(f"the job never trained {spec.kill_after} steps on two nodes")
        row.update(recovery_parts(events, killed_at))
    except ValueError as e:
        row["error"] = str(e)
    row["final_world_size"] = next((e["world_size"] for e in reversed(events) if e["event"] == "step"), None)
    row["each_sample_once"] = each_sample_once(events + read_events(folder / "events-b.jsonl"))
    return row


def _kill_b_after(b: Host, events_a: Path, spec: RecoverySpec) -> float:
    """Wait until node A has ended ``kill_after`` steps on two nodes, SIGKILL all of node B; the time of the kill."""
    deadline = time.monotonic() + spec.timeout
    while time.monotonic() < deadline:
        done = [e for e in read_events(events_a) if e["event"] == "step" and e["world_size"] == 2]
        if len(done) >= spec.kill_after:
            killed_at = time.time()
            kill_host(b)
            return killed_at
        time.sleep(0.01)
    raise subprocess.TimeoutExpired("node A's first steps on two nodes", spec.timeout)


def kill_host(host: Host) -> None:
    """SIGKILL every process in host's namespace at once, as when the machine is lost."""
    listed = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, check=False)
    for pid in map(int, listed.stdout.split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_rounds(rounds: int, spec: RecoverySpec, launches: Sequence[str] = LAUNCHES) -> list[dict[str, Any]]:
    """``rounds`` alternated pairs of runs (ddpkit first in even rounds); one row per run."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-t15-") as tmp:
        for index in range(rounds):
            order = list(launches) if index % 2 == 0 else list(reversed(launches))
            for launch in order:
                row = {"round": index, **run_once(launch, spec, Path(tmp) / f"{index}-{launch}")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def summarize_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per launch, the median of each part and of the total over its successful runs (None where none)."""
    out: dict[str, dict[str, float | None]] = {}
    for launch in sorted({row["launch"] for row in rows}):
        good = [row for row in rows if row["launch"] == launch and row["returncode"] == 0 and "total" in row]
        medians: dict[str, float | None] = {
            "runs": float(len(good)),
            "each_sample_once": float(sum(bool(row.get("each_sample_once")) for row in good)),
        }
        for part in (*PARTS, "total", "steps_redone"):
            values = [row[part] for row in good if row.get(part) is not None]
            medians[part] = round(statistics.median(values), 3) if values else None
        out[launch] = medians
    return out


def build_report(rows: Sequence[Mapping[str, Any]], spec: RecoverySpec, command_line: str) -> dict[str, Any]:
    """The JSON record of a benchmark: the machine, the command, every run and the medians with their ratio."""
    from ddpkit.bench.system import machine_info

    medians = summarize_rows(rows)
    ddpkit_total = medians.get("ddpkit", {}).get("total")
    torchrun_total = medians.get("torchrun", {}).get("total")
    ratio = round(ddpkit_total / torchrun_total, 3) if ddpkit_total and torchrun_total else None
    return {
        **machine_info(),
        "command": command_line,
        "spec": dataclasses.asdict(spec),
        "commands": {launch: _shown(launch, spec) for launch in LAUNCHES},
        "medians": medians,
        "ratio_ddpkit_over_torchrun": ratio,
        "runs": list(rows),
    }


def _shown(launch: str, spec: RecoverySpec) -> str:
    a, b = Host("A", "veth-a", ADDRESSES[0]), Host("B", "veth-b", ADDRESSES[1])
    words = command(launch, b, a, Path("train.py"), Path("EVENTS"), Path("KEEP"), spec)
    return " ".join(["python" if w == sys.executable else w for w in words])


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as a Markdown page: the medians of each part beside each other, then every run."""
    medians, ratio = report["medians"], report["ratio_ddpkit_over_torchrun"]
    launches = [launch for launch in LAUNCHES if launch in medians]
    lines = [
        "# T15: elastic recovery, node lost to the survivors' first step",
        "",
        f"{report['date']} · torch {report['torch']} · {report['cores']} cores ({report['cpu_model']})",
        "",
        f"Command: `{report['command']}`",
        "",
        "Two emulated nodes (network namespaces, 10.78.0.1 and 10.78.0.2), one worker each, `nnodes=1:2`; "
        f"node B (its launcher and workers) SIGKILLed after {report['spec']['kill_after']} steps on two nodes; "
        "seconds from the kill (medians of the runs that ended with rc 0). See "
        "`src/ddpkit/bench/elastic_recovery.py` for what each part spans.",
        "",
        "| part | " + " | ".join(launches) + " |",
        "|---|" + "---|" * len(launches),
    ]
    labels = {"runs": "runs ending with rc 0", "each_sample_once": "of those, each sample of an epoch once"}
    for part in (*PARTS, "total", "steps_redone", "runs", "each_sample_once"):
        counted = part in ("steps_redone", *labels)
        cells = [_cell(medians[launch].get(part), whole=counted) for launch in launches]
        lines.append(f"| {labels.get(part, part.replace('_', ' '))} | " + " | ".join(cells) + " |")
    lines += ["", f"Ratio ddpkit / torchrun (median totals): {_cell(ratio)}", "", "Commands (on node B):", ""]
    lines += [f"- {launch}: `{report['commands'][launch]}`" for launch in launches]
    lines += [
        "",
        "| round | launch | rc | total s | " + " | ".join(PARTS) + " | each sample once | note |",
        "|---" * (6 + len(PARTS)) + "|",
    ]
    for row in report["runs"]:
        cells = [_cell(row.get(part)) for part in PARTS]
        lines.append(
            f"| {row['round']} | {row['launch']} | {row['returncode']} | {_cell(row.get('total'))} | "
            + " | ".join(cells)
            + f" | {row.get('each_sample_once', '-')} | {row.get('error', '')} |"
        )
    return "\n".join(lines) + "\n"


def _cell(value: Any, whole: bool = False) -> str:
    if value is None:
        return "-"
    if whole:
        return f"{value:g}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
