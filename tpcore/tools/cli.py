"""The ``tpcore`` console script."""

from __future__ import annotations

import argparse
import json
import sys

from tpcore.select.plugins import plugin_infos, registered_policies


def _plugins(args: argparse.Namespace) -> int:
    if args.model:
        return _applying(args)
    infos = plugin_infos()
    entries = registered_policies()
    rows = []
    for info in infos:
        policies = [
            {"name": e.policy.policy_name(), "layer_class": e.policy.layer_class_name()}
            for e in entries
            if e.plugin == info.name
        ]
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "policies": policies,
                "error": info.error,
            }
        )
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not rows:
        print("No tpcore plugins installed (pip install tp-bert, tp-gpt, tp-t5, tp-bart, ...).")
    for row in rows:
        status = f"  FAILED: {row['error']}" if row["error"] else ""
        print(f"{row['distribution']} {row['version']} (entry point {row['name']!r}){status}")
        for policy in row["policies"]:
            print(f"    {policy['name']:<24} {policy['layer_class']}")
    return 0


def _applying(args: argparse.Namespace) -> int:
    """Which policies apply to one model, where each comes from (a plugin and its version, or the tp plan), for
    a composite model which sub-models they split and which stay whole (and why), and the split over
    ``--world-size`` ranks with the backend and devices ``parallelize(num_gpus=N)`` would use here: every
    tensor's cut, bytes per rank against the whole, and what stays whole when much does."""
    from tpcore.errors import ShardingError, UnsupportedModelError
    from tpcore.plan import plan_for, replicated_warning, report
    from tpcore.ranks.distributed import default_backend, device_for
    from tpcore.ranks.process import ranks_text
    from tpcore.select import choose_policies, policy_origin, sub_model_coverage
    from tpcore.tools.check import resolve

    model = resolve(args.model).build()
    try:
        policies = choose_policies(model)
    except UnsupportedModelError as error:
        print(error)
        return 2
    rows = [
        {"policy": p.policy_name(), "layer_class": p.layer_class_name(), "from": policy_origin(p)} for p in policies
    ]
    backend = default_backend(args.world_size)
    devices = [str(device_for(backend, rank)) for rank in range(args.world_size)]
    parts = sub_model_coverage(model, policies)[1:]  # the model's own sub-models, if it is composite
    sub_rows = [
        {
            "name": part.name,
            "class": part.module_class,
            "policies": [p.policy_name() for p in part.policies],
            "whole": part.whole,
        }
        for part in parts
    ]
    try:
        plan = plan_for(model, policies, args.world_size)
    except ShardingError as error:
        plan, problem = None, str(error)
    if args.json:
        shown = {
            "model": type(model).__name__,
            "policies": rows,
            "sub_models": sub_rows,
            "world_size": args.world_size,
            "backend": backend,
            "devices": devices,
        }
        shown["plan"] = plan_json(plan) if plan is not None else {"error": problem}
        json.dump(shown, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if plan is not None else 2
    placement = ranks_text(args.world_size, backend, devices)
    print(f"{type(model).__name__} over {placement} (what parallelize(num_gpus={args.world_size}) uses here):")
    for row in rows:
        print(f"    {row['policy']:<24} {row['layer_class']}  (from {row['from']})")
    if sub_rows:
        print("  sub-models:")
    for row in sub_rows:
        status = f"stays whole: {row['whole']}" if row["whole"] else "split by " + ", ".join(row["policies"])
        print(f"    {row['name']:<24} {row['class']}  {status}")
    if plan is None:
        print(problem)
        return 2
    print(report(plan))
    warning = replicated_warning(plan)
    if warning is not None:
        print(warning)
    return 0


def plan_json(plan) -> dict:
    """A plan as JSON: every tensor's whole shape, each rank's shape and how it is cut (and why a replicated one
    stays whole), the attributes whose values differ by rank (a list, one per rank), each rank's bytes, the
    whole model's and those replicated on every rank."""
    from tpcore.cut.shares import PerRank
    from tpcore.plan import describe

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


def _check(args: argparse.Namespace) -> int:
    from tpcore.tools.check import run_check  # imports torch and transformers

    return run_check(args.model, args.world_sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpcore", description="Tensor-parallel inference for transformers models.")
    commands = parser.add_subparsers(dest="command", required=True)
    plugins = commands.add_parser("plugins", help="list installed plugins and the policies each registers")
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.add_argument("--model", help="show only the policies that apply to this model (directory or class name)")
    plugins.add_argument(
        "--world-size", type=int, default=2, metavar="N", help="with --model: show the model's shard plan over N ranks"
    )
    plugins.set_defaults(run=_plugins)
    check = commands.add_parser("check", help="split a model over gloo ranks and compare it with the unsplit model")
    check.add_argument("model", help="a saved model directory, or a transformers class name (small random config)")
    check.add_argument("--world-sizes", type=int, nargs="+", default=[2], metavar="N", help="rank counts to try")
    check.set_defaults(run=lambda args: _check(args))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
