"""Showing a plan: what is cut how, the bytes each rank holds, and what stays whole on every rank (and why).

:func:`report` is the table ``tpcore plugins --model M`` prints; :func:`log_plan` is what a load logs
(each rank's bytes at info, and past :data:`REPLICATED_SHARE` of the model held whole, a warning
naming the largest replicated modules with their reasons).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from tpcore.cut.shares import PerRank
from tpcore.cut.split import Split
from tpcore.plan.shard_plan import ShardPlan

__all__ = [
    "REPLICATED_SHARE",
    "as_json",
    "bytes_summary",
    "describe",
    "format_bytes",
    "log_plan",
    "replicated_warning",
    "report",
]

#: :func:`log_plan` warns when the tensors every rank holds whole exceed this share of the model's bytes
REPLICATED_SHARE = 0.10
#: how many of the largest replicated modules that warning names
_NAMED_IN_WARNING = 3

logger = logging.getLogger("tpcore.plan")


def report(plan: ShardPlan) -> str:
    """What is cut how, what stays replicated, each rank's shares where they differ, and the bytes each
    rank holds (layers folded as ``*``)."""
    rows: dict[tuple[str, str, tuple, str], int] = {}
    ranks = range(plan.world_size)
    for name, shape in plan.shapes.items():
        pieces = _per_rank_text([_shape(plan.shard_shape(name, rank)) for rank in ranks])
        key = (re.sub(r"\.\d+\.", ".*.", name), describe(plan.splits.get(name)), shape, pieces)
        rows[key] = rows.get(key, 0) + 1
    width = max((len(k[0]) for k in rows), default=0)
    lines = [f"{plan.model_name} over {plan.world_size} ranks" + ("" if plan.uniform else ", shares by rank") + ":"]
    for (name, how, shape, piece), count in rows.items():
        times = f" x{count}" if count > 1 else ""
        lines.append(f"    {name:<{width}}  {how:<28} {_shape(shape)} -> {piece}{times}")
    attributes: dict[tuple[str, str], int] = {}
    for path, value in plan.attributes.items():
        if isinstance(value, PerRank):
            folded = (re.sub(r"\.\d+\.", ".*.", path), _per_rank_text([_value_text(v) for v in value]))
            attributes[folded] = attributes.get(folded, 0) + 1
    for (path, values), count in attributes.items():
        lines.append(f"    {path:<{width}}  {'set per rank':<28} {values}" + (f" x{count}" if count > 1 else ""))
    lines.append(bytes_summary(plan))
    return "\n".join(lines)


def bytes_summary(plan: ShardPlan) -> str:
    """Each rank's bytes against the whole model's, and the replicated bytes:
    ``"per rank 273.5 MiB | 239.8 MiB of 513.1 MiB (53% | 47%; 137.5 KiB replicated on every rank)"``."""
    per_rank = [plan.bytes_per_rank(rank) for rank in range(plan.world_size)]
    whole = plan.whole_bytes
    sizes = _per_rank_text([format_bytes(size) for size in per_rank])
    shares = _per_rank_text([f"{size / whole:.0%}" if whole else "-" for size in per_rank])
    replicated = format_bytes(plan.replicated_bytes)
    return f"per rank {sizes} of {format_bytes(whole)} ({shares}; {replicated} replicated on every rank)"


def replicated_warning(plan: ShardPlan, share: float = REPLICATED_SHARE) -> str | None:
    """Past ``share`` of the model's bytes held whole on every rank (over more than one rank), what says so:
    the share, then the largest replicated modules (layers folded as ``*``), each with its class, its bytes
    and why it stays whole; ``None`` below it."""
    whole, replicated = plan.whole_bytes, plan.replicated_bytes
    if plan.world_size < 2 or not whole or replicated <= share * whole:
        return None
    sizes: dict[tuple[str, str, str], int] = {}
    modules: dict[tuple[str, str, str], set[str]] = {}
    for name, (module_class, reason) in plan.kept_whole.items():
        path = name.rpartition(".")[0]
        key = (re.sub(r"\.\d+(?=\.|$)", ".*", path), module_class, reason)
        sizes[key] = sizes.get(key, 0) + plan.tensor_bytes(name)
        modules.setdefault(key, set()).add(path)
    largest = sorted(sizes, key=lambda key: -sizes[key])[:_NAMED_IN_WARNING]
    lines = [
        f"{plan.model_name} over {plan.world_size} ranks: {format_bytes(replicated)} of its "
        f"{format_bytes(whole)} ({replicated / whole:.0%}) stays whole on every rank; the largest:"
    ]
    for key in largest:
        module, module_class, reason = key
        count = f" x{len(modules[key])}" if len(modules[key]) > 1 else ""
        size = format_bytes(sizes[key])
        lines.append(f"    {module or '(model)'} ({module_class}{count}, {size}) is replicated: {reason}")
    return "\n".join(lines)


def log_plan(plan: ShardPlan) -> None:
    """Log each rank's bytes (info) and, past :data:`REPLICATED_SHARE` replicated, what stays whole (a warning)."""
    logger.info("%s over %d ranks: %s", plan.model_name, plan.world_size, bytes_summary(plan))
    warning = replicated_warning(plan)
    if warning is not None:
        logger.warning("%s", warning)


def _value_text(value: Any) -> str:
    """A per-rank attribute value in a few characters: a number, or the type of an object (a config copy)."""
    return str(value) if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def describe(split: Split | None) -> str:
    """How ``split`` cuts a tensor, in a few words (``"cut dim 0, 3 packed"``)."""
    if split is None:
        return "replicated"
    if split.pad:
        return "vocabulary rows"
    if split.summand:
        return "whole on rank 0, zeros on the others (a term of the reduced sum)"
    words = [f"dim {split.dim}"]
    if split.n_fused > 1:
        words.append(f"{split.n_fused} packed")
    if split.heads is not None:
        words.append(f"{split.heads} heads" + (" interleaved" if split.interleaved else ""))
    if split.parts and split.widths:  # units of their own widths: "8x16/2x8" (Mamba2's heads and groups)
        words.append("parts of " + "/".join(f"{p}x{w}" for p, w in zip(split.parts, split.widths, strict=True)))
    elif split.parts:
        by_group = " by group" if split.interleaved else ""
        words.append("parts of " + "/".join(map(str, split.parts)) + " heads" + by_group)
    if split.groups is not None:
        words.append(f"{split.groups} groups")
    return "cut " + ", ".join(words)


def _per_rank_text(values: list[str]) -> str:
    """One value if every rank has it, else each rank's (``"(6, 8) | (3, 8)"``)."""
    return values[0] if len(set(values)) == 1 else " | ".join(values)


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def format_bytes(size: int) -> str:
    """``size`` bytes in GiB, MiB or KiB, one decimal."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 2**10:.1f} KiB"


def as_json(plan: ShardPlan) -> dict:
    """A plan as JSON: every tensor's whole shape, each rank's shape and how it is cut (and why a replicated one
    stays whole), the attributes whose values differ by rank (a list, one per rank), each rank's bytes, the
    whole model's and those replicated on every rank."""
    ranks = range(plan.world_size)
    tensors = {
        name: {
            "cut": describe(plan.splits.get(name)),
            "shape": list(shape),
            "per_rank": [list(plan.shard_shape(name, rank)) for rank in ranks],
        }
        for name, shape in plan.shapes.items()
    }
    for name, whole in plan.kept_whole.items():
        tensors[name]["kept_whole"] = whole.reason
    attributes = {
        path: [v if isinstance(v, (int, float)) else type(v).__name__ for v in value]
        for path, value in plan.attributes.items()
        if isinstance(value, PerRank)
    }
    return {
        "tensors": tensors,
        "attributes_per_rank": attributes,
        "bytes_per_rank": [plan.bytes_per_rank(rank) for rank in ranks],
        "whole_bytes": plan.whole_bytes,
        "replicated_bytes": plan.replicated_bytes,
    }
