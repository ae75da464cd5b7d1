"""Policies for decoder-only language models (transformers 5.x).

Every attention here splits by heads: q/k/v (or the fused q|k|v) are column parallel, the output
projection row parallel; the MLP input column, its output row. Per rank the policies rewrite the
head-count attributes that the forwards read:

- GPT-2: ``c_attn`` is one transposed ``Conv1D`` packing q|k|v (``n_fused=3``, ``reversed``);
  ``split_size`` must become the local width, since the forward splits the packed output by it.
- GPT-Neo, OPT: ``num_heads`` (their forwards view by it), GPT-J ``num_attention_heads``.
- GPT-NeoX and BLOOM pack q|k|v per head (``[q0 k0 v0 | q1 k1 v1 | ...]``), so a plain column
  split keeps each head's q, k and v together. BLOOM's attention also gets its heads' rows of the
  ALiBi bias (:mod:`tp_gpt.bloom`).
- Llama, Mistral, Qwen2: grouped key/value heads. With more ranks than KV heads, KV heads are
  replicated (``Layer(heads="num_key_value_heads")``) so each rank holds whole groups, and
  ``num_key_value_groups`` becomes the local query-to-KV ratio.

A world size must divide the query heads; GPT-2 XL's 25 heads therefore split over 5 ranks, not
2 or 4 (tpcore refuses those before changing anything).
"""

from __future__ import annotations

from tpcore import Layer, Policy, divide

_MODELS = "transformers.models"


def _linear(path: str, **options) -> Layer:
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias", **options)


def _conv1d(path: str, n_fused: int = 1) -> Layer:
    """An HF ``Conv1D`` (weight stored ``(in, out)``)."""
    return Layer(weight=f"{path}.weight", bias=f"{path}.bias", n_fused=n_fused, reversed=True)


def _local_heads(config, world_size: int, name: str) -> int:
    return divide(getattr(config, name), world_size, name)


class GPT2Policy(Policy):
    """GPT-2 block: fused ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj`` (all Conv1D)."""

    layer_class = f"{_MODELS}.gpt2.modeling_gpt2.GPT2Block"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "n_head")
        width = heads * (config.n_embd // config.n_head)
        return {"attn.num_heads": heads, "attn.split_size": width, "attn.embed_dim": width}

    @staticmethod
    def attn_qkv():
        return [_conv1d("attn.c_attn", n_fused=3)]

    @staticmethod
    def attn_out():
        return [_conv1d("attn.c_proj")]

    @staticmethod
    def mlp_in():
        return [_conv1d("mlp.c_fc")]

    @staticmethod
    def mlp_out():
        return [_conv1d("mlp.c_proj")]


class GPTNeoPolicy(Policy):
    """GPT-Neo block (global and local attention layers alike)."""

    layer_class = f"{_MODELS}.gpt_neo.modeling_gpt_neo.GPTNeoBlock"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "num_heads")
        width = heads * (config.hidden_size // config.num_heads)
        return {"attn.attention.num_heads": heads, "attn.attention.embed_dim": width}

    @staticmethod
    def attn_qkv():
        return [_linear(f"attn.attention.{name}_proj") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("attn.attention.out_proj")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.c_fc")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.c_proj")]


class GPTJPolicy(Policy):
    """GPT-J block: attention and MLP in parallel off one layer norm; rotary stays within heads."""

    layer_class = f"{_MODELS}.gptj.modeling_gptj.GPTJBlock"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "n_head")
        return {"attn.num_attention_heads": heads, "attn.embed_dim": heads * (config.n_embd // config.n_head)}

    @staticmethod
    def attn_qkv():
        return [_linear(f"attn.{name}_proj") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("attn.out_proj")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.fc_in")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.fc_out")]


class GPTNeoXPolicy(Policy):
    """GPT-NeoX layer: ``attention.query_key_value`` packs q|k|v per head, so a plain column split."""

    layer_class = f"{_MODELS}.gpt_neox.modeling_gpt_neox.GPTNeoXLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        _local_heads(config, world_size, "num_attention_heads")
        return {}

    @staticmethod
    def attn_qkv():
        return [_linear("attention.query_key_value")]

    @staticmethod
    def attn_out():
        return [_linear("attention.dense")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.dense_h_to_4h")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.dense_4h_to_h")]


class OPTPolicy(Policy):
    """OPT decoder layer: ``self_attn.{q,k,v,out}_proj``, ``fc1``, ``fc2``."""

    layer_class = f"{_MODELS}.opt.modeling_opt.OPTDecoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "num_attention_heads")
        width = heads * (config.hidden_size // config.num_attention_heads)
        return {"self_attn.num_heads": heads, "self_attn.embed_dim": width}

    @staticmethod
    def attn_qkv():
        return [_linear(f"self_attn.{name}_proj") for name in "qkv"]

    @staticmethod
    def attn_out():
        return [_linear("self_attn.out_proj")]

    @staticmethod
    def mlp_in():
        return [_linear("fc1")]

    @staticmethod
    def mlp_out():
        return [_linear("fc2")]


class BloomPolicy(Policy):
    """BLOOM block: per-head packed ``query_key_value``; the attention takes its heads' ALiBi rows."""

    layer_class = f"{_MODELS}.bloom.modeling_bloom.BloomBlock"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "n_head")
        width = heads * (config.hidden_size // config.n_head)
        return {
            "self_attention.num_heads": heads,
            "self_attention.hidden_size": width,
            "self_attention.split_size": width,
        }

    @staticmethod
    def replace_modules():
        from tp_gpt.bloom import BloomAttentionTP

        return {"self_attention": BloomAttentionTP}

    @staticmethod
    def attn_qkv():
        return [_linear("self_attention.query_key_value")]

    @staticmethod
    def attn_out():
        return [_linear("self_attention.dense")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.dense_h_to_4h")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.dense_4h_to_h")]


def _kv_heads_per_rank(kv_heads: int, world_size: int) -> int:
    """KV heads a rank holds: a share when they split evenly, one replicated head otherwise."""
    return kv_heads // world_size if kv_heads % world_size == 0 else 1


class LlamaPolicy(Policy):
    """Llama decoder layer: ``self_attn.{q,k,v,o}_proj`` with grouped KV heads, gated MLP."""

    layer_class = f"{_MODELS}.llama.modeling_llama.LlamaDecoderLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        heads = _local_heads(config, world_size, "num_attention_heads")
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if kv_heads % world_size and world_size % kv_heads:  # neither split nor replicated evenly
            divide(kv_heads, world_size, "num_key_value_heads")  # raises, naming the attribute
        return {"self_attn.num_key_value_groups": heads // _kv_heads_per_rank(kv_heads, world_size)}

    @staticmethod
    def attn_qkv():
        return [
            _linear("self_attn.q_proj"),
            _linear("self_attn.k_proj", heads="num_key_value_heads"),
            _linear("self_attn.v_proj", heads="num_key_value_heads"),
        ]

    @staticmethod
    def attn_out():
        return [_linear("self_attn.o_proj")]

    @staticmethod
    def mlp_in():
        return [_linear("mlp.gate_proj"), _linear("mlp.up_proj")]

    @staticmethod
    def mlp_out():
        return [_linear("mlp.down_proj")]


class MistralPolicy(LlamaPolicy):
    layer_class = f"{_MODELS}.mistral.modeling_mistral.MistralDecoderLayer"


class Qwen2Policy(LlamaPolicy):
    layer_class = f"{_MODELS}.qwen2.modeling_qwen2.Qwen2DecoderLayer"


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
)
