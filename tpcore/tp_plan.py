"""Policies derived from a transformers ``base_model_tp_plan``, for models no plugin covers.

Many transformers configs declare how their base model splits: ``{"layers.*.self_attn.q_proj":
"colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``. Each ``<prefix>.*.<path>`` rule names a
linear layer inside the repeated blocks at ``<prefix>``; this module turns those rules into one
:class:`Policy` per block class. Styles it understands:

==========================================  ===================================================
``colwise`` / ``rowwise``                   column / row parallel (q/k/v and MLP in / outputs)
``packed_colwise``                          column parallel of two packed halves (gate|up)
``replicated_with_grad_allreduce``,         left whole on every rank (norms, embeddings)
``replicate``, ``embedding_*``
==========================================  ===================================================

Any other style (gathered outputs, experts, MLA) means the plan cannot be followed, and the
model needs a plugin. Key/value projections narrower than the query projection carry grouped KV
heads, which are replicated when the ranks outnumber them.
"""

from __future__ import annotations

from torch import nn

from tpcore.policy import Layer, Policy, divide

__all__ = ["TpPlanError", "derive_policies"]

_SPLIT = {"colwise": ("column", 1), "rowwise": ("row", 1), "packed_colwise": ("column", 2)}
_KEPT_WHOLE = {"replicated_with_grad_allreduce", "replicate", "embedding_rowwise", "embedding_colwise"}
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")


class TpPlanError(LookupError):
    """The model's tp plan is missing or uses a style tpcore cannot follow."""


def derive_policies(model: nn.Module) -> list[type[Policy]]:
    """One policy per block class that the model config's ``base_model_tp_plan`` describes."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise TpPlanError(f"{type(model).__name__}'s config has no base_model_tp_plan")
    rules: dict[str, dict[str, str]] = {}
    for pattern, style in plan.items():
        if style in _KEPT_WHOLE:
            continue
        if style not in _SPLIT:
            raise TpPlanError(f"its tp plan splits {pattern!r} as {style!r}, which tpcore does not follow")
        prefix, star, path = pattern.partition(".*.")
        if not star or "*" in path:
            raise TpPlanError(f"its tp plan rule {pattern!r} is not of the form '<blocks>.*.<linear>'")
        rules.setdefault(prefix, {})[path] = style
    base = getattr(model, "base_model", model)
    policies = []
    for prefix, paths in rules.items():
        try:
            blocks = base.get_submodule(prefix)
        except AttributeError:
            raise TpPlanError(f"its tp plan names blocks {prefix!r}, which the model lacks") from None
        for block_class in dict.fromkeys(type(block) for block in blocks):
            block = next(b for b in blocks if type(b) is block_class)
            policies.append(_policy_for(block, paths, config))
    return policies


def _policy_for(block: nn.Module, paths: dict[str, str], config) -> type[Policy]:
    """A Policy for the class of ``block``, from the plan's rules that exist in it."""
    columns, rows, attention_paths = [], [], set()
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for path, style in paths.items():
        try:
            linear = block.get_submodule(path)
        except AttributeError:
            continue  # blocks of this class lack it (hybrid stacks)
        if not isinstance(linear, nn.Linear):
            raise TpPlanError(f"its tp plan splits {path!r}, a {type(linear).__name__}, not a Linear")
        kind, n_fused = _SPLIT[style]
        grouped = kind == "column" and heads and kv_heads != heads and path.rsplit(".", 1)[-1] in ("k_proj", "v_proj")
        spec = Layer(
            weight=f"{path}.weight",
            bias=f"{path}.bias",
            n_fused=n_fused,
            heads="num_key_value_heads" if grouped else None,
        )
        (columns if kind == "column" else rows).append(spec)
        if "attn" in path or "attention" in path:
            attention_paths.add(path.rpartition(".")[0])
    attributes = {
        f"{owner}.{name}" if owner else name: name
        for owner in attention_paths
        for name in _HEAD_ATTRIBUTES
        if isinstance(getattr(block.get_submodule(owner) if owner else block, name, None), int)
    }

    def replace_arguments(config, world_size):
        if heads is None:
            return {}
        local = divide(heads, world_size, "num_attention_heads")
        if kv_heads % world_size and world_size % kv_heads:
            divide(kv_heads, world_size, "num_key_value_heads")  # raises, naming the attribute
        local_kv = kv_heads // world_size if kv_heads % world_size == 0 else 1
        values = {
            "num_heads": local,
            "num_attention_heads": local,
            "num_key_value_heads": local_kv,
            "num_key_value_groups": local // local_kv,
        }
        return {path: values[name] for path, name in attributes.items()}

    kind = type(block)
    return type(
        f"{kind.__name__}PlanPolicy",
        (Policy,),
        {
            "__doc__": f"Derived from {type(config).__name__}.base_model_tp_plan.",
            "__module__": __name__,
            "layer_class": f"{kind.__module__}.{kind.__qualname__}",
            "name": f"{kind.__name__} (tp plan of {config.model_type})",
            "replace_arguments": staticmethod(replace_arguments),
            "attn_qkv": staticmethod(lambda: list(columns)),
            "attn_out": staticmethod(lambda: list(rows)),
        },
    )
