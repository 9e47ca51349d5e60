"""Finding and downloading dataset files, against a real HTTP server on loopback."""

from pathlib import Path

import pytest
import torch

from ddpkit.data.datasets import DataOptions, load_datasets, load_images
from ddpkit.data.idx import CorruptDataError
from ddpkit.data.sources import DataNotFoundError, DatasetSource, RemoteFile, candidate_dirs, locate
from tests.helpers.mirror import FILE_NAMES, make_idx_files, serve_folder, source_for
from tests.helpers.workers import run_on_ranks


@pytest.fixture
def mirror(tmp_path):
    """A tiny dataset served over real HTTP on loopback; yields (url, folder, request log)."""
    served = tmp_path / "served"
    make_idx_files(served)
    with serve_folder(served) as (url, requests):
        yield url, served, requests


def test_search_order(tmp_path):
    source = DatasetSource("tiny", (), mirrors=(), system_dirs=("/usr/share/datasets/tiny",))
    environ = {"DDPKIT_DATA_DIR": "/data", "XDG_CACHE_HOME": str(tmp_path)}
    assert candidate_dirs(source, "", environ) == [
        Path("/data"),
        tmp_path / "ddpkit" / "tiny",
        Path("/usr/share/datasets/tiny"),
    ]
    assert candidate_dirs(source, "/mine", environ) == [Path("/mine")]


def test_downloads_once_and_verifies(tmp_path, mirror):
    url, served, requests = mirror
    environ = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    folder = locate(source_for(served, url), environ=environ)
    assert folder == tmp_path / "cache" / "ddpkit" / "tiny"
    assert len(requests) == 4
    locate(source_for(served, url), environ=environ)
    assert len(requests) == 4, "files already in the cache must not be downloaded again"


def test_checksum_mismatch_leaves_nothing(tmp_path, mirror):
    url, served, _ = mirror
    source = source_for(served, url)
    bad = DatasetSource("tiny", (RemoteFile(source.files[0].name, "0" * 32),) + source.files[1:], (url,))
    with pytest.raises(DataNotFoundError, match="checksum mismatch"):
        locate(bad, environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert not list((tmp_path / "ddpkit" / "tiny").glob("train-images*")), "a bad download must not take the name"


def test_missing_data_without_network_is_one_clear_error(tmp_path):
    source = DatasetSource("tiny", (RemoteFile("a.gz", "0" * 32),), mirrors=("http://127.0.0.1:9/",))
    with pytest.raises(DataNotFoundError, match="could not download a.gz.*copy the files into"):
        locate(source, environ={"XDG_CACHE_HOME": str(tmp_path)})
    with pytest.raises(DataNotFoundError, match="set download=true"):
        locate(source, download=False, environ={"XDG_CACHE_HOME": str(tmp_path)})


def test_load_from_data_dir_and_corrupt_file(tmp_path):
    make_idx_files(tmp_path / "d", num_train=12, num_test=5)
    data = load_images("fashion-mnist", DataOptions(data_dir=str(tmp_path / "d")))
    assert data.train_images.shape == (12, 1, 28, 28) and data.test_labels.shape == (5,)
    assert data.train_images.dtype == torch.uint8
    train, test = load_datasets("fashion-mnist", DataOptions(data_dir=str(tmp_path / "d")))
    x, y = train[0]
    assert (len(train), len(test)) == (12, 5) and x.shape == (1, 28, 28) and x.dtype == torch.float32
    assert torch.equal(x, data.train_images[0].float() / 255) and y == data.train_labels[0]
    path = tmp_path / "d" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CorruptDataError, match="train-images-idx3-ubyte.gz"):
        load_datasets("fashion-mnist", DataOptions(data_dir=str(tmp_path / "d")))


def test_real_fashion_mnist_is_found(fashion_mnist):
    data = load_images("fashion-mnist", DataOptions(download=False))
    assert data.train_images.shape == (60000, 1, 28, 28)
    assert data.test_images.shape == (10000, 1, 28, 28)
    assert set(data.train_labels.unique().tolist()) == set(range(10))


def test_unknown_dataset_lists_choices():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; choose one of: fashion-mnist, mnist, synthetic"):
        load_datasets("cifar", DataOptions())
    with pytest.raises(
        ValueError, match="unknown image dataset 'cifar'; choose one of: fashion-mnist, mnist, synthetic"
    ):
        load_images("cifar", DataOptions())


def _locate_concurrently(rank, world_size, url, served, cache):
    return str(locate(source_for(Path(served), url), environ={"XDG_CACHE_HOME": cache}))


def test_concurrent_workers_download_once(tmp_path, mirror):
    """Three processes ask at once: the file lock lets one download, the others find the files."""
    url, served, requests = mirror
    folders = run_on_ranks(
        _locate_concurrently, 3, url, str(served), str(tmp_path / "cache"), init_process_group=False, timeout=60
    )
    assert len(set(folders)) == 1
    assert sorted(requests) == sorted(f"/{name}" for name in FILE_NAMES)
