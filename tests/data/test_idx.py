"""IDX files: round trip and every way a file can be damaged."""

import gzip

import numpy as np
import pytest

from ddpkit.data.idx import CorruptDataError, read_idx, write_idx


@pytest.mark.parametrize("name", ["images.idx", "images.idx.gz"])
def test_round_trip(tmp_path, name):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / name, array)
    np.testing.assert_array_equal(read_idx(tmp_path / name), array)


def test_truncated_gzip_names_the_file(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((10, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CorruptDataError, match="train-images-idx3-ubyte.gz is not a complete gzip file"):
        read_idx(path)


def test_payload_shorter_than_header_says(tmp_path):
    path = tmp_path / "labels.gz"
    write_idx(path, np.zeros(100, dtype=np.uint8))
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:-10]))
    with pytest.raises(CorruptDataError, match=r"has 98 bytes but its header \(100,\) needs 108"):
        read_idx(path)


def test_not_an_idx_file(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(b"hello world")
    with pytest.raises(CorruptDataError, match="not an IDX file"):
        read_idx(path)
