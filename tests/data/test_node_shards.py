"""Node-sharded data in one process: the layout on disk, the staging copy, the layout check and the step count."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit.data.node_shards import NodeBatchSampler, NodeShards, check_layout, stage_node_shards, write_shards
from ddpkit.errors import UserError

MANIFEST = [{"name": f"shard-{i:05d}.pt", "samples": 10} for i in range(4)]


def test_write_stage_and_read_one_node_of_two(tmp_path):
    write_shards([torch.arange(46), torch.arange(46) * 2.0], tmp_path / "all", 5)
    stage_node_shards(tmp_path / "all", tmp_path / "node-1", node=1, nodes=2)
    assert sorted(p.name for p in (tmp_path / "node-1").iterdir()) == [
        "manifest.json",
        "shard-00001.pt",
        "shard-00003.pt",
    ]
    # One process: the whole job is one node, so node 1's folder alone misses shards 0, 2 and 4.
    with pytest.raises(UserError, match=r"^shards 0,2,4 of 5 are on no node \(node 0 holds 1,3\)"):
        NodeShards(tmp_path / "node-1")
    everything = NodeShards(tmp_path / "all")
    assert torch.equal(everything.tensors[0], torch.arange(46)) and everything.node_samples == [46]


def test_a_second_staging_copies_nothing(tmp_path):
    write_shards([torch.arange(8)], tmp_path / "all", 2)
    stage_node_shards(tmp_path / "all", tmp_path / "local", node=0, nodes=2)
    before = (tmp_path / "local" / "shard-00000.pt").stat().st_mtime_ns
    stage_node_shards(tmp_path / "all", tmp_path / "local", node=0, nodes=2)
    assert (tmp_path / "local" / "shard-00000.pt").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    ("held", "line"),
    [
        ({0: [0, 1], 1: [1, 2, 3]}, "node 1 holds shards 1,2,3 of 4 but node 0 also holds shard 1; "),
        ({0: [0, 2], 1: [3]}, "shard 1 of 4 is on no node (node 0 holds 0,2; node 1 holds 3); "),
    ],
)
def test_the_layout_check_names_what_is_where(held, line):
    everyone = [(node, 1, shards, MANIFEST, f"/data/node-{node}") for node, shards in held.items()]
    with pytest.raises(UserError) as refused:
        check_layout(everyone, 4)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_nodes_with_different_ranks_are_refused():
    everyone = [(0, 2, [0, 1], MANIFEST, "a"), (0, 2, [0, 1], MANIFEST, "a"), (1, 1, [2, 3], MANIFEST, "b")]
    with pytest.raises(UserError, match=r"^nodes run different numbers of ranks \(node 0 2, node 1 1\)"):
        check_layout(everyone, 4)


def test_an_epoch_has_the_steps_of_the_largest_node_and_the_smaller_ends_on_empty_batches():
    # Node 1 of 2 holds 18 samples, node 0 28; 2 ranks per node, 4 per rank: node batches of 8.
    sampler = NodeBatchSampler([28, 18], 1, 8, 1, 2, seed=0, shuffle=True, drop_last=False)
    shares = list(sampler.shares(0))
    assert sampler.steps_per_epoch == 4 and [len(s) for s in shares] == [4, 4, 1, 0]
    everyone = sorted(
        i for rank in (0, 1) for s in NodeBatchSampler([28, 18], 1, 8, rank, 2, 0, True, False).shares(0) for i in s
    )
    assert everyone == list(range(18))
    # Step 2: node 0 has 8 samples, node 1 has 2: each rank's sum is scaled by 4 ranks / 10 samples.
    assert sampler.job_mean_scale(2) == pytest.approx(0.4)


def test_a_loader_over_node_shards_in_one_process_reads_every_sample_once(tmp_path):
    write_shards([torch.arange(10)], tmp_path / "all", 3)
    loader = ddpkit.DataLoader(NodeShards(tmp_path / "all"), batch_size=4, shuffle=True, device=None)
    (seen,) = zip(*loader)
    assert sorted(torch.cat(seen).tolist()) == list(range(10))
    assert loader.state_dict()["node_samples"] == [10]
