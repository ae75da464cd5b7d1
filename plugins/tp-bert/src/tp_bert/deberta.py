"""DeBERTa and DeBERTa-v2/v3: disentangled attention."""

from __future__ import annotations

from tp_bert.bert import BertPolicy
from tpcore import PER_HEAD, Layer, ShardingError, bert_attention, transformers_class


class DebertaPolicy(BertPolicy):
    """DeBERTa's disentangled attention: ``in_proj`` packs each head's query, key and value one head
    after another (``[q0 k0 v0 | q1 k1 v1 | ...]``), with per-head ``q_bias``/``v_bias``; the relative
    position projections ``pos_proj`` (content to position) and ``pos_q_proj`` (position to content)
    split by heads over the encoder's relative embeddings, which stay whole. Talking heads
    (``talking_head``) mix every head's scores and are refused."""

    layer_class = transformers_class("deberta", "DebertaLayer")
    attentions = (
        bert_attention(
            "attention", ("in_proj",), packed=3, interleaved=True, optional_projections=("pos_proj", "pos_q_proj")
        ),
    )

    @classmethod
    def replace_arguments(cls, config, world_size):
        if getattr(config, "talking_head", False) and world_size > 1:
            raise ShardingError(
                "DeBERTa with talking_head=True mixes the scores of all heads (head_logits_proj), "
                "so its heads cannot be split over ranks"
            )
        return super().replace_arguments(config, world_size)

    @classmethod
    def layers(cls):
        biases = [
            Layer(weight=f"attention.self.{name}", style=PER_HEAD, heads=cls.heads) for name in ("q_bias", "v_bias")
        ]
        return [*super().layers(), *biases]


class DebertaV2Policy(BertPolicy):
    """DeBERTa-v2 (and v3 checkpoints): ``attention.self.{query,key,value}_proj`` and, unless
    ``share_att_key``, the relative position projections ``pos_key_proj``/``pos_query_proj``, all by
    heads; the encoder's relative embeddings and its convolution stay whole."""

    layer_class = transformers_class("deberta_v2", "DebertaV2Layer")
    attentions = (
        bert_attention(
            "attention",
            ("query_proj", "key_proj", "value_proj"),
            optional_projections=("pos_key_proj", "pos_query_proj"),
        ),
    )
