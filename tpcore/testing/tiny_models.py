"""Tiny random-init models for tests: one small Llama, GPT-2 and BERT, and encoder-decoders, built the same way
everywhere.

Each family has a config builder and a model builder; any config field is overridden by keyword::

    from tpcore.testing import tiny_bert, tiny_llama, tiny_llama_config

    model = tiny_llama()  # LlamaForCausalLM, 2 layers of 4 query heads over 2 key/value heads, seeded with 0
    wide = tiny_llama(hidden_size=128, attn_implementation="eager", seed=3)
    spec = ModelSpec(transformers.LlamaForCausalLM, tiny_llama_config(num_hidden_layers=1))  # for the ranks

A model builder seeds torch's global RNG with ``seed`` right before it builds ``model_class(config)`` (as
:meth:`tpcore.testing.ModelSpec.build` does; ``seed=None`` leaves the RNG as it is) and returns the model in eval
mode. Special token ids are the config class's own unless given (GPT-2's 50256 lies outside its tiny vocabulary:
pass ``bos_token_id``/``eos_token_id`` to generate), except the Llama's ``pad_token_id=0``.

:func:`word_tokenizer` is a tokenizer for these vocabularies without a download (``"w5 w7"`` -> ``[5, 7]``), and
:func:`random_weights` fills every parameter with random values (Hugging Face's init leaves biases at zero and
norms at one, which hides a bias or norm that is cut wrong).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: :func:`tiny_llama_config`'s fields: head counts that two ranks divide, grouped key/value heads
LLAMA = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}
#: :func:`tiny_gpt2_config`'s fields: 12 heads of 4 features, which 1, 2, 3 and 4 ranks divide
GPT2 = {"vocab_size": 101, "n_embd": 48, "n_layer": 2, "n_head": 12, "n_positions": 32}
#: :func:`tiny_bert_config`'s fields: the cheapest BERT that still splits over 2 ranks
BERT = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


def tiny_llama_config(**overrides: Any):
    """A ``LlamaConfig`` of :data:`LLAMA`'s fields, ``overrides`` (any ``LlamaConfig`` field) on top."""
    import transformers

    return transformers.LlamaConfig(**{**LLAMA, **overrides})


def tiny_llama(*, seed: int | None = 0, model_class=None, **overrides: Any) -> nn.Module:
    """``model_class`` (``LlamaForCausalLM`` by default) of :func:`tiny_llama_config` ``(**overrides)``, seeded."""
    import transformers

    return seeded_model(model_class or transformers.LlamaForCausalLM, tiny_llama_config(**overrides), seed)


def tiny_gpt2_config(**overrides: Any):
    """A ``GPT2Config`` of :data:`GPT2`'s fields, ``overrides`` (any ``GPT2Config`` field) on top."""
    import transformers

    return transformers.GPT2Config(**{**GPT2, **overrides})


def tiny_gpt2(*, seed: int | None = 0, model_class=None, **overrides: Any) -> nn.Module:
    """``model_class`` (``GPT2LMHeadModel`` by default) of :func:`tiny_gpt2_config` ``(**overrides)``, seeded."""
    import transformers

    return seeded_model(model_class or transformers.GPT2LMHeadModel, tiny_gpt2_config(**overrides), seed)


def tiny_bert_config(**overrides: Any):
    """A ``BertConfig`` of :data:`BERT`'s fields, ``overrides`` (any ``BertConfig`` field) on top."""
    import transformers

    return transformers.BertConfig(**{**BERT, **overrides})


def tiny_bert(*, seed: int | None = 0, model_class=None, **overrides: Any) -> nn.Module:
    """``model_class`` (``BertModel`` by default) of :func:`tiny_bert_config` ``(**overrides)``, seeded."""
    import transformers

    return seeded_model(model_class or transformers.BertModel, tiny_bert_config(**overrides), seed)


#: :func:`tiny_seq2seq`'s fields: word_tokenizer's vocabulary (pad ``w0``, eos ``w1``), an untied head (a tied one
#: repeats its last word in so small a model)
SEQ2SEQ = {"vocab_size": 100, "pad_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}


def tiny_seq2seq(family: str = "T5", *, seed: int = 0, **overrides: Any) -> nn.Module:
    """``<family>ForConditionalGeneration`` (``T5``, or a BART-like family: ``Bart``, ``MBart``, ``M2M100``,
    ``Pegasus``; ``Marian``: ``MarianMTModel``) of 2 + 2 layers of 4 heads over 32 features, every parameter drawn
    by :func:`random_weights` (``seed``, scale 0.5). T5's decoder starts from ``w0``; the BART-like ones from
    ``w2``, which is not their padding (their positions skip padding)."""
    import transformers

    fields: dict[str, Any]
    if family == "T5":
        fields = {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2, "decoder_start_token_id": 0}
    else:
        fields = {"d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_layers": 2,
                  "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                  "max_position_embeddings": 64, "bos_token_id": 2, "decoder_start_token_id": 2,
                  "forced_eos_token_id": None}  # fmt: skip
    config = getattr(transformers, f"{family}Config")(**{**SEQ2SEQ, **fields, **overrides})
    model_class = (
        transformers.MarianMTModel if family == "Marian" else getattr(transformers, f"{family}ForConditionalGeneration")
    )
    model = model_class(config).eval()
    return random_weights(model, seed, 0.5)


def seeded_model(model_class, config, seed: int | None = 0) -> nn.Module:
    """``model_class(config)`` in eval mode, built right after ``torch.manual_seed(seed)`` (``None``: no seeding)."""
    if seed is not None:
        torch.manual_seed(seed)
    return model_class(config).eval()


def random_weights(model: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    """``model`` with every parameter drawn again from ``scale * N(0, 1)`` (a generator of its own, seeded
    ``seed``, in ``model.parameters()`` order): biases and norms no longer zeros and ones. Returns ``model``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return model


def word_tokenizer(vocab_size: int = 100, *, pad_token: str | None = "w0", eos_token: str | None = "w1"):
    """A word-level fast tokenizer of ``vocab_size`` words, ``w0`` to ``w<vocab_size - 1>``, split on whitespace:
    ``"w5 w7"`` -> ``[5, 7]``, and back. ``w2`` stands for an unknown word; ``pad_token`` and ``eos_token``
    (``None``: none) match :func:`tiny_llama` with ``eos_token_id=1``. Real decoding, no download."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"w{index}": index for index in range(vocab_size)}, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {name: token for name, token in (("pad_token", pad_token), ("eos_token", eos_token)) if token is not None}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special)
