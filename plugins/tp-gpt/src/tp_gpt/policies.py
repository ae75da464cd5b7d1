"""Policies for decoder-only language models (transformers 5.x).

Every attention here splits by heads: q/k/v (or the fused q|k|v) are column parallel, the output
projection row parallel; the MLP input column, its output row. Where a block is one attention and
an MLP of ``nn.Linear`` s, its policy is a :class:`tpcore.BlockPolicy` naming them (GPT-Neo, GPT-J,
GPT-NeoX, OPT, BLOOM, CTRL). Per rank the policies rewrite the head-count attributes that the
forwards read:

- GPT-2: ``c_attn`` is one transposed ``Conv1D`` packing q|k|v (``n_fused=3``, ``transposed``);
  ``split_size`` must become the local width, since the forward splits the packed output by it.
- GPT-Neo, OPT: ``num_heads`` (their forwards view by it), GPT-J ``num_attention_heads``.
- GPT-NeoX and BLOOM pack q|k|v per head (``[q0 k0 v0 | q1 k1 v1 | ...]``), so a plain column
  split keeps each head's q, k and v together. BLOOM's attention also gets its heads' rows of the
  ALiBi bias (:mod:`tp_gpt.bloom`).
- Llama, Mistral, Qwen2: grouped key/value heads. Query heads stay with their key/value head
  (``groups="num_key_value_heads"``); with more ranks than KV heads, KV heads are replicated
  (``Layer(heads="num_key_value_heads")``) so each rank holds whole groups, and
  ``num_key_value_groups`` becomes the local query-to-KV ratio.

- Falcon and GPT-BigCode (StarCoder) pack q|k|v in one projection by key/value group: each group's
  query heads, then its key and value head (``parts=(H, G, G), interleaved=True``); the grouped
  (new architecture), multi-query (one group: ``[q | k | v]``) and per-head (``G = H``) layouts
  are that pack with the ``G`` their config flags give. Falcon's ALiBi attention takes its heads'
  bias rows, as BLOOM's does (:mod:`tp_gpt.falcon`).
- StableLM: Llama's grouped heads; its per-head q/k LayerNorms follow the heads (:mod:`tp_gpt.stablelm`).
- OpenAI-GPT: GPT-2's Conv1D layout; CTRL: separate ``Wq``/``Wk``/``Wv``, the MLP a ``Sequential``.

Heads are dealt whole (:func:`tpcore.share`), so any world size up to the head count works: GPT-2 XL's
25 heads over 2 ranks are 13 and 12, SmolLM2's 9 query and 3 key/value heads over 2 ranks are 6 + 2
and 3 + 1. Every attention projection names its head count (``Layer(heads=...)``) for its rows to follow.
"""

from __future__ import annotations

from tpcore import (
    Attention,
    BlockPolicy,
    IfHeld,
    Layer,
    Policy,
    RowParallelLinear,
    linear,
    local_heads,
    share,
    transformers_class,
)


def _conv1d(path: str, n_fused: int = 1, **layout) -> Layer:
    """An HF ``Conv1D`` (weight stored ``(in, out)``)."""
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias", n_fused=n_fused, transposed=True, **layout)


class GPT2Policy(Policy):
    """GPT-2 block: fused ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj`` (all Conv1D)."""

    layer_class = transformers_class("gpt2", "GPT2Block")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "n_head")
        width = heads * (config.n_embd // config.n_head)
        return {"attn.num_heads": heads, "attn.split_size": width, "attn.embed_dim": width}

    @staticmethod
    def attn_qkv():
        return [_conv1d("attn.c_attn", n_fused=3, heads="n_head")]

    @staticmethod
    def attn_out():
        return [_conv1d("attn.c_proj", heads="n_head")]

    @staticmethod
    def mlp_in():
        return [_conv1d("mlp.c_fc")]

    @staticmethod
    def mlp_out():
        return [_conv1d("mlp.c_proj")]


class GPTNeoPolicy(BlockPolicy):
    """GPT-Neo block (global and local attention layers alike)."""

    layer_class = transformers_class("gpt_neo", "GPTNeoBlock")
    heads = "num_heads"
    attentions = (Attention("attn.attention", counts=("num_heads",), widths=("embed_dim",)),)
    mlp_inputs = ("mlp.c_fc",)
    mlp_outputs = ("mlp.c_proj",)


class GPTJPolicy(BlockPolicy):
    """GPT-J block: attention and MLP in parallel off one layer norm; rotary stays within heads."""

    layer_class = transformers_class("gptj", "GPTJBlock")
    heads = "n_head"
    attentions = (Attention("attn", counts=("num_attention_heads",), widths=("embed_dim",)),)
    mlp_inputs = ("mlp.fc_in",)
    mlp_outputs = ("mlp.fc_out",)


class GPTNeoXPolicy(BlockPolicy):
    """GPT-NeoX layer: ``attention.query_key_value`` packs q|k|v per head (``interleaved``)."""

    layer_class = transformers_class("gpt_neox", "GPTNeoXLayer")
    attentions = (
        Attention("attention", projections=("query_key_value",), output="dense", counts=(), packed=3, interleaved=True),
    )
    mlp_inputs = ("mlp.dense_h_to_4h",)
    mlp_outputs = ("mlp.dense_4h_to_h",)


class OPTPolicy(BlockPolicy):
    """OPT decoder layer: ``self_attn.{q,k,v,out}_proj``, ``fc1``, ``fc2``."""

    layer_class = transformers_class("opt", "OPTDecoderLayer")
    attentions = (Attention("self_attn", counts=("num_heads",), widths=("embed_dim",)),)


class BloomPolicy(BlockPolicy):
    """BLOOM block: per-head packed ``query_key_value``; the attention takes its heads' ALiBi rows."""

    layer_class = transformers_class("bloom", "BloomBlock")
    heads = "n_head"
    attentions = (
        Attention(
            "self_attention",
            projections=("query_key_value",),
            output="dense",
            counts=("num_heads",),
            widths=("hidden_size", "split_size"),
            packed=3,
            interleaved=True,
        ),
    )
    mlp_inputs = ("mlp.dense_h_to_4h",)
    mlp_outputs = ("mlp.dense_4h_to_h",)

    @classmethod
    def replace_arguments(cls, config, world_size):
        first = share(config.n_head, world_size, cls.heads, first=True)
        return super().replace_arguments(config, world_size) | {"self_attention.first_head": first}

    @staticmethod
    def replace_modules():
        from tp_gpt.bloom import BloomAttentionTP

        return {"self_attention": BloomAttentionTP}


#: query heads (and the output projection's inputs) dealt with their key/value heads
GROUPED_QUERIES = {"heads": "num_attention_heads", "groups": "num_key_value_heads"}


class LlamaPolicy(Policy):
    """Llama decoder layer: ``self_attn.{q,k,v,o}_proj`` with grouped KV heads, gated MLP."""

    layer_class = transformers_class("llama", "LlamaDecoderLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "num_attention_heads", groups="num_key_value_heads")
        kv_heads = local_heads(config, world_size, "num_key_value_heads")  # one, replicated, when fewer than ranks
        return {"self_attn.num_key_value_groups": heads // kv_heads}

    @staticmethod
    def attn_qkv():
        return [
            linear("self_attn.q_proj", **GROUPED_QUERIES),
            linear("self_attn.k_proj", heads="num_key_value_heads"),
            linear("self_attn.v_proj", heads="num_key_value_heads"),
        ]

    @staticmethod
    def attn_out():
        return [linear("self_attn.o_proj", **GROUPED_QUERIES)]

    @staticmethod
    def mlp_in():
        return [linear("mlp.gate_proj"), linear("mlp.up_proj")]

    @staticmethod
    def mlp_out():
        return [linear("mlp.down_proj")]


class MistralPolicy(LlamaPolicy):
    layer_class = transformers_class("mistral", "MistralDecoderLayer")


class Qwen2Policy(LlamaPolicy):
    layer_class = transformers_class("qwen2", "Qwen2DecoderLayer")


def _falcon_key_value_heads(config) -> int:
    """The key/value groups of Falcon's ``query_key_value``: ``num_kv_heads`` (new decoder architecture),
    one (``multi_query``: ``[q | k | v]``), or one per query head (``[q0 k0 v0 | q1 k1 v1 | ...]``)."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconPolicy(Policy):
    """Falcon decoder layer, every layout: ``self_attention.query_key_value`` packs each key/value group's
    query heads, key and value head (:mod:`tp_gpt.falcon`); ``FalconLinear`` rows all-reduce as ``Linear``."""

    layer_class = transformers_class("falcon", "FalconDecoderLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        groups = _falcon_key_value_heads(config)
        heads = share(config.num_attention_heads, world_size, "num_attention_heads", groups=groups)
        kv_heads = share(groups, world_size, "key/value heads")
        arguments = {
            "self_attention.num_heads": heads,
            "self_attention.num_kv_heads": kv_heads,
            # transformers 5.25's attention (its shared attention functions) repeats each key/value head
            # for its group of query heads; earlier ones broadcast them and have no such attribute
            "self_attention.num_key_value_groups": IfHeld(heads // kv_heads, "self_attention.num_key_value_groups"),
        }
        if config.alibi:
            first = share(config.num_attention_heads, world_size, "num_attention_heads", groups=groups, first=True)
            arguments["self_attention.first_head"] = first
        return arguments

    @staticmethod
    def replace_modules():
        from tp_gpt.falcon import attention_class

        return {"self_attention": attention_class}

    @staticmethod
    def attn_qkv():
        parts = ("num_attention_heads", _falcon_key_value_heads, _falcon_key_value_heads)
        return [linear("self_attention.query_key_value", parts=parts, interleaved=True)]

    @staticmethod
    def attn_out():
        grouped = {"heads": "num_attention_heads", "groups": _falcon_key_value_heads}
        return [linear("self_attention.dense", **grouped, replace=RowParallelLinear)]

    @staticmethod
    def mlp_in():
        return [linear("mlp.dense_h_to_4h")]

    @staticmethod
    def mlp_out():
        return [linear("mlp.dense_4h_to_h", replace=RowParallelLinear)]


def _bigcode_key_value_heads(config) -> int:
    """GPT-BigCode's key/value heads: one (multi-query ``[q | k | v]``) or one per query head (``[q0 k0 v0 | ...]``)."""
    return 1 if config.multi_query else config.n_head


class GPTBigCodePolicy(Policy):
    """GPT-BigCode (StarCoder) block: ``attn.c_attn`` a multi-query ``[q | k | v]`` or per-head q|k|v pack."""

    layer_class = transformers_class("gpt_bigcode", "GPTBigCodeBlock")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "n_head")
        head_dim = config.n_embd // config.n_head
        kv_heads = share(_bigcode_key_value_heads(config), world_size, "key/value heads")
        return {
            "attn.num_heads": heads,
            "attn.embed_dim": heads * head_dim,
            "attn.kv_heads": kv_heads,
            "attn.kv_dim": kv_heads * head_dim,
            "attn.num_key_value_groups": heads // kv_heads,
        }

    @staticmethod
    def attn_qkv():
        parts = ("n_head", _bigcode_key_value_heads, _bigcode_key_value_heads)
        return [linear("attn.c_attn", parts=parts, interleaved=True)]

    @staticmethod
    def attn_out():
        return [linear("attn.c_proj", heads="n_head")]

    @staticmethod
    def mlp_in():
        return [linear("mlp.c_fc")]

    @staticmethod
    def mlp_out():
        return [linear("mlp.c_proj")]


class StableLmPolicy(LlamaPolicy):
    """StableLM decoder layer: Llama's projections; with ``qk_layernorm`` each rank's per-head norms
    are those of its own heads (:mod:`tp_gpt.stablelm`). Partial rotary and the parallel residual
    act within a head or on whole hidden states, so they need nothing."""

    layer_class = transformers_class("stablelm", "StableLmDecoderLayer")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "num_attention_heads", groups="num_key_value_heads")
        kv_heads = local_heads(config, world_size, "num_key_value_heads")
        arguments = {
            "self_attn.num_heads": heads,
            "self_attn.num_key_value_heads": kv_heads,
            "self_attn.num_key_value_groups": heads // kv_heads,
        }
        if config.qk_layernorm:
            first = local_heads(config, world_size, "num_attention_heads", groups="num_key_value_heads", first=True)
            first_kv = local_heads(config, world_size, "num_key_value_heads", first=True)
            for norm, count, start in (("q_layernorm", heads, first), ("k_layernorm", kv_heads, first_kv)):
                arguments[f"self_attn.{norm}.num_heads"] = count
                arguments[f"self_attn.{norm}.first_head"] = start
        return arguments

    @staticmethod
    def replace_modules():
        from tp_gpt.stablelm import per_head_norm_class

        return {"self_attn.q_layernorm": per_head_norm_class, "self_attn.k_layernorm": per_head_norm_class}


class OpenAIGPTPolicy(GPT2Policy):
    """OpenAI GPT block: GPT-2's Conv1D layout; its attention views by ``n_head``, splits by ``split_size``."""

    layer_class = transformers_class("openai", "Block")

    @staticmethod
    def replace_arguments(config, world_size):
        heads = local_heads(config, world_size, "n_head")
        return {"attn.n_head": heads, "attn.split_size": heads * (config.n_embd // config.n_head)}


class CTRLPolicy(BlockPolicy):
    """CTRL encoder layer: ``multi_head_attention.{Wq,Wk,Wv,dense}``; ``ffn`` a ``Sequential(Linear, ReLU, Linear)``."""

    layer_class = transformers_class("ctrl", "EncoderLayer")
    heads = "n_head"
    attentions = (
        Attention(
            "multi_head_attention",
            projections=("Wq", "Wk", "Wv"),
            output="dense",
            counts=("num_heads",),
            widths=("d_model_size",),
        ),
    )
    mlp_inputs = ("ffn.0",)
    mlp_outputs = ("ffn.2",)


POLICIES = (
    GPT2Policy,
    GPTNeoPolicy,
    GPTJPolicy,
    GPTNeoXPolicy,
    OPTPolicy,
    BloomPolicy,
    LlamaPolicy,
    MistralPolicy,
    Qwen2Policy,
    FalconPolicy,
    GPTBigCodePolicy,
    StableLmPolicy,
    OpenAIGPTPolicy,
    CTRLPolicy,
)
