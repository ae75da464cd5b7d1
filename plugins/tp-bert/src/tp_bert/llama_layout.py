"""NomicBERT and EuroBERT (Llama's layout) and ModernBERT (fused projections)."""

from __future__ import annotations

from tp_bert.bert import _HEADS, _MODELS
from tpcore import Policy, linear, local_heads


class _LlamaLayoutPolicy(Policy):
    """``self_attn.{q,k,v,o}_proj`` and a gated MLP ``mlp.{gate,up,down}_proj``; no head attribute
    is read in forward, so only the head counts are checked."""

    @staticmethod
    def replace_arguments(config, world_size):
        local_heads(config, world_size, _HEADS)
        return {}

    @staticmethod
    def attn_qkv():
        return [linear(f"self_attn.{name}_proj", heads=_HEADS) for name in "qkv"]

    @staticmethod
    def attn_out():
        return [linear("self_attn.o_proj", heads=_HEADS)]

    @staticmethod
    def mlp_in():
        return [linear("mlp.gate_proj"), linear("mlp.up_proj")]

    @staticmethod
    def mlp_out():
        return [linear("mlp.down_proj")]


class NomicBertPolicy(_LlamaLayoutPolicy):
    layer_class = f"{_MODELS}.nomic_bert.modeling_nomic_bert.NomicBertLayer"


class EuroBertPolicy(_LlamaLayoutPolicy):
    """EuroBERT: Llama's layout with grouped key/value heads, each kept with its query heads (replicated
    when the ranks outnumber them); ``num_key_value_groups`` becomes each rank's query-to-KV ratio."""

    layer_class = f"{_MODELS}.eurobert.modeling_eurobert.EuroBertDecoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, _HEADS, groups="num_key_value_heads")
        return {"self_attn.num_key_value_groups": heads // local_heads(config, world_size, "num_key_value_heads")}

    @staticmethod
    def attn_qkv():
        grouped = {"heads": _HEADS, "groups": "num_key_value_heads"}
        kv = {"heads": "num_key_value_heads"}
        return [
            linear("self_attn.q_proj", **grouped),
            linear("self_attn.k_proj", **kv),
            linear("self_attn.v_proj", **kv),
        ]

    @staticmethod
    def attn_out():
        return [linear("self_attn.o_proj", heads=_HEADS, groups="num_key_value_heads")]


class ModernBertPolicy(Policy):
    """ModernBERT layer: fused ``attn.Wqkv`` (q|k|v) and ``mlp.Wi`` (input|gate), outputs ``Wo``."""

    layer_class = f"{_MODELS}.modernbert.modeling_modernbert.ModernBertEncoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        local_heads(config, world_size, _HEADS)
        return {}

    @staticmethod
    def attn_qkv():
        return [linear("attn.Wqkv", n_fused=3, heads=_HEADS)]

    @staticmethod
    def attn_out():
        return [linear("attn.Wo", heads=_HEADS)]

    @staticmethod
    def mlp_in():
        return [linear("mlp.Wi", n_fused=2)]

    @staticmethod
    def mlp_out():
        return [linear("mlp.Wo")]
