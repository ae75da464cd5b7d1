"""A third-party tpcore plugin: tensor parallelism for BioGPT, which tpcore's own plugins do not cover."""

import tpcore
from tpcore import Attention, BlockPolicy


class BioGptPolicy(BlockPolicy):
    """A BioGPT decoder layer: one attention split by heads, then its MLP."""

    layer_class = "transformers.models.biogpt.modeling_biogpt.BioGptDecoderLayer"
    heads = "num_attention_heads"  # the config attribute of the head count
    # self_attn.{q,k,v}_proj column parallel, self_attn.out_proj row parallel, whole heads per rank;
    # the attention's num_heads and embed_dim hold the rank's heads and their width
    attentions = (Attention("self_attn", counts=("num_heads",), widths=("embed_dim",)),)
    mlp_inputs = ("fc1",)  # column parallel
    mlp_outputs = ("fc2",)  # row parallel: its partial sums all-reduced


@tpcore.hookimpl
def tpcore_register_policies():
    return [BioGptPolicy]
