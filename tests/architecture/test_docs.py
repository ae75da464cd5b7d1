"""The documentation keeps up with the code: every hook is documented with its exact signature, and every
test the threat model names exists."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from tpcore.authoring import hookspecs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "writing-a-policy.md"
SECURITY = ROOT / "docs" / "security.md"


def hook_specs() -> dict[str, str]:
    """``{name: "name(args) -> return"}`` for every hook specification of tpcore."""
    specs = {}
    for name, function in inspect.getmembers(hookspecs, inspect.isfunction):
        if hasattr(function, f"{hookspecs.PROJECT}_spec"):
            signature = str(inspect.signature(function)).replace("'", "")  # annotations are strings here
            specs[name] = f"{name}{signature}"
    return specs


def test_there_are_hooks_to_document():
    assert "tpcore_register_policies" in hook_specs()


def test_every_hook_is_documented_with_its_exact_signature():
    text = DOC.read_text()
    missing = [signature for signature in hook_specs().values() if f"### `{signature}`" not in text]
    assert not missing, f"document these hooks in {DOC.name} under '### `<signature>`': {missing}"


def test_every_test_the_threat_model_cites_exists():
    """``path::test`` or ``::test`` (same path as the citation before it) in docs/security.md."""
    cited, path = [], None
    for file, name in re.findall(r"`((?:tests|plugins)/[\w/]+\.py)?::(test_\w+)`", SECURITY.read_text()):
        path = file or path
        cited.append((path, name))
    assert len(cited) >= 10
    missing = []
    for file, name in cited:
        tree = ast.parse((ROOT / file).read_text())
        if name not in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}:
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/security.md cites tests that do not exist: {missing}"


def test_every_source_and_test_file_the_docs_name_exists():
    """A path of tpcore's sources, of the core's tests or of bench/ named in the README, docs/ or bench/README.md
    (``tpcore/served/handle.py``, ``tests/served/test_lookahead.py``): moved or renamed, the docs follow. A line
    that names a commit (a record of a probe at that commit) may name a file of that commit."""
    documents = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (document.name, path)
        for document in documents
        for line in document.read_text().splitlines()
        if not re.search(r"\b[0-9a-f]{7,40}\b", line)
        for path in re.findall(r"(?<![\w/.-])((?:tpcore|tests|bench)/[\w/]+\.(?:py|sh))", line)
    }
    assert len(named) >= 20
    missing = sorted(f"{document}: {path}" for document, path in named if not (ROOT / path).exists())
    assert missing == []
