"""The block most transformers share, said once: attentions split by heads, an MLP by features.

A :class:`BlockPolicy` applies to a block class (an encoder layer, a decoder layer, a ViT layer)
and names its :class:`Attention` s and its MLP; it derives the policy methods from them:

- each attention's query, key and value projections (or their packed ``qkv``) column parallel, its
  output projection row parallel, heads dealt whole (:func:`tpcore.share`: 6 heads over 4 ranks as
  2, 2, 1, 1), the attributes holding its head count and its width (``heads x head_dim``) set per
  rank, and the modules that reshape to their input's width given
  :func:`tpcore.parallel.reshapes.local_width_class`;
- the MLP's input projections column parallel, its output projections row parallel.

The block's heads are the config attribute ``heads`` and its head dim ``hidden_size // heads`` of
the config the policy is given (:meth:`tpcore.Policy.layer_config` gives a block its own, where
blocks of one class differ). Families subclass it in their plugins; here are only the shapes several
plugins share: an encoder-decoder's blocks (:class:`EncoderBlockPolicy`, :class:`DecoderBlockPolicy`)
and BERT's layout, which most encoders keep (:class:`BertLayoutPolicy`, :func:`bert_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from torch import nn

from tpcore.authoring.counts import share
from tpcore.authoring.layer import COLUMN, Layer
from tpcore.authoring.policy import IfHeld, Policy
from tpcore.parallel.reshapes import local_width_class

__all__ = [
    "Attention",
    "BertLayoutPolicy",
    "BlockPolicy",
    "DecoderBlockPolicy",
    "EncoderBlockPolicy",
    "bert_attention",
    "depthwise_conv",
    "keeping_local_attributes",
    "linear",
    "local_heads",
    "subclassing",
    "transformers_class",
]

_MODELS = "transformers.models"


def transformers_class(module: str, name: str, file: str | None = None) -> str:
    """The dotted path of the class ``name`` in ``transformers.models.<module>.modeling_<file>``
    (``file`` defaults to ``module``), for a policy's ``layer_class``."""
    return f"{_MODELS}.{module}.modeling_{file or module}.{name}"


class Attention(NamedTuple):
    """One attention of a block, by paths relative to the block."""

    path: str
    projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    output: str = "out_proj"
    #: attributes (relative to ``path``) holding the head count, and those holding heads x head_dim
    counts: tuple[str, ...] = ("num_heads",)
    widths: tuple[str, ...] = ()
    #: the module (relative to ``path``; "" for the attention) whose forward reshapes to its input's width
    reshaping: str | None = None
    #: some blocks of the class lack it (a decoder without cross-attention, a layout of another version)
    optional: bool = False
    #: how many tensors each projection packs (3: one ``qkv`` of ``[q | k | v]``)
    packed: int = 1
    #: the packed projection holds whole heads one after another, each its q, k and v (``[q0 k0 v0 | q1 ...]``)
    interleaved: bool = False
    #: projections by the same heads that some blocks of the class lack (relative position projections
    #: a config shares with the content ones, the projections of one attention kind or another)
    optional_projections: tuple[str, ...] = ()

    def at(self, *names: str) -> str:
        """The path of ``names`` (``""`` parts left out) from the block."""
        return ".".join(part for part in (self.path, *names) if part)


def linear(path: str, *, optional: bool = False, **layout) -> Layer:
    """The :class:`~tpcore.Layer` of the ``nn.Linear`` at ``path``: its weight and bias (a Linear
    without bias is fine)."""
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias", optional=optional, **layout)


def depthwise_conv(path: str, *, optional: bool = False, **layout) -> Layer:
    """The :class:`~tpcore.Layer` of a depthwise convolution at ``path`` (``groups == in_channels``, weight
    ``(channels * m, 1, *kernel)``) cut by channels as its input is: rank ``r`` keeps its channels' filters
    and biases (``COLUMN``: dim 0), and the module's ``in_channels``, ``out_channels`` and ``groups`` become
    the rank's channel count (``m``, the channel multiplier, kept). ``heads=`` the channel count cuts it in
    whole channels where ``m > 1``; the other layout words say what else the channels pack (Mamba2's
    ``[x | B | C]``)."""
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias", style=COLUMN, optional=optional, **layout)


def local_heads(config, world_size: int, name: str, groups: str | None = None, first: bool = False):
    """Each rank's share of the heads ``config.<name>`` (:func:`~tpcore.share`: an int, or per rank
    where they do not divide), query heads kept with their groups ``config.<groups>``; ``first``:
    each rank's first head instead."""
    count = getattr(config, name)
    return share(count, world_size, name, groups=getattr(config, groups) if groups else None, first=first)


class BlockPolicy(Policy):
    """A block: its :class:`Attention` s split by heads, its MLP by features."""

    #: the config attribute holding the block's head count
    heads: ClassVar[str] = "num_attention_heads"
    attentions: ClassVar[tuple[Attention, ...]] = (Attention("self_attn"),)
    mlp_inputs: ClassVar[tuple[str, ...]] = ("fc1",)
    mlp_outputs: ClassVar[tuple[str, ...]] = ("fc2",)

    @classmethod
    def replace_arguments(cls, config, world_size):
        if not cls.attentions:  # a feed-forward alone
            return {}
        total = getattr(config, cls.heads)
        heads = share(total, world_size, cls.heads)
        width = heads * (config.hidden_size // total)
        arguments = {}
        for attention in cls.attentions:
            values = dict.fromkeys(map(attention.at, attention.counts), heads)
            values |= dict.fromkeys(map(attention.at, attention.widths), width)
            if attention.reshaping is not None:  # tpcore.parallel.reshapes: the widths its reshapes go between
                values[attention.at(attention.reshaping, "full_width")] = config.hidden_size
                values[attention.at(attention.reshaping, "local_width")] = width
            held = attention.at(attention.projections[0])  # an optional attention is where its projections are
            for path, value in values.items():
                arguments[path] = IfHeld(value, held) if attention.optional else value
        return arguments

    @classmethod
    def replace_modules(cls):
        return {
            attention.at(attention.reshaping): local_width_class
            for attention in cls.attentions
            if attention.reshaping is not None
        }

    @classmethod
    def attn_qkv(cls):
        layers = []
        for attention in cls.attentions:
            packs = {"heads": cls.heads, "n_fused": attention.packed, "interleaved": attention.interleaved}
            layers += [
                linear(attention.at(name), optional=attention.optional, **packs) for name in attention.projections
            ]
            layers += [
                linear(attention.at(name), optional=True, heads=cls.heads) for name in attention.optional_projections
            ]
        return layers

    @classmethod
    def attn_out(cls):
        return [linear(a.at(a.output), optional=a.optional, heads=cls.heads) for a in cls.attentions]

    @classmethod
    def mlp_in(cls):
        return [linear(path) for path in cls.mlp_inputs]

    @classmethod
    def mlp_out(cls):
        return [linear(path) for path in cls.mlp_outputs]


class EncoderBlockPolicy(BlockPolicy):
    """An encoder block of an encoder-decoder model: self-attention of the encoder's heads
    (``encoder_attention_heads``)."""

    heads = "encoder_attention_heads"


class DecoderBlockPolicy(BlockPolicy):
    """A decoder block of an encoder-decoder model: self-attention and cross-attention
    (``encoder_attn``) of the decoder's heads (``decoder_attention_heads``)."""

    heads = "decoder_attention_heads"
    attentions = (Attention("self_attn"), Attention("encoder_attn"))


def bert_attention(
    path: str, projections: tuple[str, ...] = ("query", "key", "value"), *, inner: str = "self", **fields: Any
) -> Attention:
    """BERT's attention at ``path``: its ``inner`` module (``""``: the attention itself) holding the
    ``projections`` and the attributes ``num_attention_heads`` and ``all_head_size``, then
    ``output.dense``. ``fields``: other :class:`Attention` fields (``optional``, ``output``;
    ``optional_projections`` of ``inner``; ``counts``, ``widths`` by their paths from ``path``)."""

    def of_inner(*names: str) -> tuple[str, ...]:
        return tuple(f"{inner}.{name}" if inner else name for name in names)

    attention = Attention(
        path,
        projections=of_inner(*projections),
        output="output.dense",
        counts=of_inner("num_attention_heads"),
        widths=of_inner("all_head_size"),
    )
    optional = of_inner(*fields.pop("optional_projections", ()))
    return attention._replace(optional_projections=optional, **fields)


class BertLayoutPolicy(BlockPolicy):
    """A block of BERT's layout: ``attention`` (:func:`bert_attention`), a decoder's ``crossattention``
    of the same shape (where the config adds it), then ``intermediate.dense`` and ``output.dense``."""

    attentions: ClassVar[tuple[Attention, ...]] = (
        bert_attention("attention"),
        bert_attention("crossattention", optional=True),
    )
    mlp_inputs: ClassVar[tuple[str, ...]] = ("intermediate.dense",)
    mlp_outputs: ClassVar[tuple[str, ...]] = ("output.dense",)


def subclassing(prefix: str) -> Callable[[Callable[[type], dict[str, Any]]], Callable[[nn.Module | None], Any]]:
    """Decorator for a :meth:`~tpcore.Policy.replace_modules` class function: ``members(base)`` gives
    the methods (which may call ``base``'s) and per-rank attributes that a module of class ``base``
    gets; the decorated function takes the module (``None`` where the layer has none) and gives
    ``prefix + base.__name__``, a subclass of its class with those members, one per class, or ``None``."""

    def decorate(members: Callable[[type], dict[str, Any]]) -> Callable[[nn.Module | None], Any]:
        made: dict[type, type[nn.Module]] = {}

        @functools.wraps(members)
        def class_for(module: nn.Module | None) -> type[nn.Module] | None:
            if module is None:
                return None
            base = type(module)
            if base not in made:
                namespace = {"__module__": members.__module__, "__doc__": members.__doc__, **members(base)}
                made[base] = type(f"{prefix}{base.__name__}", (base,), namespace)
            return made[base]

        return class_for

    return decorate


def keeping_local_attributes(method: str, child: str, names: tuple[str, ...]) -> Callable[[nn.Module | None], Any]:
    """For :meth:`~tpcore.Policy.replace_modules`, where a module's ``method`` builds its ``child`` anew
    from the config (BigBird's ``set_attention_type``, switching between block-sparse and full
    attention, keeps the projections but reads the head count from the config): a class function
    giving the module a subclass whose ``method`` carries the child's per-rank ``names`` (head
    counts, widths) over to the new child."""

    @subclassing("Local")
    def keeping(base: type) -> dict[str, Any]:
        """A subclass whose ``method`` keeps the per-rank counts of its rebuilt ``child``
        (:func:`tpcore.authoring.blocks.keeping_local_attributes`)."""

        def rebuild(self, *args, **kwargs):
            local = {name: getattr(getattr(self, child), name) for name in names}
            result = getattr(base, method)(self, *args, **kwargs)
            for name, value in local.items():
                setattr(getattr(self, child), name, value)
            return result

        return {method: rebuild}

    return keeping
