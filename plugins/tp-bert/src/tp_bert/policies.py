"""Policies for the BERT family.

Most of the family shares BERT's layer layout (``attention.self.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``, and an optional
``crossattention`` of the same shape): their policies subclass :class:`BertPolicy` and only name
their layer class. DistilBERT has its own names.
"""

from __future__ import annotations

from tpcore import Layer, Policy, divide


def _qkv(prefix: str, optional: bool = False) -> list[Layer]:
    return [
        Layer(weight=f"{prefix}.self.{name}.weight", bias=f"{prefix}.self.{name}.bias", ignore_checker=optional)
        for name in ("query", "key", "value")
    ]


def _out(prefix: str, optional: bool = False) -> list[Layer]:
    return [Layer(weight=f"{prefix}.output.dense.weight", bias=f"{prefix}.output.dense.bias", ignore_checker=optional)]


def _attention_arguments(prefix: str, config, world_size: int) -> dict[str, int]:
    heads = config.num_attention_heads
    head_size = config.hidden_size // heads
    return {
        f"{prefix}.self.num_attention_heads": divide(heads, world_size, "num_attention_heads"),
        f"{prefix}.self.all_head_size": divide(heads, world_size, "num_attention_heads") * head_size,
    }


def _has_cross_attention(config) -> bool:
    return bool(getattr(config, "is_decoder", False) and getattr(config, "add_cross_attention", False))


class BertPolicy(Policy):
    """BERT layer: self-attention (and cross-attention in a decoder), then the MLP."""

    layer_class = "transformers.models.bert.modeling_bert.BertLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        arguments = _attention_arguments("attention", config, world_size)
        if _has_cross_attention(config):
            arguments.update(_attention_arguments("crossattention", config, world_size))
        return arguments

    @staticmethod
    def attn_qkv():
        return _qkv("attention") + _qkv("crossattention", optional=True)

    @staticmethod
    def attn_out():
        return _out("attention") + _out("crossattention", optional=True)

    @staticmethod
    def mlp_in():
        return [Layer(weight="intermediate.dense.weight", bias="intermediate.dense.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="output.dense.weight", bias="output.dense.bias")]


class RobertaPolicy(BertPolicy):
    layer_class = "transformers.models.roberta.modeling_roberta.RobertaLayer"


class XLMRobertaPolicy(BertPolicy):
    layer_class = "transformers.models.xlm_roberta.modeling_xlm_roberta.XLMRobertaLayer"


class CamembertPolicy(BertPolicy):
    layer_class = "transformers.models.camembert.modeling_camembert.CamembertLayer"


class ElectraPolicy(BertPolicy):
    layer_class = "transformers.models.electra.modeling_electra.ElectraLayer"


class DistilBertPolicy(Policy):
    """DistilBERT ``TransformerBlock``: ``attention.{q,k,v,out}_lin``, ``ffn.lin1``/``ffn.lin2``."""

    layer_class = "transformers.models.distilbert.modeling_distilbert.TransformerBlock"

    @staticmethod
    def replace_arguments(config, world_size):
        return {
            "attention.n_heads": divide(config.n_heads, world_size, "n_heads"),
            "attention.dim": divide(config.n_heads, world_size, "n_heads") * (config.dim // config.n_heads),
        }

    @staticmethod
    def attn_qkv():
        return [Layer(weight=f"attention.{n}_lin.weight", bias=f"attention.{n}_lin.bias") for n in "qkv"]

    @staticmethod
    def attn_out():
        return [Layer(weight="attention.out_lin.weight", bias="attention.out_lin.bias")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="ffn.lin1.weight", bias="ffn.lin1.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="ffn.lin2.weight", bias="ffn.lin2.bias")]


POLICIES = (
    BertPolicy,
    RobertaPolicy,
    XLMRobertaPolicy,
    CamembertPolicy,
    ElectraPolicy,
    DistilBertPolicy,
)
