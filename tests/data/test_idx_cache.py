"""The decompressed, memory-mapped copy of IDX files in the user cache (``map_idx``)."""

import os

import numpy as np
import pytest
import torch

from ddpkit.data.datasets import FASHION_MNIST, DataOptions, load_images
from ddpkit.data.idx import CorruptDataError, map_idx, write_idx


def _images(seed: int = 0, count: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 28, 28), dtype=np.uint8)


def test_gzip_file_is_cached_decompressed_and_mapped(tmp_path):
    source, cache = tmp_path / "train-images-idx3-ubyte.gz", tmp_path / "cache"
    write_idx(source, _images())
    array = map_idx(source, cache)
    assert isinstance(array, np.memmap)
    np.testing.assert_array_equal(array, _images())
    (copy,) = cache.iterdir()
    assert copy.name.startswith("train-images-idx3-ubyte-") and not copy.name.endswith(".gz")
    assert copy.stat().st_size == 4 + 3 * 4 + 5 * 28 * 28  # the raw IDX file
    # The second call reads the copy: it is not written again.
    written_at = copy.stat().st_mtime_ns
    np.testing.assert_array_equal(map_idx(source, cache), _images())
    assert copy.stat().st_mtime_ns == written_at


def test_writes_to_the_array_stay_in_the_process(tmp_path):
    source, cache = tmp_path / "labels.gz", tmp_path / "cache"
    write_idx(source, np.arange(10, dtype=np.uint8))
    tensor = torch.from_numpy(map_idx(source, cache))  # writable: no warning from torch
    tensor[0] = 99
    np.testing.assert_array_equal(map_idx(source, cache), np.arange(10, dtype=np.uint8))


def test_a_changed_source_gets_a_new_copy_and_the_old_one_goes(tmp_path):
    source, cache = tmp_path / "images.gz", tmp_path / "cache"
    write_idx(source, _images(0))
    map_idx(source, cache)
    (old,) = cache.iterdir()
    write_idx(source, _images(1, count=3))
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    np.testing.assert_array_equal(map_idx(source, cache), _images(1, count=3))
    (new,) = cache.iterdir()
    assert new != old


def test_raw_file_is_mapped_in_place(tmp_path):
    source, cache = tmp_path / "images.idx", tmp_path / "cache"
    write_idx(source, _images())
    assert isinstance(map_idx(source, cache), np.memmap)
    np.testing.assert_array_equal(map_idx(source, cache), _images())
    assert not cache.exists()


def test_unwritable_cache_reads_into_memory(tmp_path):
    source = tmp_path / "images.gz"
    write_idx(source, _images())
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    array = map_idx(source, blocker / "cache")
    assert not isinstance(array, np.memmap) and array.flags.writeable
    np.testing.assert_array_equal(array, _images())


def test_corrupt_source_is_reported_and_not_cached(tmp_path):
    source, cache = tmp_path / "train-images-idx3-ubyte.gz", tmp_path / "cache"
    write_idx(source, _images())
    source.write_bytes(source.read_bytes()[:-20])
    with pytest.raises(CorruptDataError, match="is not a complete gzip file"):
        map_idx(source, cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_truncated_cached_copy_is_reported(tmp_path):
    source, cache = tmp_path / "images.gz", tmp_path / "cache"
    write_idx(source, _images())
    map_idx(source, cache)
    (copy,) = cache.iterdir()
    copy.write_bytes(copy.read_bytes()[:-7])
    with pytest.raises(CorruptDataError, match="it is truncated or corrupt"):
        map_idx(source, cache)


def test_dataset_loads_through_the_cache_of_the_environment(tmp_path):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    train, test = _images(0, count=6), _images(1, count=4)
    for f, array in zip(FASHION_MNIST.files, (train, np.arange(6) % 10, test, np.arange(4) % 10)):
        write_idx(folder / f.name, np.asarray(array, dtype=np.uint8))
    environ = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    data = load_images("fashion-mnist", DataOptions(data_dir=str(folder), download=False), environ)
    assert data.train_images.shape == (6, 1, 28, 28) and data.test_labels.dtype == torch.int64
    assert torch.equal(data.train_images[:, 0], torch.from_numpy(train))
    assert len(list((tmp_path / "xdg" / "ddpkit" / "idx" / "fashion-mnist").iterdir())) == 4 + 2  # 4 files, 2 of pixels
    train_set, test_set = data.datasets()
    assert torch.equal(train_set.tensors[0], data.train_images.float() / 255) and len(test_set) == 4


def test_pixels_are_the_images_over_255_mapped_from_one_copy(tmp_path):
    from ddpkit.data.idx import map_pixels

    source, cache = tmp_path / "images.gz", tmp_path / "cache"
    write_idx(source, _images())
    pixels = map_pixels(source, cache)
    assert isinstance(pixels, np.memmap) and pixels.dtype == np.float32
    assert torch.equal(torch.from_numpy(pixels), torch.from_numpy(_images()).float() / 255)
    copies = sorted(p.name for p in cache.iterdir())
    assert len(copies) == 2 and copies[1].startswith("images-pixels-") and copies[1].endswith(".npy")
    np.testing.assert_array_equal(map_pixels(source, cache), pixels)
    assert sorted(p.name for p in cache.iterdir()) == copies  # read, not written again
