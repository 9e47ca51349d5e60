"""The built-in trainer's run is a client of the public API: train/run.py imports nothing else but what its
docstring names.

Read from the source with ast (nothing is imported to check it), so a new import past the public API fails
here until it is made public or named, with its reason, in the module's docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit
import ddpkit.datasets
import ddpkit.train.run

RUN = Path(ddpkit.train.run.__file__)
PUBLIC_MODULES = {"ddpkit": set(ddpkit.__all__), "ddpkit.datasets": set(ddpkit.datasets.__all__)}
"""Modules whose ``__all__`` is a promise to users, and the names it lists."""
TRAINERS_OWN = ("ddpkit.train",)
"""The trainer's own modules (the layer it belongs to)."""


def ddpkit_imports(source: str) -> list[tuple[str, str]]:
    """(module, name) of every ``from ddpkit... import name``; (module, "") for ``import ddpkit...``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ddpkit":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "ddpkit"]
    return found


def past_the_public_api(imports: list[tuple[str, str]], docstring: str) -> list[str]:
    """The imports that are neither public, nor the trainer's own, nor named in ``docstring``."""
    wrong = []
    for module, name in imports:
        if module == "ddpkit" and not name:
            continue  # `import ddpkit`: its attributes are the public names
        if module in PUBLIC_MODULES and name in PUBLIC_MODULES[module]:
            continue
        if any(module == own or module.startswith(own + ".") for own in TRAINERS_OWN):
            continue
        if name and f"``{module}.{name}``" in docstring:
            continue
        wrong.append(f"{module}.{name}" if name else module)
    return wrong


def test_run_imports_only_the_public_api_and_the_plumbing_its_docstring_names():
    source = RUN.read_text()
    imports = ddpkit_imports(source)
    assert ("ddpkit", "Checkpointer") in imports  # the parse sees the imports at all
    assert past_the_public_api(imports, ast.get_docstring(ast.parse(source)) or "") == []


def test_an_import_past_the_public_api_is_caught():
    imports = ddpkit_imports(
        "from ddpkit.checkpoint.rng import seed_everything\nimport ddpkit.data.loader\nfrom ddpkit import init\n"
        "from ddpkit.log import get_logger\n"
    )
    assert past_the_public_api(imports, "uses ``ddpkit.log.get_logger``") == [
        "ddpkit.checkpoint.rng.seed_everything",
        "ddpkit.data.loader",
    ]


def test_the_features_an_own_loop_wants_are_public():
    for name in ("seed_everything", "apply_transfer", "export_checkpoint", "CheckpointOptions", "TransferReport"):
        assert name in ddpkit.__all__ and getattr(ddpkit, name).__doc__
    assert "load_datasets" in ddpkit.datasets.__all__
