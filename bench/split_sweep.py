"""Every (model type, world size) the plugins and the tp-plan fallback claim: equal, or refused up front?

The promise of ``tpcore.parallelize(model, num_gpus=N)``: what cannot be split is refused before any rank
starts, naming the tensor. This sweep looks for the pairs that break it. For every model type an installed
plugin's policy or a config's ``base_model_tp_plan`` claims (:func:`claimed_model_types`), it builds the
causal LM (else the base model) from the default config shrunk to two small layers
(:func:`tpcore.testing.samples.small_config`: 4 heads, so 3 ranks deal them unevenly), and for every world
size from 2 to ``min(heads, 5)`` does what ``parallelize()`` does before a rank starts (``choose_policies``,
``plan_for``), then, where that accepts, runs the split on warm gloo ranks against the unsplit model
(:func:`tpcore.testing.check_equivalence`, fp32). Each pair is one of:

- ``equal``: accepted, and every rank's outputs equal the unsplit model's;
- ``refused up front``: ``plan_for`` (or the policy choice) refused it, before any rank started;
- ``accepted then failed``: accepted, and then a rank raised (what must never happen);
- ``accepted, not equal``: accepted, ran, and differs from the unsplit model;
- ``unsplit does not run`` / ``cannot build``: the tiny model itself (no pair is tested).

Writes ``bench/results/split_sweep.md`` and ``split_sweep.json``.

    python bench/split_sweep.py                       # every claimed model type (tens of minutes on 2 cores)
    python bench/split_sweep.py --only deepseek_v2 llama --budget 600
"""

from __future__ import annotations

import contextlib
import json
import time

from _common import arguments, first_line, markdown_table, parse, result_path, write_result
from _model_types import check_each, model_class_for, planned_model_types, quiet

QUICK = ("llama", "deepseek_v2", "bert")
MAX_WORLD_SIZE = 5
OUTCOMES = (
    "equal",
    "refused up front",
    "accepted then failed",
    "accepted, not equal",
    "unsplit does not run",
    "cannot build",
)


def claimed_model_types() -> dict[str, type]:
    """``{model_type: config class}``: the types whose modeling module holds a layer class an installed plugin's
    policy names, and those whose config (or a sub-config) carries a tp plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name

    from tpcore.select.plugins import registered_policies

    modules = {entry.policy.layer_class_name().split(".")[2] for entry in registered_policies()}
    found = dict(planned_model_types())
    for model_type in CONFIG_MAPPING.keys():
        if model_type not in found and model_type_to_module_name(model_type) in modules:
            with contextlib.suppress(Exception):  # a config module that does not import here
                found[model_type] = CONFIG_MAPPING[model_type]
    return dict(sorted(found.items()))


def head_count(config) -> int:
    """The fewest attention heads among ``config`` and its sub-configs (4 when none says)."""
    from tpcore.testing.samples import _configs

    counts = [
        value
        for each in _configs(config)
        for name in ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads", "n_head")
        if isinstance(value := getattr(each, name, None), int) and value > 0
    ]
    return min(counts, default=4)


def sweep_one(model_type: str, config_class, pools, world_sizes=None) -> list[dict]:
    """One row per world size (by default 2 to ``min(heads, 5)``; of ``world_sizes`` those up to the heads),
    or one row saying why the model type was not tried."""
    import torch

    from tpcore.testing import ModelSpec
    from tpcore.testing.samples import sample_inputs, small_config

    row = {"type": model_type, "model": "", "world_size": None, "outcome": "cannot build", "detail": ""}
    model_class = model_class_for(model_type)
    if model_class is None:
        return [row | {"detail": "no causal-LM or base model class in transformers' auto mappings"}]
    row["model"] = model_class.__name__
    try:
        config = small_config(config_class(), (2,))
        if hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
        spec = ModelSpec(model_class, config, seed=0)
        model = spec.build()
        inputs = sample_inputs(model)
    except Exception as error:
        return [row | {"detail": first_line(error)}]
    try:
        with torch.inference_mode():
            model(**inputs)
    except Exception as error:
        return [row | {"outcome": "unsplit does not run", "detail": first_line(error)}]
    sizes = range(2, MAX_WORLD_SIZE + 1) if world_sizes is None else world_sizes
    return [
        row | sweep_pair(spec, model, inputs, world_size, pools)
        for world_size in sizes
        if world_size <= head_count(config)
    ]


def sweep_pair(spec, model, inputs, world_size: int, pools) -> dict:
    """What ``parallelize(model, num_gpus=world_size)`` checks before a rank starts, then the ranks' run."""
    from tpcore.errors import ShardingError, UnsupportedModelError
    from tpcore.plan import plan_for
    from tpcore.select import choose_policies
    from tpcore.testing import EquivalenceError, check_equivalence

    result = {"world_size": world_size}
    started = time.perf_counter()
    try:
        policies = choose_policies(model, None)
        plan_for(model, policies, world_size)
    except (ShardingError, UnsupportedModelError) as error:
        return result | {"outcome": "refused up front", "detail": first_line(error, 400)}
    checked = time.perf_counter()
    try:
        diffs = check_equivalence(spec, inputs, (world_size,), pools=pools)
    except EquivalenceError as error:
        return result | {"outcome": "accepted, not equal", "detail": first_line(error, 400)}
    except Exception as error:
        return result | {"outcome": "accepted then failed", "detail": first_line(error, 400)}
    worst = max(diffs[world_size].values(), default=0.0)
    ran = time.perf_counter()
    detail = f"largest difference {worst:.1e}; plan {checked - started:.2f} s, ranks {ran - checked:.2f} s"
    return result | {"outcome": "equal", "detail": detail}


def main() -> None:
    parser = arguments(__doc__, "split_sweep", f"only {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="*", help="model types to sweep (default: every claimed one)")
    parser.add_argument("--budget", type=float, default=None, help="seconds after which no new model type starts")
    args = parse(parser)
    if args.quick and not args.only:
        args.only = list(QUICK)

    import logging

    quiet()
    logging.getLogger("tpcore").setLevel(logging.ERROR)  # the ranks log at the caller's level: no plan warnings
    types = claimed_model_types()
    if args.only:
        types = {name: types[name] for name in args.only if name in types}
    rows, seconds, skipped = check_each(
        types,
        sweep_one,
        lambda row: f"{row['outcome']:<22} {row['type']:<28} {row['world_size'] or '-'}  {row['detail']}",
        budget=args.budget,
    )
    write_report(rows, skipped, len(types), seconds, args)


def write_report(rows: list[dict], skipped: list[str], claimed: int, seconds: float, args) -> None:
    """The totals, the table of every pair that is not plainly equal, and the JSON of every row."""
    pairs = [row for row in rows if row["world_size"] is not None]
    totals = {outcome: sum(row["outcome"] == outcome for row in pairs) for outcome in OUTCOMES[:4]}
    untried = {outcome: len({r["type"] for r in rows if r["outcome"] == outcome}) for outcome in OUTCOMES[4:]}
    swept = len({row["type"] for row in rows})
    summary = (
        f"{swept} of {claimed} claimed model types swept in {seconds:.0f} s"
        + (f" (the time budget left {len(skipped)} untried: {', '.join(skipped)})" if skipped else "")
        + f"; {len(pairs)} (model type, world size) pairs: "
        + ", ".join(f"{count} {outcome}" for outcome, count in totals.items())
        + "; model types not tried: "
        + ", ".join(f"{count} {outcome}" for outcome, count in untried.items())
        + "."
    )
    print("\n" + summary)
    by_type: dict[str, list[dict]] = {}
    for row in pairs:
        by_type.setdefault(row["type"], []).append(row)
    overview = markdown_table(
        ["model type", "class", *(f"N={n}" for n in range(2, MAX_WORLD_SIZE + 1))],
        [
            [name, found[0]["model"], *(_cell(found, n) for n in range(2, MAX_WORLD_SIZE + 1))]
            for name, found in by_type.items()
        ],
    )
    notable = [row for row in rows if row["outcome"] != "equal"]
    details = markdown_table(
        ["model type", "N", "outcome", "why"],
        [[r["type"], str(r["world_size"] or "-"), r["outcome"], r["detail"].replace("|", "/")] for r in notable],
    )
    legend = "Cells: `=` equal, `R` refused up front, `FAIL` accepted then failed, `DIFF` accepted, not equal."
    write_result(
        "split_sweep",
        "Every claimed (model type, world size): equal, or refused before any rank starts",
        [summary, legend, overview, "## Every pair that is not equal, and the model types not tried", details],
        "gloo",
        args.note,
        args.output,
    )
    path = result_path("split_sweep", args.output, ".json")
    path.write_text(json.dumps({"summary": summary, "skipped": skipped, "rows": rows}, indent=1) + "\n")


def _cell(rows: list[dict], world_size: int) -> str:
    marks = {"equal": "=", "refused up front": "R", "accepted then failed": "FAIL", "accepted, not equal": "DIFF"}
    return next((marks[r["outcome"]] for r in rows if r["world_size"] == world_size), "")


if __name__ == "__main__":
    main()
