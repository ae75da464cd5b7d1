"""DeBERTa and DeBERTa-v2/v3: disentangled attention."""

from __future__ import annotations

from tp_bert.bert import _HEADS, _MODELS, BertPolicy, _head_arguments, _out
from tpcore import Layer, ShardingError, linear

#: relative position projections: content to position (keys), position to content (queries)
_DEBERTA_POSITIONS = ("pos_proj", "pos_q_proj")
_DEBERTA_V2_POSITIONS = ("pos_key_proj", "pos_query_proj")


class DebertaPolicy(BertPolicy):
    """DeBERTa's disentangled attention: ``in_proj`` packs each head's query, key and value one head
    after another (``[q0 k0 v0 | q1 k1 v1 | ...]``), with per-head ``q_bias``/``v_bias``; the relative
    position projections ``pos_proj`` (content to position) and ``pos_q_proj`` (position to content)
    split by heads over the encoder's relative embeddings, which stay whole. Talking heads
    (``talking_head``) mix every head's scores and are refused."""

    layer_class = f"{_MODELS}.deberta.modeling_deberta.DebertaLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        if getattr(config, "talking_head", False) and world_size > 1:
            raise ShardingError(
                "DeBERTa with talking_head=True mixes the scores of all heads (head_logits_proj), "
                "so its heads cannot be split over ranks"
            )
        return _head_arguments("attention.self", config, world_size)

    @staticmethod
    def attn_qkv():
        packed = Layer(weight="attention.self.in_proj.weight", n_fused=3, interleaved=True, heads=_HEADS)
        biases = [Layer(weight=f"attention.self.{name}", dim=0, heads=_HEADS) for name in ("q_bias", "v_bias")]
        positions = [linear(f"attention.self.{name}", optional=True, heads=_HEADS) for name in _DEBERTA_POSITIONS]
        return [packed, *biases, *positions]

    @staticmethod
    def attn_out():
        return _out("attention")


class DebertaV2Policy(BertPolicy):
    """DeBERTa-v2 (and v3 checkpoints): ``attention.self.{query,key,value}_proj`` and, unless
    ``share_att_key``, the relative position projections ``pos_key_proj``/``pos_query_proj``, all by
    heads; the encoder's relative embeddings and its convolution stay whole."""

    layer_class = f"{_MODELS}.deberta_v2.modeling_deberta_v2.DebertaV2Layer"

    @staticmethod
    def attn_qkv():
        content = [linear(f"attention.self.{name}_proj", heads=_HEADS) for name in ("query", "key", "value")]
        positions = [linear(f"attention.self.{name}", optional=True, heads=_HEADS) for name in _DEBERTA_V2_POSITIONS]
        return content + positions

    @staticmethod
    def attn_out():
        return _out("attention")
