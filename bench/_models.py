"""The random-init models several scripts build from a seeded config (no download): a Llama of SmolLM2-135M's
widths, as a spec every process rebuilds alike or as a checkpoint folder with a tokenizer of its vocabulary, a
gpt-oss and a Qwen3-MoE of the same widths, and a BERT of bert-base's widths with its size options."""

from __future__ import annotations

from pathlib import Path

#: SmolLM2-135M's widths (9 query and 3 key/value heads), for a Llama with random weights
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152,
)  # fmt: skip
BERT_VOCAB = 30522


def smollm2_spec(layers: int):
    """A ``ModelSpec`` of a Llama of SmolLM2-135M's widths with ``layers`` layers (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpcore.testing import ModelSpec

    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers}, pad_token_id=0, eos_token_id=1)
    return ModelSpec(LlamaForCausalLM, config, seed=0)


def gpt_oss_spec(layers: int):
    """A ``ModelSpec`` of a gpt-oss of SmolLM2-135M's widths (576 hidden features, 9 query and 3 key/value heads of 64)
    with ``layers`` layers of 8 experts of 576 features, 2 a token (gpt-oss-20b: 32 of 2880, 4 a token), its biases
    drawn (seed 0)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from tpcore.testing import ModelSpec

    widths = {key: SMOLLM2_135M[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads")}
    config = GptOssConfig(
        **widths, head_dim=64, intermediate_size=576, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=layers, vocab_size=SMOLLM2_135M["vocab_size"], pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return ModelSpec(GptOssForCausalLM, config, seed=0, bias_std=0.02)


def qwen3_moe_spec(layers: int):
    """A ``ModelSpec`` of a Qwen3-MoE of SmolLM2-135M's widths with ``layers`` layers of 8 experts of 576 features,
    2 a token (Qwen3-30B-A3B: 128 of 768, 8 a token) (seed 0)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tpcore.testing import ModelSpec

    widths = {key: SMOLLM2_135M[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads")}
    config = Qwen3MoeConfig(
        **widths, head_dim=64, moe_intermediate_size=576, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=layers, vocab_size=SMOLLM2_135M["vocab_size"], pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return ModelSpec(Qwen3MoeForCausalLM, config, seed=0)


def smollm2_checkpoint(directory: Path, layers: int) -> None:
    """A random-init Llama of SmolLM2-135M's shape (its rope, tied head, ``layers`` layers) saved in ``directory``
    with a word-level tokenizer of its vocabulary size (``w0`` ... ``w49151``, ``w0`` the end of a sequence)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = SMOLLM2_135M["vocab_size"]
    config = transformers.LlamaConfig(
        **{**SMOLLM2_135M, "num_hidden_layers": layers}, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0").save_pretrained(directory)


def bert_arguments(parser, layers: int, layers_help: str) -> None:
    """``--layers`` (default ``layers``), ``--hidden`` and ``--heads`` of a BERT of bert-base's widths."""
    parser.add_argument("--layers", type=int, default=layers, help=layers_help)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)


def bert_spec(layers: int, hidden: int, heads: int):
    """A ``ModelSpec`` of a ``BertModel`` (intermediate 4 x hidden, bert-base's vocabulary; seed 0)."""
    from transformers import BertConfig, BertModel

    from tpcore.testing import ModelSpec

    config = BertConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        vocab_size=BERT_VOCAB,
        max_position_embeddings=512,
    )
    return ModelSpec(BertModel, config, seed=0)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
