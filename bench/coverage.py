"""Which transformers model types tpcore splits, and by what: every model type, not only those with a tp plan.

For every model type in transformers' ``CONFIG_MAPPING``: its causal LM (else its base model, else the first
class of another auto mapping) built from the default config shrunk to two small layers
(:func:`tpcore.testing.samples.small_config`, random weights, head counts 2 divides), run unsplit on the
inputs ``tpcore check`` builds for it, then split at 2 ranks by what ``parallelize()`` would choose (the
installed plugins, the config's tp plan, else the structural policy, proven on a tiny copy) and compared with
the unsplit model on every rank (:func:`tpcore.testing.check_equivalence`, fp32, gloo). Each model type is
*equal* (with what split it and the share of the model a rank holds), or stops at the first step that fails:
*not built* (no model class, or the shrunk config or model does not build), *not run* (no inputs, or the
unsplit model fails on them), *refused* (no policy, or the plan or its proof refuses the split), or *differs*
(the split runs and gives other outputs, or a rank raises).

Writes ``bench/results/coverage.md`` (the table, its totals and the largest causes of the rest) and
``bench/results/coverage.json``.

    python bench/coverage.py            # every model type: CPU heavy (an hour or more on 2 busy cores)
    python bench/coverage.py --quick    # a dozen types, one of each kind of split
    python bench/coverage.py --only mamba sam biogpt
    python bench/coverage.py --again refused differs   # those rows of the last run, checked again
"""

from __future__ import annotations

import collections
import json
import re

from _common import arguments, markdown_table, parse, result_path, write_result
from _model_types import check_each, model_class_for, quiet, registered_model_types

QUICK = ("bert", "gpt2", "llama", "qwen3", "mamba", "sam", "siglip2", "qwen2_vl", "biogpt", "xglm", "resnet", "fnet")
#: the auto mappings a model class is looked up in, in this order
MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
)
STEPS = ("equal", "differs", "refused", "not run", "not built")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"\s+", " ", text)[:240]
    return f"{type(error).__name__}: {text}"


def split_by(policies: list) -> str:
    """What splits the model: ``plugin``, ``tp plan``, ``structural``, or several joined by ``+``."""
    from tpcore.select import policy_origin
    from tpcore.select.auto import TP_PLAN_ORIGIN
    from tpcore.select.structural import STRUCTURAL_ORIGIN

    kinds = {TP_PLAN_ORIGIN: "tp plan", STRUCTURAL_ORIGIN: "structural"}
    return " + ".join(sorted({kinds.get(policy_origin(p), "plugin") for p in policies}))


def check_one(model_type: str, config_class, pools, world_size: int) -> dict:
    """One model type's row: ``step`` (see :data:`STEPS`), ``by``, ``share``, ``reason``."""
    import torch

    from tpcore.plan import plan_for
    from tpcore.select import choose_policies
    from tpcore.testing import ModelSpec, check_equivalence
    from tpcore.testing.samples import sample_inputs, small_config

    row = {"type": model_type, "model": "", "step": "not built", "by": "", "share": None, "reason": ""}
    model_class = model_class_for(model_type, MAPPINGS)
    if model_class is None:
        row["reason"] = "no model class in transformers' auto mappings (a sub-model's config)"
        return row
    row["model"] = model_class.__name__
    try:
        spec = ModelSpec(model_class, small_config(config_class(), (world_size,)), seed=0)
        model = spec.build().eval()
    except Exception as error:
        row["reason"] = f"not built tiny: {first_line(error)}"
        return row
    row["step"] = "not run"
    try:
        inputs = sample_inputs(model)
        with torch.inference_mode():
            model(**inputs)
    except Exception as error:
        row["reason"] = f"unsplit: {first_line(error)}"
        return row
    row["step"] = "refused"
    try:
        policies = choose_policies(model)
        row["by"] = split_by(policies)
        plan = plan_for(model, policies, world_size)
    except Exception as error:
        row["reason"] = first_line(error).split("\n")[0]
        return row
    row["share"] = max(plan.bytes_per_rank(rank) for rank in range(world_size)) / max(plan.whole_bytes, 1)
    row["step"] = "differs"
    try:
        diffs = check_equivalence(spec, inputs, world_sizes=(world_size,), pools=pools)
    except Exception as error:
        row["reason"] = f"split: {first_line(error)}"
        return row
    row["step"], row["reason"] = "equal", f"largest difference {max(diffs[world_size].values(), default=0.0):.1e}"
    return row


def cause(row: dict) -> str:
    """The reason of a row, without its model-specific details: what the totals group by."""
    reason = re.sub(r"(?<![A-Za-z])'[^']*'|\"[^\"]*\"|\([^)]*\)|\d+", "_", row["reason"])
    reason = re.sub(r"\b[A-Z][a-z0-9]+[A-Z]\w*", "<class>", reason)  # CamelCase: a model's own class names
    return f"{row['step']}: {reason[:90]}"


def main() -> None:
    parser = arguments(__doc__, "coverage", f"only {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="*", help="model types to check (default: every one)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--again",
        nargs="+",
        metavar="RESULT",
        help="check again the model types an earlier run's coverage.json gives one of these results "
        "(refused, differs, ...), and rewrite the result with their new rows",
    )
    args = parse(parser)
    if args.quick and not args.only:
        args.only = list(QUICK)
    earlier = []
    if args.again:
        earlier = json.loads(result_path("coverage", args.output, ".json").read_text())
        args.only = [row["type"] for row in earlier if row["step"] in args.again]

    quiet()
    types = registered_model_types()
    if args.only is not None:
        types = {name: types[name] for name in args.only if name in types}
    rows, seconds, _ = check_each(
        types,
        lambda model_type, config_class, pools: check_one(model_type, config_class, pools, args.world_size),
        lambda row: f"{row['step']:<10} {row['by']:<12} {row['type']:<32} {row['reason']}",
        stderr=True,
    )
    if earlier:
        again = {row["type"]: row for row in rows}
        rows = [again.get(row["type"], row) for row in earlier]
    write(rows, seconds, args)


def write(rows: list[dict], seconds: float, args) -> None:
    counts = collections.Counter(row["step"] for row in rows)
    ran = sum(counts[step] for step in ("equal", "differs", "refused"))
    equal = counts["equal"]
    by = collections.Counter(row["by"] for row in rows if row["step"] == "equal")
    summary = (
        f"{len(rows)} model types: {ran} build and run unsplit tiny, of which {equal} "
        f"({100 * equal / max(ran, 1):.0f}%) split equal at {args.world_size} ranks "
        f"({', '.join(f'{n} by {k}' for k, n in by.most_common())}); "
        + ", ".join(f"{counts[step]} {step}" for step in STEPS[1:])
        + (f" ({len(args.only)} checked again: {seconds:.0f} s)." if args.again and args.only else "")
        + ("" if args.again else f" ({seconds:.0f} s).")
    )
    causes = collections.Counter(cause(row) for row in rows if row["step"] != "equal")
    top = markdown_table(["count", "cause"], [[str(n), c.replace("|", "/")] for c, n in causes.most_common(12)])
    table = markdown_table(
        ["model type", "class", "result", "split by", "rank share", "why / largest difference"],
        [
            [
                r["type"],
                r["model"],
                r["step"],
                r["by"],
                f"{r['share']:.2f}" if r["share"] is not None else "",
                r["reason"].replace("|", "/"),
            ]
            for r in sorted(rows, key=lambda r: (STEPS.index(r["step"]), r["type"]))
        ],
    )
    print("\n" + summary)
    json_path = result_path("coverage", args.output, ".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(rows, indent=1) + "\n")
    legend = (
        "Rank share: the largest share of the model's bytes one rank holds (0.5 is an even split of everything; "
        "embeddings, norms and what no policy splits stay whole). The largest remaining causes, grouped:"
    )
    write_result(
        "coverage",
        "Every transformers model type, tiny, split at 2 ranks",
        [summary, legend, top, table],
        "gloo",
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
