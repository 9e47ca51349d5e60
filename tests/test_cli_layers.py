"""The commands sit on top: pyproject's layers contract places every module of ddpkit, and nothing below the
commands imports them (import-linter holds the contract in tests/test_checkers.py; this test holds its shape)."""

from __future__ import annotations

import re
from pathlib import Path

import grimp
import pytest
import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
LAYERS = "Layers: commands on top of the clients, the clients on top of the core"


def contracts() -> dict[str, dict]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {contract["name"]: contract for contract in config["contracts"]}


def test_the_layers_contract_places_every_module_of_ddpkit():
    layers = contracts()[LAYERS]["layers"]
    assert layers[:2] == ["ddpkit.cli", "ddpkit.commands"]  # the old entry point, then the commands
    placed = {name for layer in layers for name in re.split(r"\s*[|:]\s*", layer)}
    graph = grimp.build_graph("ddpkit", cache_dir=None)
    children = graph.find_children("ddpkit") - {"ddpkit.__main__"}  # the entry point of python -m ddpkit
    assert children - placed == set(), "place each new module of ddpkit in the layers contract"


def test_nothing_outside_the_commands_imports_them():
    graph = grimp.build_graph("ddpkit", cache_dir=None)
    commands = {"ddpkit.commands", *graph.find_descendants("ddpkit.commands")}
    importers = {m for module in commands for m in graph.find_modules_that_directly_import(module)} - commands
    assert importers <= {"ddpkit.__main__", "ddpkit.cli"}  # the entry points: python -m ddpkit, the old one


def test_ddpkit_train_is_held_to_the_public_api():
    contract = contracts()["ddpkit train imports only ddpkit's public names"]
    assert contract["type"] == "forbidden" and contract["source_modules"] == ["ddpkit.train"]
    assert contract["allow_indirect_imports"] is True
    assert "ddpkit.checkpoint" in contract["forbidden_modules"] and "ddpkit" not in contract["forbidden_modules"]
    # what the public API gives is read from it: Checkpointer, DataLoader, FolderLock...
    assert not [line for line in contract.get("ignore_imports", []) if "-> ddpkit.checkpoint.manager" in line]


def test_the_old_entry_point_of_a_script_still_runs_the_command(capsys):
    import ddpkit.cli

    with pytest.warns(DeprecationWarning, match="ddpkit.commands.dispatch.main"):
        main = ddpkit.cli.main
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("ddpkit ")
