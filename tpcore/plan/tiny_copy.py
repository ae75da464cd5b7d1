"""A tiny copy of a model (:func:`tiny_config`: the same head counts, every width small), on which the trial
(:mod:`tpcore.plan.trial`) and the proof (:mod:`tpcore.plan.proof`) run a split where a policy asks for it.

:func:`outcome` is what the two share: it builds the model's class from the tiny config with the caller's random
state kept, runs it unsplit on :func:`tiny_inputs`, plans it as the model is planned, hands it to the check on one
torch thread, and caches what the check found per (check, model class, config, policies, world size, what else
the plan depends on).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from tpcore.errors import ShardingError
from tpcore.parallel.layers import GROUPED_MM_FEATURES
from tpcore.plan.apply import apply_plan
from tpcore.plan.shard_plan import ShardPlan

__all__ = ["Outcome", "TinyCopy", "first_line", "is_config", "outcome", "refusal", "tiny_config", "tiny_inputs"]

logger = logging.getLogger("tpcore.plan")

#: the per-head widths of the tiny copy (even: rotary halves), and the widths derived from them
HEAD_WIDTH = 8
_HEAD_WIDTHS = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "d_kv", "d_head", "kv_channels")
_HIDDEN = ("hidden_size", "d_model", "n_embd")
_INTERMEDIATE = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "n_inner",
)
#: fields of a small fixed value, where the config has them as ints
_SMALL = {"q_lora_rank": 16, "kv_lora_rank": 16, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
_SMALL |= dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 4)
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "encoder_layers", "decoder_layers")
#: the most layers of the tiny copy (a MoE stack's first dense layers, then the others)
MAX_LAYERS = 4
VOCAB = 64
#: fields a config computes from the others (recomputed when it is rebuilt)
_DERIVED = {"layer_types", "transformers_version", "model_type", "architectures", "qk_head_dim"}
#: the token ids the tiny copy runs on
_IDS = torch.tensor([[5, 9, 13, 17, 21], [6, 10, 14, 18, 22]])

#: config fields of the token that stands for image features in the text (vision-language models)
_IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")


class Outcome(NamedTuple):
    """What a check found: what failed (``None``: nothing), and the largest difference from the unsplit outputs."""

    failure: str | None = None
    difference: float = 0.0


@dataclass(frozen=True)
class TinyCopy:
    """The tiny copy of a model, unsplit, with its plan, the inputs it runs on and its outputs on them."""

    model: nn.Module
    plan: ShardPlan
    inputs: dict[str, torch.Tensor]
    outputs: Any

    def shard(self, rank: int, tp_group: Any = None) -> nn.Module:
        """A copy of the tiny model made rank ``rank``'s shard; no ``tp_group``: its collectives are no-ops."""
        return apply_plan(self.plan, copy.deepcopy(self.model), rank, tp_group)


_outcomes: dict[tuple, Outcome] = {}


def outcome(
    check: Callable[[TinyCopy], Outcome],
    model: nn.Module,
    policies: list[Any],
    world_size: int,
    plan_tiny: Callable[[nn.Module], ShardPlan],
    key: Any,
    *,
    unmade_refuses: bool,
) -> Outcome:
    """What ``check`` finds on the tiny copy of ``model``, split as ``plan_tiny`` plans it. A tiny copy that cannot
    be built, run unsplit or planned is a failure where ``unmade_refuses``, else nothing is found. ``key``: what
    else ``plan_tiny`` depends on (cached with it)."""
    config: Any = getattr(model, "config", None)
    try:
        cache_key: tuple | None = (check, type(model), tuple(policies), world_size, key, config.to_json_string())
    except (AttributeError, TypeError, ValueError):  # no config, or a config value JSON does not take
        cache_key = None
    if cache_key is not None and cache_key in _outcomes:
        return _outcomes[cache_key]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is many times faster on a busy machine
    try:
        found = _made_and_checked(check, model, world_size, plan_tiny, unmade_refuses)
    finally:
        torch.set_num_threads(threads)
    if cache_key is not None:
        _outcomes[cache_key] = found
    return found


def _made_and_checked(
    check: Callable[[TinyCopy], Outcome],
    model: nn.Module,
    world_size: int,
    plan_tiny: Callable[[nn.Module], ShardPlan],
    unmade_refuses: bool,
) -> Outcome:
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            torch.manual_seed(0)
            tiny = type(model)(tiny_config(model.config, world_size)).eval()
        inputs = tiny_inputs(tiny)
        with torch.inference_mode():
            outputs = tiny(**inputs)
        plan = plan_tiny(tiny)
    except Exception as error:
        if unmade_refuses:
            return Outcome(f"the tiny copy cannot be made or run unsplit ({first_line(error)})")
        logger.debug("no trial run of %s over %d ranks: %s: %s", type(model).__name__, world_size, type(error), error)
        return Outcome()
    return check(TinyCopy(tiny, plan, inputs, outputs))


def refusal(model: nn.Module, world_size: int, why: str) -> ShardingError:
    """The error of a check that failed: ``cannot split <the model's class> over <N> ranks<why>``."""
    return ShardingError(f"cannot split {type(model).__name__} over {world_size} ranks{why}")


def first_line(error: BaseException) -> str:
    """``<type>: <the first line of its message>``."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def tiny_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Two rows of five token ids (and a mask, decoder ids) for what ``model.forward`` accepts; for an image
    encoder (``pixel_values`` and no ``input_ids``), two random images at its (vision) config's size; for a
    model of both that places no image tokens in the text (CLIP-like two towers), both."""
    accepted = set(inspect.signature(model.forward).parameters)
    if "pixel_values" in accepted and "input_ids" not in accepted:
        return {"pixel_values": _images(model.config)}
    inputs = {"input_ids": _IDS.clone()}
    if "attention_mask" in accepted:
        inputs["attention_mask"] = torch.ones_like(_IDS)
    if "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = _IDS[:, :3].clone()
    if "pixel_values" in accepted and not any(hasattr(model.config, name) for name in _IMAGE_TOKEN_FIELDS):
        inputs["pixel_values"] = _images(model.config)
    return inputs


def _images(config: Any) -> torch.Tensor:
    """``(2, channels, H, W)`` seeded random pixels at ``image_size`` (an int or a pair; 224 if unset)."""
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    channels = getattr(vision, "num_channels", 3)
    return torch.randn(2, channels, height, width, generator=torch.Generator().manual_seed(0))


def tiny_config(config: Any, world_size: int) -> Any:
    """``config`` rebuilt tiny, its sub-configs alike: the same head counts, heads of :data:`HEAD_WIDTH`
    features, at most :data:`MAX_LAYERS` layers and 4 experts, small intermediate sizes (the same remainder
    modulo ``8 * world_size`` as the original's, so each rank's share is alike a multiple of 8 features or
    not: what the grouped-mm experts kernels need), a vocabulary of :data:`VOCAB` with the special ids moved
    into it."""
    values = {key: value for key, value in config.to_dict().items() if key not in _DERIVED}
    heads = values.get("num_attention_heads")
    for name in _sub_config_names(config):
        values[name] = tiny_config(getattr(config, name), world_size)
    _set_ints(values, _HEAD_WIDTHS, lambda _: HEAD_WIDTH)
    if isinstance(heads, int):
        _set_ints(values, _HIDDEN, lambda _: heads * HEAD_WIDTH)
    modulus = GROUPED_MM_FEATURES * world_size
    _set_ints(values, _INTERMEDIATE, lambda size: min(size, 2 * modulus + size % modulus))
    _set_ints(values, _LAYERS, lambda layers: min(layers, MAX_LAYERS))
    for name, small in _SMALL.items():
        _set_ints(values, (name,), functools.partial(min, small))
    _set_ints(values, ("vocab_size",), lambda size: min(size, VOCAB))
    _move_special_ids(values)
    return type(config)(**values)


def _set_ints(values: dict[str, Any], names: tuple[str, ...], small: Callable[[int], int]) -> None:
    for name in names:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            values[name] = small(value)


def _move_special_ids(values: dict[str, Any]) -> None:
    """Special ids (``*_token_id``) at or above the small vocabulary move to its top (equal ids stay equal)."""
    names = [n for n, v in values.items() if n.endswith("_token_id") and isinstance(v, int) and v >= VOCAB - 16]
    moved = {old: VOCAB - 1 - index for index, old in enumerate(sorted({values[n] for n in names}))}
    for name in names:
        values[name] = moved[values[name]]
    for name, value in values.items():  # eos lists
        if name.endswith("_token_id") and isinstance(value, list):
            values[name] = [v if v < VOCAB - 16 else VOCAB - 1 for v in value if isinstance(v, int)]


def is_config(value: Any) -> bool:
    """Whether ``value`` is a transformers config (``PreTrainedConfig``; ``PretrainedConfig`` before 5.x)."""
    import transformers

    return isinstance(value, getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig)


def _sub_config_names(config: Any) -> list[str]:
    names = getattr(config, "sub_configs", None) or {}
    return [name for name in names if is_config(getattr(config, name, None))]
