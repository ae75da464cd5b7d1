"""ConvBERT: attention heads and the dynamic convolution's heads split alike."""

from __future__ import annotations

import torch

from tpcore import IfHeld, Layer, Policy, RowParallelLinear, ShardingError, linear, share, transformers_class


def _convbert_heads(config) -> int:
    """ConvBERT's attention heads: ``num_attention_heads // head_ratio`` (at least 1); the span-based
    convolution takes the other half of the width in as many heads."""
    return max(1, config.num_attention_heads // config.head_ratio)


class LocalHeadsKernels(RowParallelLinear):
    """ConvBERT's ``conv_kernel_layer``, ``Linear(all heads' features, heads x kernel)``: every head's
    kernel reads every head's features, so it runs row parallel over the rank's features (all-reduced:
    every head's kernel) and the rank keeps its own heads' kernels, ``num_heads`` from ``first_head``."""

    kernel_size: int = 0
    first_head: int = 0
    num_heads: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = super().forward(x).unflatten(-1, (-1, self.kernel_size))  # [..., all heads, kernel]
        return kernels[..., self.first_head : self.first_head + self.num_heads, :].flatten(-2)


#: a ConvBERT layer's attentions: its self-attention, and a decoder's cross-attention
_CONVBERT_ATTENTIONS = (("attention", False), ("crossattention", True))


class ConvBertPolicy(Policy):
    """ConvBERT: its attention heads (:func:`_convbert_heads`) split as BERT's, the span-based dynamic
    convolution by the same heads (the key convolution's pointwise part and ``conv_out_layer`` column
    parallel, the kernel generator :class:`LocalHeadsKernels`); the output projection reads the
    attention's heads then the convolution's, two parts cut alike. The grouped feed-forward
    (``num_groups > 1``) is refused."""

    layer_class = transformers_class("convbert", "ConvBertLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        if config.num_groups > 1 and world_size > 1:
            raise ShardingError(
                f"ConvBERT's grouped feed-forward (num_groups={config.num_groups}) is not split by tp-bert"
            )
        heads = _convbert_heads(config)
        local = share(heads, world_size, "num_attention_heads // head_ratio")
        first = share(heads, world_size, "num_attention_heads // head_ratio", first=True)
        width = local * ((config.hidden_size // heads) // 2)
        arguments = {}
        for attention, _ in _CONVBERT_ATTENTIONS:
            kernels = f"{attention}.self.conv_kernel_layer"
            values = {"self.num_attention_heads": local, "self.all_head_size": width}
            values |= {"self.conv_kernel_layer.num_heads": local, "self.conv_kernel_layer.first_head": first}
            values["self.conv_kernel_layer.kernel_size"] = config.conv_kernel_size
            arguments |= {f"{attention}.{path}": IfHeld(value, kernels) for path, value in values.items()}
        return arguments

    @staticmethod
    def replace_modules():  # the row-parallel class its Layer gives it, declaring the attributes set above
        return {
            f"{attention}.self.conv_kernel_layer": lambda module: None if module is None else LocalHeadsKernels
            for attention, _ in _CONVBERT_ATTENTIONS
        }

    @staticmethod
    def attn_qkv():
        layers = []
        for attention, optional in _CONVBERT_ATTENTIONS:
            path, heads = f"{attention}.self", {"optional": optional, "heads": _convbert_heads}
            names = ("query", "key", "value", "conv_out_layer")
            layers += [linear(f"{path}.{name}", **heads) for name in names]
            for name in ("key_conv_attn_layer.pointwise.weight", "key_conv_attn_layer.bias"):  # [features, ...]
                layers.append(Layer(weight=f"{path}.{name}", dim=0, heads=_convbert_heads, optional=optional))
        return layers

    @staticmethod
    def attn_out():
        layers = []
        for attention, optional in _CONVBERT_ATTENTIONS:
            heads = {"optional": optional, "heads": _convbert_heads}
            layers.append(linear(f"{attention}.self.conv_kernel_layer", replace=LocalHeadsKernels, **heads))
            layers.append(linear(f"{attention}.output.dense", n_fused=2, **heads))  # [attention heads | conv heads]
        return layers

    @staticmethod
    def mlp_in():
        return [linear("intermediate.dense")]

    @staticmethod
    def mlp_out():
        return [linear("output.dense")]
