"""The example datasets, public: MNIST, Fashion-MNIST and a synthetic set, as tensors.

What the examples and ``ddpkit train dataset=NAME`` use::

    from ddpkit.datasets import DataOptions, load_datasets, load_images

    data = load_images("fashion-mnist", DataOptions(download=True))
    train_set, test_set = data.datasets()        # TensorDatasets of (float32 pixels in [0, 1], label)
    train_set, test_set = load_datasets("mnist", DataOptions())   # any name dataset= takes, module:function too

Files are looked up locally first (``data_dir``, the system's dataset packages, the user cache) and
downloaded, checked, only when missing. The implementation lives in :mod:`ddpkit.data.datasets`; this
module is the part of it that is a promise to users.
"""

from __future__ import annotations

from ddpkit.data.datasets import DataOptions, ImageData, dataset_names, load_datasets, load_images, register_dataset

__all__ = ["DataOptions", "ImageData", "dataset_names", "load_datasets", "load_images", "register_dataset"]
