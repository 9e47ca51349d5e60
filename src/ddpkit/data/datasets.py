"""The datasets ddpkit trains on, held whole in memory as tensors.

MNIST-family datasets are small (60,000 + 10,000 images of 28 x 28 bytes), so
each worker keeps the whole of them as one uint8 tensor, on the training device,
and a batch is one indexing operation: no per-sample Python, no DataLoader
workers. Pixels become float32 in [0, 1] at batch time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ddpkit.data.idx import CorruptDataError, read_idx
from ddpkit.data.sources import DatasetSource, RemoteFile, locate

FASHION_MNIST = DatasetSource(
    name="fashion-mnist",
    files=(
        RemoteFile("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        RemoteFile("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
        RemoteFile("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
        RemoteFile("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
    ),
    mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    system_dirs=("/usr/share/datasets/fashion-mnist",),
)

MNIST = DatasetSource(
    name="mnist",
    files=(
        RemoteFile("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        RemoteFile("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
        RemoteFile("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
        RemoteFile("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
    ),
    mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
    system_dirs=("/usr/share/datasets/mnist",),
)


@dataclass(frozen=True)
class TensorDataset:
    """A whole image-classification dataset as tensors.

    Images are uint8, shape (N, 1, 28, 28); labels are int64, shape (N,).
    """

    name: str
    """Dataset name."""
    train_images: torch.Tensor
    """Training images, uint8."""
    train_labels: torch.Tensor
    """Training labels, int64."""
    test_images: torch.Tensor
    """Test images, uint8."""
    test_labels: torch.Tensor
    """Test labels, int64."""
    num_classes: int = 10
    """Number of label classes."""

    def to(self, device: torch.device) -> TensorDataset:
        """The same dataset with every tensor on ``device``."""
        moved = {k: getattr(self, k).to(device) for k in ("train_images", "train_labels", "test_images", "test_labels")}
        return TensorDataset(self.name, num_classes=self.num_classes, **moved)


@dataclass(frozen=True)
class DataOptions:
    """How to find or make a dataset."""

    data_dir: str = ""
    """The only folder to look in, when not empty."""
    download: bool = True
    """Download from the official mirrors when not found locally."""
    mirrors: Sequence[str] = ()
    """Extra base URLs tried before the official mirrors."""
    synthetic_samples: int = 60000
    """Training samples of the synthetic dataset."""
    seed: int = 0
    """Seed of the synthetic dataset."""


Loader = Callable[[DataOptions, Mapping[str, str]], TensorDataset]
DATASETS: dict[str, Loader] = {}


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    """Decorator registering a loader ``(options, environ) -> TensorDataset`` under ``name``."""

    def add(loader: Loader) -> Loader:
        DATASETS[name] = loader
        return loader

    return add


def load_dataset(name: str, options: DataOptions, environ: Mapping[str, str] | None = None) -> TensorDataset:
    """Load the dataset registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists those that are).
        DataNotFoundError, CorruptDataError: the files are missing or damaged.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(sorted(DATASETS))}")
    return DATASETS[name](options, os.environ if environ is None else environ)


def _load_idx_dataset(source: DatasetSource, options: DataOptions, environ: Mapping[str, str]) -> TensorDataset:
    folder = locate(source, options.data_dir, options.download, options.mirrors, environ)
    arrays = [read_idx(folder / f.name) for f in source.files]
    train_x, train_y, test_x, test_y = (torch.from_numpy(a.copy()) for a in arrays)
    for images, labels, split in ((train_x, train_y, "train"), (test_x, test_y, "test")):
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise CorruptDataError(
                f"{source.name} {split} split in {folder}: images {tuple(images.shape)} do not match "
                f"labels {tuple(labels.shape)}; delete the files so they are fetched again"
            )
    return TensorDataset(
        source.name,
        train_x.unsqueeze(1),
        train_y.long(),
        test_x.unsqueeze(1),
        test_y.long(),
    )


@register_dataset("fashion-mnist")
def load_fashion_mnist(options: DataOptions, environ: Mapping[str, str]) -> TensorDataset:
    """Fashion-MNIST: 60,000 + 10,000 clothing images in 10 classes."""
    return _load_idx_dataset(FASHION_MNIST, options, environ)


@register_dataset("mnist")
def load_mnist(options: DataOptions, environ: Mapping[str, str]) -> TensorDataset:
    """MNIST: 60,000 + 10,000 handwritten digits."""
    return _load_idx_dataset(MNIST, options, environ)


@register_dataset("synthetic")
def load_synthetic(options: DataOptions, environ: Mapping[str, str]) -> TensorDataset:
    """Random images whose label is a fixed function of the pixels (learnable), any size.

    The label is the arg-max of a fixed random projection of the image, so
    models can learn it; used by benchmarks and tests that need a given size.
    """
    generator = torch.Generator().manual_seed(options.seed)
    num_train = options.synthetic_samples
    num_test = max(1, num_train // 6)
    images = torch.randint(0, 256, (num_train + num_test, 1, 28, 28), dtype=torch.uint8, generator=generator)
    projection = torch.randn(28 * 28, 10, generator=generator)
    labels = (images.flatten(1).float() @ projection).argmax(1)
    return TensorDataset(
        "synthetic", images[:num_train], labels[:num_train], images[num_train:], labels[num_train:]
    )
