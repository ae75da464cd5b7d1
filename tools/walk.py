"""Follow ``model`` through ``tpcore.parallelize()`` in the caller's process: the tpcore files it visits, in
order, and each call that climbs back up the layers (a call from a file of a lower layer into one of a higher
layer, as a callback does), by the layer order of pyproject.toml's import-linter contract.

    python tools/walk.py            # a tiny BERT from a model object, then the same saved to a directory

Prints the files visited (first visit order), the climbs (caller -> callee, counted once per pair) and the
import cycles (none expected: tests/architecture/test_architecture.py holds that).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def layer_order() -> dict[str, int]:
    """``{"tpcore.plan": 7, ...}``: each layer's depth, 0 at the top (siblings share one)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return {f"tpcore.{name.strip()}": depth for depth, row in enumerate(config["layers"]) for name in row.split("|")}


def layer_of(module: str, order: dict[str, int]) -> tuple[str, int] | None:
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        name = ".".join(parts[:end])
        if name in order:
            return name, order[name]
    return None


def walk(run) -> tuple[list[str], list[tuple[str, str]]]:
    """The tpcore modules ``run()`` calls into (first visit order), and the climbing calls."""
    order = layer_order()
    visited: list[str] = []
    climbs: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("tpcore.") or frame.f_back is None or frame.f_code.co_name == "<module>":
            return  # an import running a module's body is no step of the walk
        if callee not in visited:
            visited.append(callee)
        caller = frame.f_back.f_globals.get("__name__", "")
        low, high = layer_of(caller, order), layer_of(callee, order)
        if low and high and high[1] < low[1] and (caller, callee) not in climbs:
            climbs.append((caller, callee))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return visited, climbs


def main() -> None:
    import torch
    import transformers

    import tpcore

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    tpcore.parallelize(model, num_gpus=2).deparallelize()  # imports done: what follows is the walk alone
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        for source in (model, directory):
            served = {}

            def run(source=source, served=served):
                served["model"] = tpcore.parallelize(source, num_gpus=2)

            visited, climbs = walk(run)
            served["model"].deparallelize()
            kind = "a model object" if source is model else "a saved directory"
            print(f"parallelize({kind}): {len(visited)} modules visited, {len(climbs)} climbs back up")
            print("  visited: " + ", ".join(visited))
            for caller, callee in climbs:
                print(f"  climb: {caller} -> {callee}")


if __name__ == "__main__":
    main()
