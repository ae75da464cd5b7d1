"""``tpcore check MODEL``: which policy applies to a model, and is its split equivalent?

MODEL is a saved model directory (its own weights are used) or a transformers class name, which
is built from its default config shrunk to two small layers with random weights, every
sub-config alike (:func:`tpcore.testing.samples.small_config`). The inputs follow what the model's
forward accepts: token ids, pixel values, audio features or waveforms, decoder ids
(:func:`tpcore.testing.samples.sample_inputs`). Everything that can be checked in this process (the
model builds, the inputs build, a policy applies, the sizes split) is, before a rank starts; a
rank's exception is reported as its own type. A model that cannot be checked at all (a config that cannot
be shrunk, a shrunk model that does not build or fails unsplit on its inputs) is told apart from a split
failure: exit code 2, and the step that failed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from tpcore.testing import EquivalenceError, ModelSpec, PoolCache, SavedModelSpec, check_equivalence
from tpcore.testing.samples import UnshrinkableConfig, sample_inputs, small_config


def resolve(model: str, world_sizes: Sequence[int] = (2,)) -> Any:
    """A spec every rank can build: a saved directory, or a transformers class with its config
    shrunk so that every world size in ``world_sizes`` divides its head counts."""
    import transformers

    if os.path.isdir(model):
        config = transformers.AutoConfig.from_pretrained(model)
        name = (config.architectures or [None])[0]
        model_class = getattr(transformers, name, None) if name else None
        return SavedModelSpec(model, model_class or transformers.AutoModel)
    model_class = getattr(transformers, model, None)
    if model_class is None or not hasattr(model_class, "config_class"):
        raise SystemExit(f"tpcore check: {model!r} is neither a saved model directory nor a transformers model class")
    return ModelSpec(model_class, small_config(model_class.config_class(), world_sizes), seed=0)


def _policy_origins(model, policies: list | None) -> dict:
    """``{policy: where it comes from}``: ``policies`` as given, else what AutoPolicy chooses for ``model``
    (the plugins', then those derived from its tp plan; raises ``UnsupportedModelError``)."""
    from tpcore.select import choose_policies, policy_origin

    chosen = choose_policies(model, policies)
    return {policy: "custom_policies" if policies else policy_origin(policy) for policy in chosen}


class NotCheckable(Exception):
    """Why a model cannot be checked at all, before any split: its config cannot be shrunk, it does not build,
    no policy applies, no inputs can be built, or it fails unsplit (exit code 2, not a split failure)."""


def prepare(model: str, world_sizes: Sequence[int], policies: list | None = None) -> tuple[Any, Any, dict, dict]:
    """``(spec, built model, {policy: origin}, inputs)``, the model proven to run unsplit on the inputs, or
    :class:`NotCheckable` saying which step failed."""
    from tpcore.errors import UnsupportedModelError

    try:
        spec = resolve(model, world_sizes)
    except UnshrinkableConfig as error:
        raise NotCheckable(f"config: {error} (nothing was split)") from error
    try:
        built = spec.build()
    except Exception as error:
        raise NotCheckable(f"unsplit model: does not build from its config: {_first_line(error)}") from error
    print(f"model: {type(built).__name__} ({sum(p.numel() for p in built.parameters()):,} parameters)")
    try:
        origins = _policy_origins(built, policies)
    except UnsupportedModelError as error:
        raise NotCheckable(str(error)) from error
    for policy, origin in origins.items():
        print(f"  policy {policy.policy_name()} from {origin}")
    try:
        inputs = sample_inputs(built)
    except ValueError as error:
        raise NotCheckable(f"inputs: {error}") from error
    print("  inputs: " + ", ".join(f"{name} {tuple(value.shape)}" for name, value in inputs.items()))
    try:
        with torch.inference_mode():
            built.eval()(**inputs)
    except Exception as error:
        raise NotCheckable(
            f"unsplit model: fails on its own inputs before any split (its config, not the split): {_first_line(error)}"
        ) from error
    return spec, built, origins, inputs


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def run_check(
    model: str, world_sizes: Sequence[int], policies: list | None = None, pools: PoolCache | None = None
) -> int:
    """Print the report; return the process exit code (0: every world size equivalent, 1: some
    world size refused or not equivalent, 2: the model cannot be checked: its config cannot be shrunk,
    it does not build or fails unsplit, no policy applies or no inputs can be built).

    ``policies`` replaces the installed ones (``custom_policies``); ``pools`` are rank pools to
    reuse (a fresh :class:`PoolCache`, closed at the end, by default)."""
    try:
        spec, built, origins, inputs = prepare(model, world_sizes, policies)
    except NotCheckable as error:
        print(error)
        print("FAIL")
        return 2
    own_pools = pools is None
    pools = pools or PoolCache()
    try:
        failed = [not _check_world(spec, built, origins, inputs, n, policies, pools) for n in world_sizes]
    finally:
        if own_pools:
            pools.close()
    print("FAIL" if any(failed) else "PASS")
    return 1 if any(failed) else 0


def _check_world(spec, built, origins: dict, inputs: dict, world_size: int, policies, pools: PoolCache) -> bool:
    """Print one world size's line; whether its split is equivalent."""
    from tpcore.errors import ShardingError
    from tpcore.plan import plan_for

    try:
        plan_for(built, list(origins), world_size)  # before any rank starts
    except ShardingError as error:
        print(f"  {world_size} ranks: REFUSED {error}")
        return False
    try:
        diffs = check_equivalence(spec, inputs, world_sizes=(world_size,), policies=policies, pools=pools)
    except EquivalenceError as error:
        print(f"  {world_size} ranks: FAIL {error}")
        return False
    except Exception as error:  # a rank's own exception (check_equivalence re-raises it as its type)
        print(f"  {world_size} ranks: ERROR {_first_line(error)}")
        return False
    worst = max(diffs[world_size].items(), key=lambda item: item[1])
    print(f"  {world_size} ranks: PASS (largest difference {worst[1]:.2e} in {worst[0]})")
    return True
