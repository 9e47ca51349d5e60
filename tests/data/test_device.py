"""ddpkit.data.device: the traversal that moves batches, the loader's device choice, the prefetcher's order.

The CUDA copies themselves run in tests/gpu/test_batches_on_device.py. Here
tensors move to the ``meta`` device (no memory, any build of torch), which
shows the traversal reaches every tensor; the prefetcher's streams and events
are replaced by fakes that log the order of what it queues.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit.data import device as device_module
from ddpkit.data.device import move_to_device, on_device, resolve_loader_device, tensors_in
from ddpkit.data.loader import DataLoader
from ddpkit.errors import UserError
from tests.data.helpers import IndexDataset

META = torch.device("meta")
Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    labels: torch.Tensor
    names: list[str]
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    note: str
    derived: int = dataclasses.field(default=0, init=False)


def _every_kind() -> dict:
    t = torch.arange(4.0)
    return {
        "tensor": t,
        "tuple": (t, t + 1),
        "list": [t, [t, "a"]],
        "dict": {"x": t, "meta": {"id": t.long(), "name": "n"}},
        "ordered": OrderedDict(x=t, y=t),
        "defaultdict": defaultdict(list, x=t),
        "namedtuple": Pair(t, t.long()),
        "dataclass": Batch(t, t.long(), ["a", "b"]),
        "frozen": FrozenBatch(t, "kept"),
        "nested": [{"pair": Pair(t, (t, None))}, Batch(t, t, [])],
        "others": ("text", b"bytes", 3, 2.5, None, np.arange(3)),
    }


@pytest.mark.parametrize("kind", sorted(_every_kind()))
def test_every_tensor_inside_every_container_kind_is_moved_and_the_structure_kept(kind):
    batch = _every_kind()[kind]
    moved = move_to_device(batch, META, non_blocking=True)
    assert type(moved) is type(batch)
    assert all(tensor.device == META for tensor in tensors_in(moved))
    assert len(tensors_in(moved)) == len(tensors_in(batch))
    _same_structure(moved, batch)


def _same_structure(moved, original):
    if isinstance(original, torch.Tensor):
        assert moved.shape == original.shape and moved.dtype == original.dtype
    elif isinstance(original, np.ndarray):
        assert moved is original  # numpy arrays are not tensors: left as they are
    elif isinstance(original, dict):
        assert type(moved) is type(original) and list(moved) == list(original)
        if isinstance(original, defaultdict):
            assert moved.default_factory is original.default_factory
        for key in original:
            _same_structure(moved[key], original[key])
    elif isinstance(original, (list, tuple)):
        assert type(moved) is type(original) and len(moved) == len(original)
        for new, old in zip(moved, original):
            _same_structure(new, old)
    elif dataclasses.is_dataclass(original):
        assert type(moved) is type(original)
        for field in dataclasses.fields(original):
            _same_structure(getattr(moved, field.name), getattr(original, field.name))
    else:
        assert moved is original  # strings, bytes, numbers, None


def test_strings_numbers_none_and_numpy_arrays_are_the_same_objects():
    others = _every_kind()["others"]
    assert move_to_device(others, META) is others
    for value in others:
        assert move_to_device(value, META) is value


@pytest.mark.parametrize("kind", sorted(_every_kind()))
def test_a_batch_already_on_the_device_is_returned_itself(kind):
    """As tensor.to(device) returns the tensor: a script's own .to(device) after the loader is a no-op."""
    batch = _every_kind()[kind]
    assert move_to_device(batch, "cpu") is batch
    moved = move_to_device(batch, META)
    assert move_to_device(moved, META) is moved


def test_a_frozen_dataclass_keeps_its_fields_that_init_does_not_take():
    moved = move_to_device(FrozenBatch(torch.ones(2), "kept"), META)
    assert moved.x.device == META and moved.note == "kept" and moved.derived == 0


def test_a_packed_sequence_keeps_its_batch_sizes_on_the_cpu():
    from torch.nn.utils.rnn import pack_sequence

    packed = pack_sequence([torch.ones(3, 2), torch.ones(1, 2), torch.ones(2, 2)], enforce_sorted=False)
    moved = move_to_device({"seq": packed}, META)["seq"]
    assert type(moved) is type(packed) and moved.data.device == META
    assert moved.sorted_indices.device == META and moved.unsorted_indices.device == META
    assert moved.batch_sizes is packed.batch_sizes and moved.batch_sizes.device.type == "cpu"
    assert move_to_device(packed, "cpu") is packed


def test_a_mapping_that_cannot_be_built_from_a_dict_becomes_a_dict():
    class Fixed(dict):
        def __init__(self, a, b):
            super().__init__(a=a, b=b)

    moved = move_to_device(Fixed(torch.ones(1), "b"), META)
    assert type(moved) is dict and moved["a"].device == META and moved["b"] == "b"


# -- the loader's device ---------------------------------------------------------------------------


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("requested", "worker", "available", "expected"),
    [
        ("auto", CUDA0, True, CUDA0),  # ddpkit.init chose the GPU
        ("auto", torch.device("cpu"), True, None),  # ddpkit.init chose the CPU (device=cpu)
        ("auto", None, True, None),  # no ddpkit.init, no nccl group: as the dataset made them
        ("auto", CUDA0, False, None),
        (None, CUDA0, True, None),
        ("cpu", CUDA0, True, None),
        (torch.device("cpu"), CUDA0, True, None),
        ("cuda:1", CUDA0, True, torch.device("cuda", 1)),
        (torch.device("cuda", 2), None, True, torch.device("cuda", 2)),
    ],
)
def test_the_loader_places_batches_on_the_workers_cuda_device_or_nowhere(requested, worker, available, expected):
    assert resolve_loader_device(requested, worker, lambda: available) == expected


@pytest.mark.parametrize(
    ("requested", "available", "says"),
    [
        ("cuda", False, "CUDA is not available here"),
        ("cuda:0", False, "CUDA is not available here"),
        ("meta", True, "only CUDA devices are placed"),
        ("gpu", True, "is not valid"),
        (3.5, True, "is not valid"),
    ],
)
def test_a_device_the_loader_cannot_place_on_is_refused_in_one_line(requested, available, says):
    with pytest.raises(UserError, match=says) as error:
        resolve_loader_device(requested, None, lambda: available)
    assert "\n" not in str(error.value)


def test_on_the_cpu_the_loader_hands_out_the_source_batches_themselves():
    batches = iter([(torch.ones(1),)])
    assert on_device(batches, None) is batches  # nothing wraps the CPU path


@pytest.mark.parametrize("dataset", [IndexDataset(10), TensorDataset(torch.arange(10.0), torch.arange(10))])
def test_the_cpu_path_is_unchanged_by_default(dataset):
    """Without a CUDA device ("auto" on the CPU), the batches are those of device=None, and pin_memory stays off."""
    auto = DataLoader(dataset, batch_size=4, shuffle=True)
    kept = DataLoader(dataset, batch_size=4, shuffle=True, device=None)
    assert auto.device is None and kept.device is None and auto.pin_memory is False
    for a, b in zip(list(auto), list(kept), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(tensors_in(a), tensors_in(b), strict=True))


def test_a_loader_asked_for_cuda_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="CUDA is not available"):
        DataLoader(IndexDataset(10), batch_size=2, device="cuda")


# -- the prefetcher's order, with fake streams -----------------------------------------------------


class _Log(list):
    pass


def _fake_cuda(monkeypatch, log: _Log) -> None:
    class Event:
        count = 0

        def __init__(self):
            self.name = f"event{Event.count}"
            Event.count += 1

        def record(self, stream):
            log.append(f"record {self.name} on {stream.name}")

    class Stream:
        def __init__(self, device=None, name="side"):
            self.name = name

        def wait_event(self, event):
            log.append(f"{self.name} waits {event.name}")

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc):
            log.append(f"leave {self.stream.name}")

    compute = Stream(name="compute")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)

    def fake_move(batch, device, non_blocking=False):
        log.append(f"copy {batch} (non_blocking={non_blocking})")
        return f"{batch} on {device}"

    monkeypatch.setattr(device_module, "move_to_device", fake_move)


def test_the_next_batchs_copy_is_queued_on_the_side_stream_before_the_current_batch_is_handed_out(monkeypatch):
    log = _Log()
    _fake_cuda(monkeypatch, log)

    def source():
        for name in ("b0", "b1", "b2"):
            log.append(f"read {name}")
            yield name

    prefetcher = device_module.DevicePrefetcher(source(), CUDA0)
    assert log == []  # nothing is read before the loop asks
    for batch in prefetcher:
        log.append(f"loop steps on {batch}")
    assert log == [
        "read b0",
        "enter side",
        "copy b0 (non_blocking=True)",
        "record event0 on side",
        "leave side",
        "compute waits event0",  # the loop's kernels run after b0's copy
        "read b1",
        "enter side",
        "copy b1 (non_blocking=True)",  # b1's copy queued before the loop's step on b0
        "record event1 on side",
        "leave side",
        "loop steps on b0 on cuda:0",
        "compute waits event1",
        "read b2",
        "enter side",
        "copy b2 (non_blocking=True)",
        "record event2 on side",
        "leave side",
        "loop steps on b1 on cuda:0",
        "compute waits event2",
        "loop steps on b2 on cuda:0",
    ]


def test_a_streams_items_have_their_batch_moved_and_their_bookkeeping_kept(monkeypatch):
    log = _Log()
    _fake_cuda(monkeypatch, log)
    position = {"dataset": torch.zeros(1)}
    items = list(device_module.DevicePrefetcher(iter([("b0", 1, position, 64, True)]), CUDA0, batch_first=True))
    assert items == [("b0 on cuda:0", 1, position, 64, True)] and items[0][2] is position
    assert "copy b0 (non_blocking=True)" in log


def test_a_cpu_loader_asks_nothing_of_cuda():
    def asked():
        raise AssertionError("torch.cuda.is_available asked")

    for requested in ("auto", None, "cpu"):
        assert resolve_loader_device(requested, None, asked) is None
        assert resolve_loader_device(requested, torch.device("cpu"), asked) is None


def test_the_prefetcher_ends_with_its_source_and_an_empty_source_gives_nothing(monkeypatch):
    _fake_cuda(monkeypatch, _Log())
    assert list(device_module.DevicePrefetcher(iter([]), CUDA0)) == []
    assert list(device_module.DevicePrefetcher(iter(["a"]), CUDA0)) == ["a on cuda:0"]


def test_after_ddpkit_init_on_the_cpu_batches_stay_where_they_are():
    from ddpkit import distributed

    distributed.init(environ={})
    try:
        assert distributed.worker_device() == torch.device("cpu")
        assert DataLoader(IndexDataset(10), batch_size=2).device is None
    finally:
        distributed.shutdown()
    assert distributed.worker_device() is None  # no ddpkit.init, no nccl group


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_where_ddpkit_init_chose_a_gpu_the_loader_places_there_from_pinned_memory(monkeypatch):
    from ddpkit.data import loader as loader_module

    monkeypatch.setattr(loader_module, "worker_device", lambda: CUDA0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    placed = DataLoader(IndexDataset(10), batch_size=2, num_workers=2)
    assert placed.device == CUDA0 and placed.pin_memory is True
    unpinned = DataLoader(IndexDataset(10), batch_size=2, pin_memory=False)
    assert unpinned.device == CUDA0 and unpinned.pin_memory is False  # the user's pin_memory=False holds
    kept = DataLoader(IndexDataset(10), batch_size=2, device=None)
    assert kept.device is None and kept.pin_memory is False
