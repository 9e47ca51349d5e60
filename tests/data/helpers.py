"""What several data tests share: a dataset whose samples are their indices, and the own-data script's records."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

OWN_DATA_SCRIPT = Path(__file__).resolve().parent / "scripts" / "own_data.py"
"""A user's loop with a Checkpointer over the data a test names; with --record it writes what each rank trained."""


class IndexDataset(Dataset):
    """Sample i is i: the batches show which samples were read."""

    def __init__(self, num_samples):
        self.num_samples = num_samples

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        return index


def read_records(prefix: Path) -> list[tuple[int, int]]:
    """(epoch, sample) of every sample the own-data script trained, from its files ``<prefix>.<rank>``."""
    lines = [
        line.split()
        for path in sorted(prefix.parent.glob(prefix.name + ".*"))
        for line in path.read_text().splitlines()
    ]
    return [(int(epoch), int(sample)) for epoch, sample in lines]
