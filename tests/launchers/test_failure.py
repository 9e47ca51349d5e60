"""Choosing the root cause among failed workers: first by time, peers that merely lost a peer last."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ddpkit.launchers.failure import root_cause


def _error(message: str, at: float, peer_lost: bool = False) -> dict:
    return {
        "message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(at))}},
        "ddpkit": {"time": at, "peer_lost": peer_lost},
    }


def _agent_failure(tmp_path, rank: int, exitcode: int, data: dict | None) -> ProcessFailure:
    error_file = tmp_path / f"agent-{rank}.json"
    if data is not None:
        error_file.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_a_rank_recorded_only_in_the_failure_folder_can_be_the_root_cause(tmp_path):
    # The agent reported rank 0, which failed because rank 1 left; rank 1 recorded its error first.
    folder = tmp_path / "failures"
    folder.mkdir()
    (folder / "rank-1.json").write_text(json.dumps({"rank": 1, **_error("RuntimeError: boom", at=100.0)}))
    (folder / "rank-0.json").write_text("{half-written")  # a worker killed while writing: ignored
    lost = _error("RuntimeError: Connection closed by peer [127.0.0.1]:1", at=100.2, peer_lost=True)
    failure = root_cause({0: _agent_failure(tmp_path, 0, 1, lost)}, str(folder))
    assert (failure.rank, failure.exitcode, failure.message) == (1, 1, "RuntimeError: boom")


def test_a_killed_rank_beats_a_peer_that_only_lost_it_even_if_seen_later(tmp_path):
    lost = _error("RuntimeError: Connection reset by peer", at=50.0, peer_lost=True)
    failures = {0: _agent_failure(tmp_path, 0, 1, lost), 1: _agent_failure(tmp_path, 1, -9, None)}
    failure = root_cause(failures)
    assert (failure.rank, failure.exitcode) == (1, -9) and "SIGKILL" in failure.message


def test_without_peer_loss_the_earliest_failure_wins(tmp_path):
    failures = {
        0: _agent_failure(tmp_path, 0, 1, _error("ValueError: late", at=20.0)),
        2: _agent_failure(tmp_path, 2, 1, _error("ValueError: early", at=10.0)),
    }
    assert root_cause(failures).rank == 2
