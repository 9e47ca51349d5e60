"""The manual's layers page names the layers the import contract holds, top down, module for module.

The page (docs/design/layers.md) draws the layers as a table in its first ``text`` block: a line that starts
with a word begins a layer (the word is its name, the rest its modules, ``ddpkit.`` left out), an indented
line continues it, ``|`` separates modules independent of each other. pyproject's layers contract is the
truth; a layer added, removed or reordered there without the page (or the other way round) fails here.
"""

from __future__ import annotations

import re

import tomllib

from tests.docs.markdown import DOCS, ROOT

CONTRACT = "Layers: commands on top of the clients, the clients on top of the core"


def contract_layers() -> list[set[str]]:
    """The contract's layers, top down, each as the set of its module names without ``ddpkit.``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["name"] == CONTRACT]
    assert contract["type"] == "layers"
    return [{name.strip().removeprefix("ddpkit.") for name in re.split(r"[|:]", layer)} for layer in contract["layers"]]


def page_layers(text: str) -> list[set[str]]:
    """The page's table, top down: each layer's module names (its name, the first word, left out)."""
    block = re.search(r"```text\n(.*?)```", text, re.S)
    assert block is not None, "the layers page draws its layers in a ```text block"
    layers: list[set[str]] = []
    for line in block.group(1).splitlines():
        words = line.replace("|", " ").split()
        if not words:
            continue
        if line[0].isspace():
            layers[-1] |= set(words)
        else:
            layers.append(set(words[1:]))
    return layers


def test_the_layers_page_names_the_contracts_layers_in_order() -> None:
    assert page_layers((DOCS / "design" / "layers.md").read_text()) == contract_layers()


def test_the_table_is_read_as_written() -> None:
    text = "```text\ntop    a b\nmiddle c | d\nbottom e\n       f\n```\n"
    assert page_layers(text) == [{"a", "b"}, {"c", "d"}, {"e", "f"}]
