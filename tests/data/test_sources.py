"""Finding and downloading dataset files, against a real HTTP server on loopback."""

import hashlib
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest

from ddpkit.data.datasets import DataOptions, load_dataset
from ddpkit.data.idx import CorruptDataError, write_idx
from ddpkit.data.sources import DataNotFoundError, DatasetSource, RemoteFile, candidate_dirs, locate


def _make_files(folder: Path, num_train=12, num_test=5) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (num_train, 28, 28)))
    write_idx(folder / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, num_train))
    write_idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (num_test, 28, 28)))
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, num_test))


def _source(folder: Path, mirror: str = "") -> DatasetSource:
    names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
    files = tuple(RemoteFile(n, hashlib.md5((folder / n).read_bytes()).hexdigest()) for n in names)
    return DatasetSource("tiny", files, mirrors=(mirror,) if mirror else ())


@pytest.fixture
def mirror(tmp_path):
    """A real HTTP server on 127.0.0.1 serving a tiny dataset; yields (url, folder, request log)."""
    served = tmp_path / "served"
    _make_files(served)
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", served, requests
    server.shutdown()
    thread.join()


def test_search_order(tmp_path):
    source = DatasetSource("tiny", (), mirrors=(), system_dirs=("/usr/share/datasets/tiny",))
    environ = {"DDPKIT_DATA_DIR": "/data", "XDG_CACHE_HOME": str(tmp_path)}
    assert candidate_dirs(source, "", environ) == [
        Path("/data"), tmp_path / "ddpkit" / "tiny", Path("/usr/share/datasets/tiny")]
    assert candidate_dirs(source, "/mine", environ) == [Path("/mine")]


def test_downloads_once_and_verifies(tmp_path, mirror):
    url, served, requests = mirror
    environ = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    folder = locate(_source(served, url), environ=environ)
    assert folder == tmp_path / "cache" / "ddpkit" / "tiny"
    assert len(requests) == 4
    locate(_source(served, url), environ=environ)
    assert len(requests) == 4, "files already in the cache must not be downloaded again"


def test_checksum_mismatch_leaves_nothing(tmp_path, mirror):
    url, served, _ = mirror
    source = _source(served, url)
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
    _make_files(tmp_path / "d", num_train=12, num_test=5)
    data = load_dataset("fashion-mnist", DataOptions(data_dir=str(tmp_path / "d")))
    assert data.train_images.shape == (12, 1, 28, 28) and data.test_labels.shape == (5,)
    path = tmp_path / "d" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CorruptDataError, match="train-images-idx3-ubyte.gz"):
        load_dataset("fashion-mnist", DataOptions(data_dir=str(tmp_path / "d")))


def test_real_fashion_mnist_is_found():
    data = load_dataset("fashion-mnist", DataOptions(download=False))
    assert data.train_images.shape == (60000, 1, 28, 28)
    assert data.test_images.shape == (10000, 1, 28, 28)
    assert set(data.train_labels.unique().tolist()) == set(range(10))


def test_unknown_dataset_lists_choices():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; choose one of: fashion-mnist, mnist, synthetic"):
        load_dataset("cifar", DataOptions())
