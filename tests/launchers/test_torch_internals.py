"""The private parts of torch that ddpkit.launchers.torch_internals uses exist on the installed torch, as expected.

One entry of :data:`EXPECTED` per torch version: a new torch is one more entry, whose failures name what moved.
"""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch

import ddpkit.launchers.torch_internals as internals

AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
CONTEXT = "torch.distributed.elastic.multiprocessing.api:MultiprocessContext"

EXPECTED: dict[str, dict[str, tuple[str, ...] | None]] = {
    "2.13": {
        # "module:object[.method]": the method's parameters (None: an attribute assigned in the class's code).
        "torch.distributed.launcher.api:LocalElasticAgent": None,
        f"{AGENT}._monitor_workers": ("self", "worker_group"),
        f"{AGENT}._restart_workers": ("self", "worker_group"),
        f"{AGENT}._exit_barrier": ("self",),
        f"{AGENT}._shutdown": ("self", "death_sig", "timeout"),
        f"{AGENT}._remaining_restarts": None,
        f"{AGENT}._worker_group": None,
        f"{AGENT}._store": None,
        f"{AGENT}._pcontext": None,
        f"{CONTEXT}._pc": None,
        f"{CONTEXT}._ret_vals": None,
        f"{CONTEXT}._return_values": None,
        f"{CONTEXT}._worker_finished_event": None,
        "torch.distributed.elastic.multiprocessing.api:SignalException.__init__": ("self", "msg", "sigval"),
        "torch.distributed.elastic.rendezvous.utils:parse_rendezvous_endpoint": ("endpoint", "default_port"),
    },
}

VERSION = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _assigned_in(cls: type, name: str) -> bool:
    """Whether the code of ``cls`` or one of its bases assigns ``self.name``."""
    return any(
        f"self.{name} =" in inspect.getsource(base) or f"self.{name}:" in inspect.getsource(base)
        for base in cls.__mro__
        if base.__module__.startswith("torch.")
    )


def _check(entry: str, parameters: tuple[str, ...] | None) -> str:
    """'' if ``entry`` is as expected on this torch, else what differs."""
    module_name, path = entry.split(":")
    owner: object = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if parameters is None:
        if hasattr(owner, name) or (isinstance(owner, type) and _assigned_in(owner, name)):
            return ""
        return f"{entry} is gone"
    target = getattr(owner, name, None)
    if target is None:
        return f"{entry} is gone"
    found = tuple(inspect.signature(target).parameters)
    return "" if found == parameters else f"{entry} takes {found}, not {parameters}"


def test_this_torch_version_is_one_whose_internals_were_checked():
    assert VERSION in EXPECTED, (
        f"torch {torch.__version__}: ddpkit.launchers.torch_internals was checked on torch {sorted(EXPECTED)} only; "
        "add an entry for this version to EXPECTED once each use there is confirmed"
    )


@pytest.mark.parametrize("entry", sorted(EXPECTED.get(VERSION, {})))
def test_each_private_part_exists_with_its_expected_signature(entry):
    problem = _check(entry, EXPECTED[VERSION][entry])
    assert not problem, f"torch {torch.__version__}: {problem} (used by ddpkit.launchers.torch_internals)"


def test_every_private_part_the_module_uses_is_listed():
    """Each private name of torch in the module's code is an entry of the table (and so checked)."""
    source = inspect.getsource(internals)
    listed = {entry.rsplit(".", 1)[-1].rsplit(":", 1)[-1] for entry in EXPECTED[VERSION]}
    used = {word for word in _private_words(source) if not word.startswith("__")}
    ours = {"_all_exited_without_returning"}
    assert used - ours <= listed, f"torch {torch.__version__}: not checked: {sorted(used - ours - listed)}"


def _private_words(source: str) -> set[str]:
    """The names with a leading underscore that ``source`` reads (``x._name``) or defines (``def _name``)."""
    nodes = list(ast.walk(ast.parse(source)))
    return {node.attr for node in nodes if isinstance(node, ast.Attribute) and node.attr.startswith("_")} | {
        node.name for node in nodes if isinstance(node, ast.FunctionDef) and node.name.startswith("_")
    }
