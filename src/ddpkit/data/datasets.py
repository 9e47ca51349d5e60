"""The datasets ``ddpkit train`` knows by name, and the user's own by ``module:function``.

A dataset, for training, is a pair of map-style torch Datasets (train, test)
whose items are ``(input, target)``; any input shape and dtype. The trainer
never rescales inputs: a dataset hands them over as the model should see them.

MNIST-family datasets are small (60,000 + 10,000 images of 28 x 28 bytes), so
each worker maps them whole (:class:`ImageData`, uint8, from the decompressed
copies in the user cache, ``<cache>/idx/<dataset>``: see :func:`ddpkit.data.idx.map_idx`)
and serves them as
``torch.utils.data.TensorDataset`` of float32 pixels in [0, 1]: a batch is
then one indexing operation (``ddpkit.DataLoader``'s fast path), no
per-sample Python.

Own datasets: ``dataset=my_module:build`` names a function returning
``(train, test)`` (it receives no argument); it is imported in every worker,
with the current folder importable.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ddpkit.data.idx import CorruptDataError, map_idx, map_pixels
from ddpkit.data.sources import DatasetSource, RemoteFile, locate, user_cache_dir
from ddpkit.errors import UserError

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
class ImageData:
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
    pixels: tuple[torch.Tensor, torch.Tensor] | None = None
    """(train, test) images as float32 pixels in [0, 1] when already made (memory-mapped from the
    user cache); otherwise :meth:`datasets` converts the images."""

    def datasets(self) -> tuple[TensorDataset, TensorDataset]:
        """(train, test) as torch TensorDatasets of (float32 pixels in [0, 1], int64 label)."""
        train, test = self.pixels or (self.train_images.float().div_(255.0), self.test_images.float().div_(255.0))
        return TensorDataset(train, self.train_labels), TensorDataset(test, self.test_labels)


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


Loader = Callable[[DataOptions, Mapping[str, str]], ImageData]
IMAGE_DATASETS: dict[str, Loader] = {}
"""The built-in image datasets by name: loaders ``(options, environ) -> ImageData``."""
Splits = tuple[Dataset[Any], Dataset[Any]]
DATASETS: dict[str, Callable[[], Splits]] = {}
"""Datasets registered by users: functions returning (train, test)."""


def register_dataset(name: str) -> Callable[[Callable[[], Splits]], Callable[[], Splits]]:
    """Decorator registering a function returning ``(train, test)`` Datasets as ``dataset=name``."""

    def add(build: Callable[[], Splits]) -> Callable[[], Splits]:
        DATASETS[name] = build
        return build

    return add


def _image_dataset(name: str) -> Callable[[Loader], Loader]:
    def add(loader: Loader) -> Loader:
        IMAGE_DATASETS[name] = loader
        return loader

    return add


def dataset_names() -> list[str]:
    """Every dataset name ``dataset=`` accepts (besides module:function)."""
    return sorted({*IMAGE_DATASETS, *DATASETS})


def load_images(name: str, options: DataOptions, environ: Mapping[str, str] | None = None) -> ImageData:
    """Load the built-in image dataset ``name`` (uint8 images, int64 labels).

    Raises:
        ValueError: ``name`` is not a built-in image dataset (the message lists those that are).
        DataNotFoundError, CorruptDataError: the files are missing or damaged.
    """
    if name not in IMAGE_DATASETS:
        raise UserError(f"unknown image dataset {name!r}; choose one of: {', '.join(sorted(IMAGE_DATASETS))}")
    return IMAGE_DATASETS[name](options, os.environ if environ is None else environ)


def load_datasets(name: str, options: DataOptions, environ: Mapping[str, str] | None = None) -> Splits:
    """The (train, test) Datasets of ``dataset=name``: built-in, registered, or module:function.

    Raises:
        ValueError: unknown name, a function that cannot be imported, or one that
            does not return two map-style Datasets (the message says which).
    """
    if name in IMAGE_DATASETS:
        return load_images(name, options, environ).datasets()
    if name in DATASETS:
        return _checked(name, DATASETS[name]())
    return _checked(name, dataset_function(name)())


def dataset_function(name: str) -> Callable[[], Splits]:
    """The function ``dataset=module:function`` names, imported (the dataset itself is not built).

    Raises:
        ValueError: not module:function, or it cannot be imported.
    """
    if ":" not in name:
        raise UserError(
            f"unknown dataset {name!r}; choose one of: {', '.join(dataset_names())}, "
            "or give module:function returning (train, test) Datasets"
        )
    module_name, _, attr = name.partition(":")
    try:
        function: Callable[[], Splits] = getattr(importlib.import_module(module_name), attr)
        return function
    except (ImportError, AttributeError) as e:
        raise UserError(
            f"dataset {name!r} cannot be imported ({e}); check the module:function path "
            "(the current folder is importable)"
        ) from None


def _checked(name: str, splits: object) -> Splits:
    if not (isinstance(splits, (tuple, list)) and len(splits) == 2):
        raise UserError(f"dataset {name!r} returned {type(splits).__name__}; return a pair (train, test) of Datasets")
    for split, data in zip(("train", "test"), splits):
        if isinstance(data, IterableDataset) or not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise UserError(
                f"dataset {name!r}: the {split} split is a {type(data).__name__}, not a map-style "
                "Dataset (__getitem__ and __len__); ddpkit shards by index so that resumes are exact"
            )
    return splits[0], splits[1]


def _load_idx_dataset(source: DatasetSource, options: DataOptions, environ: Mapping[str, str]) -> ImageData:
    folder = locate(source, options.data_dir, options.download, options.mirrors, environ)
    cache = user_cache_dir(environ) / "idx" / source.name  # (MNIST and Fashion-MNIST share file names)
    arrays = [map_idx(folder / f.name, cache) for f in source.files]
    train_x, train_y, test_x, test_y = (torch.from_numpy(a) for a in arrays)
    train_pixels, test_pixels = (
        torch.from_numpy(map_pixels(folder / f.name, cache)).unsqueeze(1) for f in source.files[0::2]
    )
    for images, labels, split in ((train_x, train_y, "train"), (test_x, test_y, "test")):
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise CorruptDataError(
                f"{source.name} {split} split in {folder}: images {tuple(images.shape)} do not match "
                f"labels {tuple(labels.shape)}; delete the files so they are fetched again"
            )
    return ImageData(
        source.name,
        train_x.unsqueeze(1),
        train_y.long(),
        test_x.unsqueeze(1),
        test_y.long(),
        pixels=(train_pixels, test_pixels),
    )


@_image_dataset("fashion-mnist")
def load_fashion_mnist(options: DataOptions, environ: Mapping[str, str]) -> ImageData:
    """Fashion-MNIST: 60,000 + 10,000 clothing images in 10 classes."""
    return _load_idx_dataset(FASHION_MNIST, options, environ)


@_image_dataset("mnist")
def load_mnist(options: DataOptions, environ: Mapping[str, str]) -> ImageData:
    """MNIST: 60,000 + 10,000 handwritten digits."""
    return _load_idx_dataset(MNIST, options, environ)


@_image_dataset("synthetic")
def load_synthetic(options: DataOptions, environ: Mapping[str, str]) -> ImageData:
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
    return ImageData("synthetic", images[:num_train], labels[:num_train], images[num_train:], labels[num_train:])
