"""DCP's index is read without running code: a module it names is never imported before the allow list says so."""

from __future__ import annotations

import importlib.abc
import pickle
import sys
from pathlib import Path

import pytest

from ddpkit.checkpoint.disk.sharded_reading import read_index


class _ImportsSeen(importlib.abc.MetaPathFinder):
    """Records every module an import looks for (and finds none itself: the import goes on as usual)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, fullname, path, target=None):
        self.names.append(fullname)
        return None


def test_a_torch_module_the_index_names_is_refused_before_it_is_imported(tmp_path: Path, monkeypatch) -> None:
    # A pickle whose only global is torch.<a module not imported yet>: importing it would run its code.
    index = tmp_path / ".metadata"
    index.write_bytes(b"\x80\x04ctorch.ckptsafe_probe\nrun\n)R.")
    seen = _ImportsSeen()
    monkeypatch.setattr(sys, "meta_path", [seen, *sys.meta_path])
    with pytest.raises(pickle.UnpicklingError, match="global 'torch.ckptsafe_probe.run' is not allowed"):
        read_index(tmp_path)
    assert "torch.ckptsafe_probe" not in seen.names
