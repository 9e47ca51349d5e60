"""Physically sharded data: each node reads only the shard files on its own disk.

For clusters without a shared file system. The layout on disk::

    data/                       the whole data set (shared storage, or where it was made)
      manifest.json             {"format": "ddpkit-node-shards/1",
                                 "shards": [{"name": "shard-00000.pt", "samples": 50}, ...]}
      shard-00000.pt            torch.save'd tuple of tensors, one row per sample
      shard-00001.pt ...
    /local/data/  (on node k)   manifest.json and the shards node k holds: shard i with i % nodes == k

:func:`write_shards` makes ``data/`` from tensors; :func:`stage_node_shards`
copies node k's shards and the manifest to a node-local folder, once per node
(local rank 0 copies, the node's other ranks wait, as ``main_process_first``).
:class:`NodeShards` reads a node's folder; ``ddpkit.DataLoader(NodeShards(folder),
batch_size=B)`` hands each rank its share of its own node's samples.

An epoch covers every sample of the job once. Each node shuffles its own
samples from (seed, epoch) and cuts them into node batches of
``B * ranks_per_node``, split across the node's ranks. Nodes may hold different
numbers of samples: an epoch has as many steps as the node with the most
batches needs, and a node whose samples have run out hands its ranks zero-row
batches for the remaining steps, so no sample is dropped or repeated and every
rank runs the same steps (DDP's all_reduce needs that). ``loader.global_mean``
divides by the samples of the step over the whole job.

The nodes check at start-up that together they hold every shard of the
manifest exactly once, with the same number of ranks each, and refuse in one
line otherwise. A run resumes exactly at the same layout (nodes and ranks per
node); a checkpoint saved at another layout is refused, since the samples of a
step depend on which node holds them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.distributed import context, main_process_first
from ddpkit.errors import UserError

__all__ = ["NodeBatchSampler", "NodeShards", "stage_node_shards", "write_shards"]

FORMAT = "ddpkit-node-shards/1"
MANIFEST = "manifest.json"


def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard-{index:05d}.pt"


def write_shards(tensors: Sequence[torch.Tensor], folder: str | Path, num_shards: int) -> Path:
    """Write ``tensors`` (one row per sample) as ``num_shards`` shard files and a manifest into ``folder``.

    Samples are cut into contiguous shards as ``torch.tensor_split`` cuts them.
    Returns the manifest's path.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    parts = [torch.tensor_split(tensor, num_shards) for tensor in tensors]
    shards = []
    for index in range(num_shards):
        shard = tuple(part[index].clone() for part in parts)
        torch.save(shard, folder / shard_name(index))
        shards.append({"name": shard_name(index), "samples": len(shard[0])})
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT, "shards": shards}, indent=1))
    return manifest


def read_manifest(folder: Path) -> list[dict[str, Any]]:
    """The shards listed in ``folder``'s manifest, or one line saying what is wrong."""
    path = folder / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} does not exist; a node's shard folder needs the data set's {MANIFEST} (write_shards)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a {FORMAT} manifest; write it with ddpkit's write_shards")
    return list(manifest["shards"])


def node_layout() -> tuple[int, int, int, int]:
    """(node, nodes, local rank, ranks per node) of this process; (0, 1, 0, 1) without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, 0, 1
    ctx = context()
    # Launchers number ranks node after node: node k holds ranks k * local_world_size ...
    return (
        ctx.rank // ctx.local_world_size,
        ctx.world_size // ctx.local_world_size,
        ctx.local_rank,
        ctx.local_world_size,
    )


def stage_node_shards(
    source: str | Path, destination: str | Path, node: int | None = None, nodes: int | None = None
) -> Path:
    """Copy node ``node``'s shards (shard i with i % nodes == node) and the manifest from ``source`` to ``destination``.

    Once per node: local rank 0 copies, the node's other ranks wait for it
    (under a process group; call it on every rank). Files already there with
    the same size are kept, so a restarted job does not copy again. ``node``
    and ``nodes`` default to this process's node and the job's node count.
    Returns ``destination``.
    """
    source, destination = Path(source), Path(destination)
    here, count, local_rank, _ = node_layout()
    node = here if node is None else node
    nodes = count if nodes is None else nodes
    if not (dist.is_available() and dist.is_initialized()):
        _copy_node_shards(source, destination, node, nodes)
        return destination
    with main_process_first(local=True):
        if local_rank == 0:
            _copy_node_shards(source, destination, node, nodes)
    return destination


def _copy_node_shards(source: Path, destination: Path, node: int, nodes: int) -> None:
    shards = read_manifest(source)
    destination.mkdir(parents=True, exist_ok=True)
    names = [MANIFEST] + [shard["name"] for index, shard in enumerate(shards) if index % nodes == node]
    for name in names:
        target = destination / name
        if target.exists() and target.stat().st_size == (source / name).stat().st_size:
            continue
        partial = target.with_name(target.name + ".partial")  # never a half-copied shard under its own name
        shutil.copyfile(source / name, partial)
        partial.replace(target)


class NodeShards(TensorDataset):
    """The samples of the shard files in this node's ``folder``, checked against every other node's.

    A ``TensorDataset`` over the local shards, concatenated in shard order.
    Under a process group the constructor is a collective (every rank builds
    one): the nodes exchange what they hold and refuse, in one line, a shard
    on no node or on two, nodes with different numbers of ranks, or
    manifests that differ.

    Attributes:
        node, nodes, local_rank, local_world_size: this process's place in the job.
        held: indices of the shards this node holds.
        node_samples: samples held by each node, indexed by node.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        shards = read_manifest(folder)
        self.node, self.nodes, self.local_rank, self.local_world_size = node_layout()
        self.held = [index for index, shard in enumerate(shards) if (folder / shard["name"]).is_file()]
        parts = [torch.load(folder / shards[index]["name"], weights_only=True) for index in self.held]
        for index, part in zip(self.held, parts):
            if len(part[0]) != shards[index]["samples"]:
                raise UserError(
                    f"{folder / shards[index]['name']} holds {len(part[0])} samples but the manifest says "
                    f"{shards[index]['samples']}; copy the shard again from the data set"
                )
        if not parts:
            raise UserError(f"node {self.node} holds no shard of {len(shards)} in {folder}; stage its shards there")
        super().__init__(*(torch.cat(column) for column in zip(*parts)))
        self.node_samples = self._agree(folder, shards)

    def _agree(self, folder: Path, shards: list[dict[str, Any]]) -> list[int]:
        """Every node's sample count, after checking that the nodes together hold each shard once."""
        mine = (self.node, self.local_world_size, self.held, shards, str(folder))
        everyone = [mine]
        if not (self.nodes == 1 and self.local_world_size == 1):
            everyone *= dist.get_world_size()  # placeholders, each replaced by that rank's own
            dist.all_gather_object(everyone, mine)
        check_layout(everyone, len(shards))
        held = {node: held for node, _, held, _, _ in everyone}
        return [sum(shards[index]["samples"] for index in held[node]) for node in range(self.nodes)]

    def batch_sampler(self, node_batch_size: int, seed: int, shuffle: bool, drop_last: bool) -> NodeBatchSampler:
        """The sampler that ``ddpkit.DataLoader`` uses over this dataset (see the module's docstring)."""
        return NodeBatchSampler(
            self.node_samples,
            self.node,
            node_batch_size,
            self.local_rank,
            self.local_world_size,
            seed,
            shuffle,
            drop_last,
        )


def _numbers(indices: Sequence[int]) -> str:
    return ",".join(map(str, indices)) or "none"


def check_layout(everyone: Sequence[tuple[int, int, list[int], list[dict[str, Any]], str]], num_shards: int) -> None:
    """Raise one line unless the nodes (one entry per rank) hold every shard once, with the same ranks and manifest."""
    first_manifest = everyone[0][3]
    sizes = sorted({(node, size) for node, size, _, _, _ in everyone})
    if len({size for _, size in sizes}) > 1:
        said = ", ".join(f"node {node} {size}" for node, size in sizes)
        raise UserError(
            f"nodes run different numbers of ranks ({said}); node-sharded data needs the same nproc on every node"
        )
    by_node: dict[int, list[int]] = {}
    for node, _, held, manifest, folder in everyone:
        if manifest != first_manifest:
            raise UserError(
                f"node {node}'s manifest in {folder} differs from rank 0's; stage every node from one data set"
            )
        if by_node.setdefault(node, held) != held:
            raise UserError(
                f"the ranks of node {node} see different shards in {folder}; give a node's ranks one folder"
            )
    owner: dict[int, int] = {}
    for node, held in sorted(by_node.items()):
        for index in held:
            if index in owner:
                raise UserError(
                    f"node {node} holds shards {_numbers(held)} of {num_shards} but node {owner[index]} also holds "
                    f"shard {index}; keep each shard on one node only (stage_node_shards)"
                )
            owner[index] = node
    missing = [index for index in range(num_shards) if index not in owner]
    if missing:
        said = "; ".join(f"node {node} holds {_numbers(held)}" for node, held in sorted(by_node.items()))
        which = (
            f"shards {_numbers(missing)} of {num_shards} are"
            if len(missing) > 1
            else f"shard {missing[0]} of {num_shards} is"
        )
        raise UserError(
            f"{which} on no node ({said}); copy {'them' if len(missing) > 1 else 'it'} to one node's folder"
        )


class NodeBatchSampler(GlobalBatchSampler):
    """This rank's share of its node's batch at each step; zero-row shares once the node's samples run out.

    A :class:`GlobalBatchSampler` over the node's samples, ``rank`` and
    ``world_size`` the node's, with as many steps as the node that needs the
    most; its state also records the layout, and loads only at the same one.
    """

    def __init__(
        self,
        node_samples: Sequence[int],
        node: int,
        node_batch_size: int,
        local_rank: int,
        local_world_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool,
    ):
        super().__init__(node_samples[node], node_batch_size, local_rank, local_world_size, seed, shuffle, drop_last)
        self.node_samples, self.node = list(node_samples), node

    def _node_steps(self, samples: int) -> int:
        full, rest = divmod(samples, self.global_batch_size)
        return full + (rest > 0 and not self.drop_last)

    def _node_batch_length(self, samples: int, step: int) -> int:
        if step >= self._node_steps(samples):
            return 0
        return min(self.global_batch_size, samples - step * self.global_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch: the most any node's samples make (nodes with fewer finish on zero-row batches)."""
        return max(self._node_steps(samples) for samples in self.node_samples)

    def global_batch_length(self, step_in_epoch: int) -> int:
        """Samples of this node's batch ``step_in_epoch`` (0 once the node's samples have run out)."""
        return self._node_batch_length(self.num_samples, step_in_epoch)

    def job_mean_scale(self, step_in_epoch: int) -> float:
        """The factor that makes a rank's summed loss average to the mean over the job's samples of the step."""
        job = sum(self._node_batch_length(samples, step_in_epoch) for samples in self.node_samples)
        return self.world_size * len(self.node_samples) / job

    def _layout(self) -> str:
        nodes, ranks = len(self.node_samples), self.world_size
        return f"{nodes} node{'s' * (nodes != 1)} of {ranks} rank{'s' * (ranks != 1)}"

    def state_dict(self) -> dict[str, Any]:
        """The position, the sampler's parameters, and the layout it is valid for."""
        return {**super().state_dict(), "node_samples": self.node_samples, "ranks_per_node": self.world_size}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise one line unless ``state`` was saved at this layout, with these shards, batch, seed and shuffle."""
        if "node_samples" not in state:
            raise UserError("the loader state was saved over data that is not node-sharded; resume with that data")
        saved_nodes, saved_ranks = len(state["node_samples"]), int(state["ranks_per_node"])
        if (saved_nodes, saved_ranks) != (len(self.node_samples), self.world_size):
            raise UserError(
                f"the checkpoint was saved by {saved_nodes} node{'s' * (saved_nodes != 1)} of {saved_ranks} "
                f"rank{'s' * (saved_ranks != 1)} and this run has {self._layout()}: node-sharded data resumes "
                f"only at the same layout; run nnodes={saved_nodes} nproc={saved_ranks}"
            )
        if list(state["node_samples"]) != self.node_samples:
            raise UserError(
                f"the checkpoint was saved with {state['node_samples']} samples per node and the nodes now hold "
                f"{self.node_samples}; give each node the shards it had"
            )
        super().check_state({**state, "num_samples": self.num_samples})
