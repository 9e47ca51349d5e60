"""No import circle anywhere in ddpkit, imports inside functions and under TYPE_CHECKING included.

pyproject's import contracts forbid circles between the siblings of every package, at every depth, and
through the package top. One shape escapes them: a module that imports the package containing it (its
``__init__``) while that ``__init__`` imports the module back. So this test follows every import of the
graph that import-linter reads (grimp's) and fails on any one that a chain of imports leads back from.
"""

from __future__ import annotations

import grimp


def test_no_import_circle() -> None:
    graph = grimp.build_graph("ddpkit", cache_dir=None)
    circles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                circles.append(" -> ".join((module, *back)))
    assert not circles, "import circles; open each with a module that both sides import:\n" + "\n".join(circles)
