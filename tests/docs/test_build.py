"""The manual builds offline with ``mkdocs build --strict``, and every relative link of README.md and docs/ resolves.

Strict mode makes MkDocs' own warnings errors: a page missing from the nav, a link to a page or an anchor that
does not exist, a docstring mkdocstrings cannot parse, a name of the API reference that does not import. The
README is no page of the manual, so its links are checked here: each relative link names a file of the
checkout, and each anchor a heading of the page it points to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
from ddpkit.commands.help import options
from ddpkit.launchers.script import RunConfig
from ddpkit.train.config import TrainConfig
from tests.docs.markdown import DOCS, ROOT, anchors, links, pages


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The manual, built once with ``mkdocs build --strict`` into a temporary folder."""
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # no notice about Material's successor
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return folder


@pytest.mark.slow
def test_the_manual_builds_in_strict_mode(site):
    assert (site / "index.html").is_file()
    assert (site / "getting-started" / "index.html").is_file()


def test_the_built_manual_fetches_nothing_from_the_network(site):
    """No web fonts (Material's ``font: false``), no script or style from a CDN: it reads offline."""
    for page in site.rglob("*.html"):
        text = page.read_text()
        for host in ("fonts.googleapis.com", "fonts.gstatic.com", "cdn.jsdelivr.net", "unpkg.com"):
            assert host not in text, f"{page.relative_to(site)} loads from {host}"


@pytest.mark.parametrize("schema", [TrainConfig, RunConfig], ids=lambda cls: cls.__name__)
def test_the_options_page_lists_every_field_of_the_config_dataclasses(site, schema):
    """The option tables are generated from the dataclasses (docs/hooks.py): every key, with its docstring."""
    html = (site / "reference" / "options" / "index.html").read_text()
    missing = [option.key for option in options(schema) if f"<code>{option.key}</code>" not in html]
    assert not missing, f"options of {schema.__name__} missing from the Options page: {missing}"
    assert "<!-- options:" not in html


def test_the_api_reference_documents_every_public_name(site):
    html = (site / "reference" / "api" / "index.html").read_text()
    missing = [name for name in ddpkit.__all__ if name != "__version__" and f'id="ddpkit.{name}"' not in html]
    assert not missing, f"names of ddpkit.__all__ missing from docs/reference/api.md: {missing}"


def test_every_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav is reachable only by search."""
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in nav]
    assert not missing, missing


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
