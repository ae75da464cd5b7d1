"""NomicBERT and EuroBERT (Llama's layout) and ModernBERT (fused projections)."""

from __future__ import annotations

from tpcore import Attention, BlockPolicy, linear, share, transformers_class


class _LlamaLayoutPolicy(BlockPolicy):
    """``self_attn.{q,k,v,o}_proj`` and a gated MLP ``mlp.{gate,up,down}_proj``; no head attribute
    is read in forward, so only the head counts are checked."""

    attentions = (Attention("self_attn", output="o_proj", counts=()),)
    mlp_inputs = ("mlp.gate_proj", "mlp.up_proj")
    mlp_outputs = ("mlp.down_proj",)


class NomicBertPolicy(_LlamaLayoutPolicy):
    layer_class = transformers_class("nomic_bert", "NomicBertLayer")


class EuroBertPolicy(_LlamaLayoutPolicy):
    """EuroBERT: Llama's layout with grouped key/value heads, each kept with its query heads (replicated
    when the ranks outnumber them); ``num_key_value_groups`` becomes each rank's query-to-KV ratio."""

    layer_class = transformers_class("eurobert", "EuroBertDecoderLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = share(config.num_attention_heads, world_size, "num_attention_heads", groups=config.num_key_value_heads)
        kv_heads = share(config.num_key_value_heads, world_size, "num_key_value_heads")
        return {"self_attn.num_key_value_groups": heads // kv_heads}

    @staticmethod
    def attn_qkv():
        grouped = {"heads": "num_attention_heads", "groups": "num_key_value_heads"}
        kv = {"heads": "num_key_value_heads"}
        return [
            linear("self_attn.q_proj", **grouped),
            linear("self_attn.k_proj", **kv),
            linear("self_attn.v_proj", **kv),
        ]

    @staticmethod
    def attn_out():
        return [linear("self_attn.o_proj", heads="num_attention_heads", groups="num_key_value_heads")]


class ModernBertPolicy(BlockPolicy):
    """ModernBERT layer: fused ``attn.Wqkv`` (q|k|v) and ``mlp.Wi`` (input|gate), outputs ``Wo``."""

    layer_class = transformers_class("modernbert", "ModernBertEncoderLayer")
    attentions = (Attention("attn", projections=("Wqkv",), output="Wo", counts=(), packed=3),)
    mlp_outputs = ("mlp.Wo",)

    @staticmethod
    def mlp_in():
        return [linear("mlp.Wi", n_fused=2)]
