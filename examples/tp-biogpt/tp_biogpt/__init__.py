"""A third-party tpcore plugin: tensor parallelism for BioGPT, which tpcore's own plugins do not cover."""

import tpcore
from tpcore import Layer, Policy, share


class BioGptPolicy(Policy):
    layer_class = "transformers.models.biogpt.modeling_biogpt.BioGptDecoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = share(config.num_attention_heads, world_size, "num_attention_heads")  # whole heads, even or not
        return {
            "self_attn.num_heads": heads,
            "self_attn.embed_dim": heads * (config.hidden_size // config.num_attention_heads),
        }

    @staticmethod
    def attn_qkv():
        heads = "num_attention_heads"
        return [Layer(weight=f"self_attn.{n}_proj.weight", bias=f"self_attn.{n}_proj.bias", heads=heads) for n in "qkv"]

    @staticmethod
    def attn_out():
        return [Layer(weight="self_attn.out_proj.weight", bias="self_attn.out_proj.bias", heads="num_attention_heads")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="fc1.weight", bias="fc1.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="fc2.weight", bias="fc2.bias")]


@tpcore.hookimpl
def tpcore_register_policies():
    return [BioGptPolicy]
