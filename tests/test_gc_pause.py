"""Garbage collection paused for imports, and a forked worker's collection on again with its inheritance frozen."""

import gc
import sys

import pytest

from ddpkit.gc_pause import collection_paused, enable_in_forked_worker, import_paused


@pytest.fixture
def collection_restored():
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was_enabled else gc.disable)()


@pytest.mark.parametrize("enabled_before", [True, False])
def test_collection_is_off_in_the_block_and_as_before_after_it(collection_restored, enabled_before):
    (gc.enable if enabled_before else gc.disable)()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled() == enabled_before
    with pytest.raises(KeyError), collection_paused():
        raise KeyError("an error in the block")
    assert gc.isenabled() == enabled_before


def test_modules_are_imported_while_collection_is_off(collection_restored, tmp_path, monkeypatch):
    (tmp_path / "gc_seen_at_import.py").write_text("import gc\nenabled = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gc_seen_at_import", raising=False)
    gc.enable()
    import_paused("json", "gc_seen_at_import")
    assert sys.modules["gc_seen_at_import"].enabled is False
    assert gc.isenabled()
    with pytest.raises(ModuleNotFoundError):
        import_paused("no_such_module_here")
    assert gc.isenabled()


def test_a_forked_worker_freezes_what_it_inherited_and_collects(collection_restored):
    gc.disable()  # as in the worker server
    inherited = [[] for _ in range(1000)]
    enable_in_forked_worker()
    assert gc.isenabled() and gc.get_freeze_count() >= len(inherited)
