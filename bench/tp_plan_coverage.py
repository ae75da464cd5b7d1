"""Which transformers models the tp-plan fallback covers, and how many collectives its split costs.

For every model type whose config (or one of its sub-configs) carries a ``base_model_tp_plan``:
build its causal LM (else its base model) from the default config shrunk to two small layers
(:func:`tpcore.testing.samples.small_config`, random weights), derive the policies from the plan alone
(:func:`tpcore.select.tp_plan.derive_policies`, plugins not consulted) and check the split at 2 ranks
against the unsplit model (:func:`tpcore.testing.check_equivalence`, fp32 on CPU). Each model is
*covered*, or *refused* with the reason: a plan style tpcore does not follow, the model cannot be
built tiny, no inputs, a split or a run that fails.

Per block class it also counts the collectives one block's forward costs, from the plan and the
derived policy: transformers' own plan gathers each ``colwise_gather_output`` and all-reduces each
``rowwise`` / ``rowwise_split_input`` linear and each ``moe_tp_experts`` / ``all_reduce`` module;
tpcore all-reduces each row-parallel module and each column-split norm (two numbers per row) and
gathers nothing.

Writes ``bench/results/tp_plan_coverage.md``.

    python bench/tp_plan_coverage.py              # a few minutes on 2 CPU cores
    python bench/tp_plan_coverage.py --only phi3 olmo2
"""

from __future__ import annotations

import re

from _common import arguments, markdown_table, parse, write_result
from _model_types import check_each, model_class_for, planned_model_types, quiet

#: the model types of a --quick run: a dense decoder, one with grouped KV heads, a mixture of experts
QUICK = ("llama", "qwen2", "mixtral")
GATHERS = {"colwise_gather_output"}
REDUCED_LINEARS = {"rowwise", "rowwise_split_input"}
REDUCED_MODULES = {"moe_tp_experts", "all_reduce"}


def plan_collectives(block, rules: dict[str, str]) -> tuple[int, int]:
    """``(gathers, all-reduces)`` one forward of ``block`` costs under transformers' own plan ``rules``."""
    import torch

    gathers = reduces = 0
    for path, style in rules.items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue  # a parameter (fused experts) or a module this block class lacks
        gathers += style in GATHERS
        reduces += (style in REDUCED_LINEARS and isinstance(module, torch.nn.Linear)) or style in REDUCED_MODULES
    return gathers, reduces


def tpcore_collectives(block, policy) -> int:
    """All-reduces one forward of ``block`` costs under the derived ``policy``: one per row-parallel
    module, one per column-split norm (of the tensors the policy names that ``block`` holds)."""
    from tpcore import NORM, ROW

    tensors = dict(block.named_parameters())
    owners = set()
    for spec in policy.layers():
        if spec.weight not in tensors:
            continue
        # a linear's or a norm's ``.weight``; a fused experts tensor is its experts module's own parameter
        module = spec.weight.rpartition(".")[0]
        if spec.style in (ROW, NORM) or spec.replace is not None:
            owners.add(module)
    return len(owners)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"\s+", " ", text)[:320]


def check_one(model_type: str, config_class, pools, world_size: int) -> dict:
    """The outcome for one model type: ``status`` (covered / refused), ``reason``, ``collectives``."""
    import torch

    from tpcore.select.auto import AutoPolicy
    from tpcore.select.tp_plan import TpPlanError, derive_policies, sub_model_plans
    from tpcore.testing import ModelSpec, check_equivalence
    from tpcore.testing.samples import sample_inputs, small_config

    row = {"type": model_type, "model": "", "status": "refused", "reason": "", "collectives": "", "plugin": ""}
    model_class = model_class_for(model_type)
    if model_class is None:
        row["reason"] = "no model class for it in transformers' auto mappings (a sub-model config)"
        return row
    row["model"] = model_class.__name__
    try:
        spec = ModelSpec(model_class, small_config(config_class(), (world_size,)), seed=0)
        model = spec.build()
    except Exception as error:
        row["reason"] = f"cannot be built tiny: {type(error).__name__}: {first_line(error)}"
        return row
    row["plugin"] = ", ".join(sorted({entry.distribution for entry in AutoPolicy().entries_for(model)}))
    try:
        policies = derive_policies(model)
    except TpPlanError as error:
        row["reason"] = f"plan: {first_line(error)}"
        return row
    except Exception as error:
        row["reason"] = f"deriving the policies: {type(error).__name__}: {first_line(error)}"
        return row
    counts = []
    for plan in sub_model_plans(model):
        # the raw rules (plan.rules leaves out the styles that need no split, moe_tp_experts among them)
        raw = (
            {
                path: style
                for pattern, style in plan.config.base_model_tp_plan.items()
                for _, star, path in [pattern.partition(".*.")]
                if star
            }
            if plan.rules
            else {}
        )
        for blocks in plan.rules:
            # per block class, the block the plan splits most (a MoE stack's first blocks may be dense)
            busiest: dict[type, tuple[tuple[int, int], torch.nn.Module]] = {}
            for block in model.get_submodule(blocks).children():
                cost = plan_collectives(block, raw)
                if type(block) not in busiest or sum(cost) > sum(busiest[type(block)][0]):
                    busiest[type(block)] = (cost, block)
            for kind, ((gathers, reduces), block) in busiest.items():
                policy = next((p for p in policies if p.layer_class.endswith(kind.__qualname__)), None)
                if policy is not None:
                    counts.append(f"{kind.__name__}: {gathers} + {reduces} -> {tpcore_collectives(block, policy)}")
    row["collectives"] = "; ".join(dict.fromkeys(counts))
    try:
        inputs = sample_inputs(model)
    except Exception as error:  # ValueError: none it accepts; a tiny vision tower may fail to run
        row["reason"] = f"no inputs: {type(error).__name__}: {first_line(error)}"
        return row
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as error:
        row["reason"] = f"the tiny unsplit model does not run: {type(error).__name__}: {first_line(error)}"
        return row
    try:
        diffs = check_equivalence(spec, inputs, world_sizes=(world_size,), policies=policies, pools=pools)
    except Exception as error:
        row["reason"] = f"split at {world_size} ranks: {type(error).__name__}: {first_line(error)}"
        return row
    worst = max(diffs[world_size].values(), default=0.0)
    row["status"], row["reason"] = "covered", f"largest difference {worst:.1e}"
    return row


def main() -> None:
    parser = arguments(__doc__, "tp_plan_coverage", f"only {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="*", help="model types to check (default: every one with a tp plan)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parse(parser)
    if args.quick and not args.only:
        args.only = list(QUICK)

    quiet()
    types = planned_model_types()
    if args.only:
        types = {name: types[name] for name in args.only if name in types}
    rows, seconds, _ = check_each(
        types,
        lambda model_type, config_class, pools: check_one(model_type, config_class, pools, args.world_size),
        lambda row: f"{row['status']:<8} {row['type']:<32} {row['reason']}",
    )
    covered = [row for row in rows if row["status"] == "covered"]
    summary = (
        f"{len(covered)} of {len(rows)} model types whose config carries a `base_model_tp_plan` derive a policy "
        f"that runs equivalent at {args.world_size} ranks ({seconds:.0f} s)."
    )
    print("\n" + summary)
    header = ["model type", "class", "result", "why / largest logit difference", "collectives per block"]
    table = markdown_table(
        header + ["plugin"],
        [
            [r["type"], r["model"], r["status"], r["reason"].replace("|", "/"), r["collectives"], r["plugin"]]
            for r in sorted(rows, key=lambda r: (r["status"] != "covered", r["type"]))
        ],
    )
    legend = (
        "Collectives per block: `gathers + all-reduces` under transformers' own plan `->` all-reduces under "
        "tpcore's derived split (no gathers), counted from the plan and the policy. `plugin`: an installed "
        "tpcore plugin covers the model too (and wins over the derived policy)."
    )
    write_result(
        "tp_plan_coverage",
        "The tp-plan fallback over every transformers config with a tp plan",
        [summary, legend, table],
        "gloo",
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
