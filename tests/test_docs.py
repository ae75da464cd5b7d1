"""The documentation keeps up with the code: every hook is documented with its exact signature."""

from __future__ import annotations

import inspect
from pathlib import Path

from tpcore import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-policy.md"


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
