"""The ``tpcore`` console script: ``tpcore plugins``, ``tpcore check``, ``tpcore serve``.

Parsing imports nothing heavy (``tpcore --help`` and ``tpcore --version`` answer at once); each
subcommand imports what it needs (torch, transformers, the plugins) when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tpcore.version import __version__


def _plugins(args: argparse.Namespace) -> int:
    """Every installed plugin with its version and the policies and quantized formats it registers (or why it
    failed to load)."""
    if args.model:
        return _applying(args)
    from tpcore.select.plugins import plugin_infos, registered_policies

    entries = registered_policies()
    rows = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "policies": [
                {"name": e.policy.policy_name(), "layer_class": e.policy.layer_class_name()}
                for e in entries
                if e.plugin == info.name
            ],
            "quantized_formats": list(info.formats),
            "error": info.error,
        }
        for info in plugin_infos()
    ]
    if args.json:
        return _print_json(rows)
    if not rows:
        print("No tpcore plugins installed (pip install tp-bert, tp-gpt, tp-t5, tp-bart, ...).")
    for row in rows:
        status = f"  FAILED: {row['error']}" if row["error"] else ""
        print(f"{row['distribution']} {row['version']} (entry point {row['name']!r}){status}")
        for policy in row["policies"]:
            print(f"    {policy['name']:<24} {policy['layer_class']}")
        for quant_method in row["quantized_formats"]:
            print(f"    quantized format {quant_method!r}")
    return 0


def _applying(args: argparse.Namespace) -> int:
    """Which policies apply to one model, where each comes from (a plugin and its version, or the tp plan), for
    a composite model which sub-models they split and which stay whole (and why), and the split over
    ``--world-size`` ranks with the backend and devices ``parallelize(num_gpus=N)`` would use here: every
    tensor's cut, bytes per rank against the whole, and what stays whole when much does."""
    from tpcore.errors import ShardingError, UnsupportedModelError
    from tpcore.plan import as_json, plan_for, replicated_warning, report
    from tpcore.select import choose_policies
    from tpcore.testing.samples import UnshrinkableConfig

    try:
        model = _model_to_show(args.model)
    except UnshrinkableConfig as error:
        print(f"{error} (a class name is built from its default config shrunk; pass a saved directory instead)")
        return 2
    except ShardingError as error:  # a quantized format tpcore does not split
        print(error)
        return 2
    try:
        policies = choose_policies(model)
    except UnsupportedModelError as error:
        print(error)
        return 2
    shown = _applying_rows(model, policies, args.world_size)
    try:
        plan, problem = plan_for(model, policies, args.world_size), None
    except ShardingError as error:
        plan, problem = None, str(error)
    if args.json:
        _print_json({**shown, "plan": as_json(plan) if plan is not None else {"error": problem}})
        return 0 if plan is not None else 2
    _print_applying(shown)
    if plan is None:
        print(problem)
        return 2
    print(report(plan))
    warning = replicated_warning(plan)
    if warning is not None:
        print(warning)
    return 0


def _model_to_show(name: str) -> Any:
    """A saved directory's model with its weights on meta, as its files store them (quantized ones too), or a
    class name's model built small (:func:`tpcore.tools.check.resolve`)."""
    from tpcore.tools.check import resolve

    spec = resolve(name)
    if os.path.isdir(name):
        from tpcore.load.checkpoint import Checkpoint
        from tpcore.load.quantized_formats import checkpoint_skeleton
        from tpcore.select.plugins import quantized_formats

        checkpoint = Checkpoint(name)
        return checkpoint_skeleton(checkpoint, checkpoint.config(), spec.model_class, quantized_formats())
    return spec.build()


def _applying_rows(model: Any, policies: list, world_size: int) -> dict[str, Any]:
    """The model, its policies and where each comes from, its sub-models, and the placement of ``world_size``
    ranks here, as :func:`_applying` prints them (and as its JSON)."""
    from tpcore.ranks.distributed import default_backend, device_for
    from tpcore.select import policy_origin, sub_model_coverage

    backend = default_backend(world_size)
    parts = sub_model_coverage(model, policies)[1:]  # the model's own sub-models, if it is composite
    return {
        "model": type(model).__name__,
        "policies": [
            {"policy": p.policy_name(), "layer_class": p.layer_class_name(), "from": policy_origin(p)} for p in policies
        ],
        "sub_models": [
            {
                "name": part.name,
                "class": part.module_class,
                "policies": [p.policy_name() for p in part.policies],
                "whole": part.whole,
            }
            for part in parts
        ],
        "world_size": world_size,
        "backend": backend,
        "devices": [str(device_for(backend, rank)) for rank in range(world_size)],
    }


def _print_applying(shown: dict[str, Any]) -> None:
    from tpcore.ranks.process import ranks_text

    world_size = shown["world_size"]
    placement = ranks_text(world_size, shown["backend"], shown["devices"])
    print(f"{shown['model']} over {placement} (what parallelize(num_gpus={world_size}) uses here):")
    for row in shown["policies"]:
        print(f"    {row['policy']:<24} {row['layer_class']}  (from {row['from']})")
    if shown["sub_models"]:
        print("  sub-models:")
    for row in shown["sub_models"]:
        status = f"stays whole: {row['whole']}" if row["whole"] else "split by " + ", ".join(row["policies"])
        print(f"    {row['name']:<24} {row['class']}  {status}")


def _print_json(value: Any) -> int:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _check(args: argparse.Namespace) -> int:
    from tpcore.tools.check import run_check  # imports torch and transformers

    return run_check(args.model, args.world_sizes)


def _serve(args: argparse.Namespace) -> int:
    from tpcore.serve import Limits, serve  # imports torch, transformers, FastAPI and uvicorn
    from tpcore.serve.server import NotServable, RanksLost

    limits = Limits(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout=args.timeout,
        max_model_len=args.max_model_len,
        fetch_images=args.allow_image_urls,
        max_audio_seconds=args.max_audio_seconds,
    )
    try:
        serve(args.model, args.num_gpus, args.host, args.port, api_key=args.api_key, name=args.name, limits=limits,
              compile=args.compile, restart=not args.no_restart, exit_on_loss=args.exit_on_loss)  # fmt: skip
    except NotServable as refusal:
        print(f"tpcore serve: {refusal}", file=sys.stderr)
        return 2
    except RanksLost as lost:
        reason = (str(lost).splitlines() or ["no reason given"])[0]
        print(f"tpcore serve: the ranks were lost ({reason}): exiting for a supervisor to start it again",
              file=sys.stderr)  # fmt: skip
        return 3
    return 0


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve a model split over N ranks behind an OpenAI-compatible HTTP API")
    serve.add_argument("model", help="a saved model directory (its tokenizer beside it)")
    serve.add_argument("--num-gpus", type=int, default=2, metavar="N", help="ranks to split over; 0 serves it whole")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $TPCORE_API_KEY)")
    serve.add_argument("--name", help="the model's name in the API (default: the directory's name)")
    serve.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429")
    serve.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take before 504")
    serve.add_argument("--max-model-len", type=int, help="tokens of prompt and completion (default: the config's)")
    serve.add_argument(
        "--max-audio-seconds", type=float, default=600.0, help="the longest audio a transcription takes (default 600)"
    )
    serve.add_argument(
        "--compile", action="store_true", help="compile the ranks' decode step at load (minutes; faster decode)"
    )
    serve.add_argument(
        "--no-restart",
        action="store_true",
        help="a lost rank leaves the server answering 503 (/health too) for a supervisor to restart it, instead of "
        "starting the ranks again",
    )
    serve.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs of chat messages (by default only data: URLs are read)",
    )
    serve.add_argument(
        "--exit-on-loss",
        action="store_true",
        help="a lost rank: answer the requests in flight 503, stop the ranks and exit with status 3, for a "
        "supervisor (systemd, Kubernetes) to start the server again",
    )
    serve.set_defaults(run=_serve)


def parser() -> argparse.ArgumentParser:
    """The ``tpcore`` command line."""
    tpcore_parser = argparse.ArgumentParser(
        prog="tpcore", description="Tensor-parallel inference for transformers models."
    )
    tpcore_parser.add_argument("--version", action="version", version=f"tpcore {__version__}")
    commands = tpcore_parser.add_subparsers(dest="command", required=True)
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
    check.set_defaults(run=_check)
    _add_serve(commands)
    return tpcore_parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
