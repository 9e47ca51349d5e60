"""Per-sample randomness: a dataset's draws depend only on (seed, epoch, index).

``ddpkit.DataLoader`` reads the user's dataset through :class:`SeededDataset`.
Before ``dataset[index]`` the global generators the dataset draws from
(python's ``random``, numpy's legacy global generator, torch's CPU generator)
are seeded from (seed, epoch, index), so an augmentation draws the same for a
sample at any world size, ``num_workers``, and after a resume.

Seeding all three before every sample costs about 9 us a sample, whether or
not the dataset draws from any of them. So only the generators the dataset
has been seen drawing from are seeded per sample; the others are watched:

1. before a batch, each watched generator is set to a fixed sentinel state
   (one cheap call each, once a batch);
2. after the batch, a generator whose state is no longer the sentinel was
   drawn from: it joins the seeded ones, and the whole batch is read again
   with it seeded, so no draw from an unseeded state ever reaches a batch.

A dataset whose first draw comes late (after some samples, or only for some
indices) is caught at that batch, in every process that reads it, and the
result is the same as if every generator had been seeded from the start. A
batch is read twice at most once per generator and process. A dataset that
draws from a generator and then puts its state back (``fork_rng`` without a
seed inside) is seen as not drawing from it.

Checking a watched generator costs a few microseconds a batch: two words of
its state read in place for numpy and python's ``random`` (where CPython's
layout is confirmed; else ``getstate``, about 17 us), a comparison of
torch's state bytes.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

try:
    import numpy as np
except ImportError:  # numpy is optional for torch, and so here
    np = None  # type: ignore[assignment]  # a module or None: every use checks for None first

__all__ = ["SeededDataset"]

_MASK64 = (1 << 64) - 1
_SENTINEL_SEED = 0x5EED
"""Seed of the sentinel state a watched generator is set to before each batch."""


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value from any int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _Template:
    """One sample standing in for a rank's empty share: collated, then cut to zero rows."""

    __slots__ = ("sample",)

    def __init__(self, sample: Any):
        self.sample = sample


class _TorchCPU:
    """torch's default CPU generator (``torch.manual_seed`` would also visit every accelerator: ~180 us)."""

    def __init__(self) -> None:
        self.sentinel = torch.Generator().manual_seed(_SENTINEL_SEED).get_state()
        self.sentinel_bytes = self.sentinel.numpy().tobytes()

    def seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def set_sentinel(self) -> None:
        torch.default_generator.set_state(self.sentinel)

    def moved(self) -> bool:
        # Bytes compared: about 2 us, where torch.equal's dispatch costs about 7.
        return torch.default_generator.get_state().numpy().tobytes() != self.sentinel_bytes

    def get_state(self) -> Any:
        return torch.default_generator.get_state()

    def set_state(self, state: Any) -> None:
        torch.default_generator.set_state(state)


class _Python:
    """Python's ``random`` module.

    ``getstate`` builds 625 ints (about 17 us). Where the interpreter lays
    out its generator as CPython does (``PyObject_HEAD``, then ``int index``
    and ``uint32 state[624]``), which is checked on a generator of our own
    first, the index and the first state word are read in place instead:
    after ``setstate`` any draw moves the index, or after 624 words the state.
    """

    def __init__(self) -> None:
        self.sentinel = random.Random(_SENTINEL_SEED).getstate()
        self.words = _cpython_random_words(random._inst) if _cpython_random_layout() else None
        self.sentinel_words = self.sentinel[1][-1], self.sentinel[1][0]

    def seed(self, seed: int) -> None:
        random.seed(seed)

    def set_sentinel(self) -> None:
        random.setstate(self.sentinel)

    def moved(self) -> bool:
        if self.words is None:
            return random.getstate() != self.sentinel
        return (self.words[0].value, self.words[1].value) != self.sentinel_words

    get_state = staticmethod(random.getstate)
    set_state = staticmethod(random.setstate)


def _cpython_random_words(generator: random.Random) -> tuple[Any, Any]:
    """The index and first state word of a ``random.Random``, read in place (CPython's layout)."""
    header = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # PyObject_HEAD
    return ctypes.c_int.from_address(id(generator) + header), ctypes.c_uint32.from_address(id(generator) + header + 4)


def _cpython_random_layout() -> bool:
    """True when a fresh ``random.Random`` shows CPython's layout: the in-place words match ``getstate``."""
    import sys

    probe = random.Random(_SENTINEL_SEED)
    if sys.implementation.name != "cpython" or sys.getsizeof(probe) < 16 + 4 * 625:
        return False
    index, first = _cpython_random_words(probe)
    state = probe.getstate()[1]
    if (index.value, first.value) != (state[-1], state[0]):
        return False
    probe.random()  # two 32-bit words
    after = probe.getstate()[1]
    return bool(index.value == after[-1] == 2 and first.value == after[0])


class _NumPy:
    """numpy's legacy global generator (``np.random.rand`` and friends), MT19937 as ``np.random.seed`` needs.

    Seeding it resets its cached gaussian, so any draw after the sentinel
    seeding moves its MT19937 state: the position, or after 624 words the
    key. Those two words are read in place; ``get_state`` (a copy of the
    whole state) costs about 40 us.
    """

    def __init__(self) -> None:
        # Kept referenced: its state is read in place, at an address valid while it lives.
        self.bit_generator = _numpy_bit_generator()
        self.words: tuple[Any, Any] | None = None
        if type(self.bit_generator).__name__ == "MT19937":
            address = self.bit_generator.ctypes.state_address  # struct {uint32 key[624]; int pos}
            self.words = ctypes.c_uint32.from_address(address), ctypes.c_int.from_address(address + 624 * 4)
        sentinel = np.random.RandomState(_SENTINEL_SEED).get_state()
        assert isinstance(sentinel, tuple), "the legacy form: ('MT19937', key, pos, ...)"
        self.sentinel: tuple[int, int] = int(sentinel[1][0]), int(sentinel[2])

    def seed(self, seed: int) -> None:
        np.random.seed(seed >> 32)

    def set_sentinel(self) -> None:
        np.random.seed(_SENTINEL_SEED)

    def moved(self) -> bool:
        if self.words is None or _numpy_bit_generator() is not self.bit_generator:
            return True  # another bit generator than MT19937's: seeded per sample, as np.random.seed allows
        return (self.words[0].value, self.words[1].value) != self.sentinel

    get_state = staticmethod(lambda: np.random.get_state())
    set_state = staticmethod(lambda state: np.random.set_state(state))


def _numpy_bit_generator() -> Any:
    if hasattr(np.random, "get_bit_generator"):  # numpy >= 1.25
        return np.random.get_bit_generator()
    return np.random.mtrand._rand._bit_generator


def _generators() -> list[Any]:
    """Handles on the global generators of this process (their states untouched)."""
    return [_TorchCPU(), _Python()] + ([_NumPy()] if np is not None else [])


class SeededDataset(Dataset[Any]):
    """A map-style dataset read with keys ``(epoch, index, empty)``, seeding the RNGs per sample.

    ``ddpkit.DataLoader`` wraps the user's dataset in it, so ``loader.dataset``
    is this and ``loader.dataset.dataset`` the user's. The generators the
    dataset draws from are seeded from (seed, epoch, index) before
    ``dataset[index]`` (see the module docstring for how they are found). In
    the main process the three generators are saved before a batch and
    restored after it (numpy's save and restore cost ~80 us, once a batch), so
    the loop's own draws are as if no loader ran; worker processes own theirs.

    Args:
        dataset: the user's map-style dataset.
        seed: the loader's seed.
        seed_per_sample: False to read samples without touching any generator.
    """

    def __init__(self, dataset: Dataset[Any], seed: int, seed_per_sample: bool = True):
        self.dataset = dataset
        self.seed = seed
        self.seed_per_sample = seed_per_sample
        self._generators: list[Any] | None = None  # built in the process that reads (a worker builds its own)
        self._drawn: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        # Generator handles hold addresses in this process: a spawned worker finds its own.
        return {**self.__dict__, "_generators": None, "_drawn": []}

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int, bool]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int, bool]]) -> list[Any]:
        """The samples of one batch's keys (torch's fetcher calls this once per batch)."""
        if not self.seed_per_sample:
            samples = self._unseeded(keys)
        elif get_worker_info() is not None:
            samples = self._read(keys)
        else:
            # Once per batch, not per sample: numpy's get/set_state cost about 40 us each.
            states = [(generator, generator.get_state()) for generator in self._process_generators()]
            try:
                samples = self._read(keys)
            finally:
                for generator, state in states:
                    generator.set_state(state)
        if keys[0][2]:
            return [_Template(samples[0])]
        return samples

    def _unseeded(self, keys: Sequence[tuple[int, int, bool]]) -> list[Any]:
        """The samples, read without touching any generator."""
        return [self.dataset[index] for _, index, _ in keys]

    def _process_generators(self) -> list[Any]:
        if self._generators is None:
            self._generators = _generators()
        return self._generators

    def _read(self, keys: Sequence[tuple[int, int, bool]]) -> list[Any]:
        """The samples, with the generators drawn from seeded per sample, the others watched."""
        while True:
            watched = [generator for generator in self._process_generators() if generator not in self._drawn]
            for generator in watched:
                generator.set_sentinel()
            samples = self._seeded(keys)
            moved = [generator for generator in watched if generator.moved()]
            if not moved:
                return samples
            # A first draw: read the batch again with that generator seeded too (and watch the rest again:
            # what a sample draws may depend on the values it drew).
            self._drawn += moved

    def _seeded(self, keys: Sequence[tuple[int, int, bool]]) -> list[Any]:
        # A batch's keys share one epoch.
        epoch_seed = _mix(_mix(self.seed) + keys[0][0])
        dataset, drawn = self.dataset, self._drawn
        if not drawn:
            return [dataset[index] for _, index, _ in keys]
        samples = []
        for _, index, _ in keys:
            seed = _mix(epoch_seed + index)
            for generator in drawn:
                generator.seed(seed)
            samples.append(dataset[index])
        return samples
