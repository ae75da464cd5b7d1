"""The seeded random-init checkpoints peers.py runs every way, and what a round runs on each (a :class:`Task`): a
Llama decoder (forward at two batch sizes, greedy decode), a shorter Llama for half precision, BART (beam search)
and ViT (forward); a GPT-2 for the memory part. Their sizes come from peers.py's arguments.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import MIB
from _ways import Figure

GENERATE = {"do_sample": False, "pad_token_id": 0}
#: the sizes of the models besides the Llama (whose sizes are peers.py's arguments)
SIZES = {
    "gpt2": {"vocab": 50257, "hidden": 768, "layers": 12, "heads": 12},
    "bart": {"vocab": 50265, "hidden": 768, "layers": 6, "heads": 12},
    "vit": {"hidden": 768, "layers": 12, "heads": 12, "image": 224, "patch": 16},
    "half": {"layers": 2, "vocab": 8000, "new_tokens": 4},
}
#: every model tiny (--quick): the Llama's arguments and the others' sizes
TINY = {
    "layers": 2,
    "hidden": 128,
    "heads": 4,
    "intermediate": 256,
    "vocab": 1000,
    "gpt2": {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4},
    "bart": {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4},
    "vit": {"hidden": 128, "layers": 2, "heads": 4, "image": 32, "patch": 8},
    "half": {"layers": 2, "vocab": 1000, "new_tokens": 2},
}


@dataclass
class Task:
    """One checkpoint and what a round runs on it: ``calls`` = ``{name: (method, input key, kwargs)}``."""

    name: str
    auto_class: str
    modeling: str  # the module a rank imports before its floor is read
    config: object
    inputs: dict
    calls: dict
    keep: dict  # {call: (output attribute, or None for tokens; label)}: compared with the unsplit model's
    figures: list[Figure]
    dtensor_plan: dict
    repeat: dict = field(default_factory=dict)
    checkpoint: str = ""
    model_class: str = ""
    parameters: int = 0
    bytes: int = 0

    def describe(self) -> str:
        keys = (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "image_size",
        )
        sizes = ", ".join(f"{key} {getattr(self.config, key)}" for key in keys if hasattr(self.config, key))
        return (
            f"Random-init `{self.model_class}` ({sizes}, seed 0): {self.parameters / 1e6:.1f} M parameters, "
            f"{self.bytes / MIB:.1f} MiB (fp32), saved with `save_pretrained`."
        )

    def spec(self) -> dict:
        """What a rank needs to load it."""
        fields = ("checkpoint", "auto_class", "modeling", "dtensor_plan")
        return {name: getattr(self, name) for name in fields}


def ids(generator, vocab: int, batch: int, seq: int) -> dict:
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def generate_call(key: str, new_tokens: int, **options) -> tuple:
    return ("generate", key, {**GENERATE, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, **options})


def llama_task(args, layers: int | None = None, vocab: int | None = None, large: bool = True) -> Task:
    """The decoder: forward at batch 1 and the large batch, greedy ``generate()`` per new token."""
    from transformers import LlamaConfig

    vocab = vocab or args.vocab
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers or args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=vocab,
        max_position_embeddings=max(512, args.seq + 1),
        tie_word_embeddings=False,
    )
    generator, k = torch.Generator().manual_seed(1234), args.new_tokens
    inputs = {"b1": ids(generator, vocab, 1, args.seq), "prompt": ids(generator, vocab, 1, args.prompt)}
    calls = {"b1": ("__call__", "b1", {})}
    figures: list[Figure] = [("b1", f"fwd 1x{args.seq} ms", lambda e: e.ms("b1"))]
    if large:
        inputs["large"] = ids(generator, vocab, args.batch, args.seq)
        calls["large"] = ("__call__", "large", {})
        figures.append(("large", f"fwd {args.batch}x{args.seq} ms", lambda e: e.ms("large")))
    calls |= {"gen1": generate_call("prompt", 1), "genK": generate_call("prompt", 1 + k)}
    figures.append(("decode", "decode ms/token", lambda e: e.per_token_ms("gen1", "genK", k)))
    layer = "model.layers.*."
    plan = {f"{layer}self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"{layer}mlp.{name}": "colwise" for name in ("gate_proj", "up_proj")}
    plan |= {f"{layer}self_attn.o_proj": "rowwise", f"{layer}mlp.down_proj": "rowwise"}
    return Task(
        "llama",
        "AutoModelForCausalLM",
        "transformers.models.llama.modeling_llama",
        config,
        inputs,
        calls,
        {"b1": ("logits", "max abs diff, logits 1x" + str(args.seq)), "genK": (None, "greedy tokens")},
        figures,
        plan,
        repeat={"b1": args.b1_calls},
    )


def bart_task(args) -> Task:
    """The encoder-decoder: ``generate(num_beams=4)`` per new token (K = half of ``--new-tokens``: beam search is
    slow), and one forward's logits."""
    from transformers import BartConfig

    size = args.bart
    config = BartConfig(
        vocab_size=size["vocab"],
        d_model=size["hidden"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_ffn_dim=4 * size["hidden"],
        decoder_ffn_dim=4 * size["hidden"],
        max_position_embeddings=512,
    )
    generator, k = torch.Generator().manual_seed(1234), max(1, args.new_tokens // 2)
    source = ids(generator, size["vocab"], 1, args.prompt * 2)
    decoder = {"decoder_input_ids": torch.randint(3, size["vocab"], (1, args.prompt), generator=generator)}
    calls = {
        "b1": ("__call__", "forward", {}),
        "beam1": generate_call("source", 1, num_beams=4),
        "beamK": generate_call("source", 1 + k, num_beams=4),
    }
    figures: list[Figure] = [
        ("beam", f"beam 4, 1 + {k} tokens ms", lambda e: e.ms("beamK")),
        ("beam_token", "beam 4 ms/token", lambda e: e.per_token_ms("beam1", "beamK", k)),
    ]
    plan = {}
    for stack, attentions in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        layer = f"model.{stack}.layers.*."
        for attention in attentions:
            plan |= {f"{layer}{attention}.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
            plan[f"{layer}{attention}.out_proj"] = "rowwise"
        plan |= {f"{layer}fc1": "colwise", f"{layer}fc2": "rowwise"}
    inputs = {"source": source, "forward": source | decoder}
    keep = {"b1": ("logits", "max abs diff, logits"), "beamK": (None, "beam tokens")}
    return Task(
        "bart",
        "AutoModelForSeq2SeqLM",
        "transformers.models.bart.modeling_bart",
        config,
        inputs,
        calls,
        keep,
        figures,
        plan,
    )


def vit_task(args) -> Task:
    """The vision encoder: forward at batch 1 and 8."""
    from transformers import ViTConfig

    size = args.vit
    config = ViTConfig(
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        intermediate_size=4 * size["hidden"],
        image_size=size["image"],
        patch_size=size["patch"],
    )
    generator = torch.Generator().manual_seed(1234)
    image = (3, size["image"], size["image"])
    inputs = {
        "b1": {"pixel_values": torch.randn(1, *image, generator=generator)},
        "large": {"pixel_values": torch.randn(8, *image, generator=generator)},
    }
    calls = {"b1": ("__call__", "b1", {}), "large": ("__call__", "large", {})}
    figures: list[Figure] = [
        ("b1", "fwd 1 image ms", lambda e: e.ms("b1")),
        ("large", "fwd 8 images ms", lambda e: e.ms("large")),
    ]
    layer = "layers.*."
    plan = {f"{layer}attention.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"{layer}attention.o_proj": "rowwise", f"{layer}mlp.fc1": "colwise", f"{layer}mlp.fc2": "rowwise"}
    keep = {"b1": ("last_hidden_state", "max abs diff, last hidden state")}
    return Task("vit", "AutoModel", "transformers.models.vit.modeling_vit", config, inputs, calls, keep, figures, plan)


def half_task(args) -> Task:
    """A shorter Llama for the half-precision part (on a CPU without half arithmetic it runs 5-20x slower)."""
    half_args = argparse.Namespace(**{**vars(args), "new_tokens": args.half["new_tokens"]})
    task = llama_task(half_args, layers=args.half["layers"], vocab=args.half["vocab"], large=False)
    task.name = "half"
    return task


def gpt2_config(args):
    from transformers import GPT2Config

    size = args.gpt2
    return GPT2Config(vocab_size=size["vocab"], n_embd=size["hidden"], n_layer=size["layers"], n_head=size["heads"])


def save_checkpoints(folder: str, tasks: list[Task], gpt2=None) -> int | None:
    """Save each task's seeded checkpoint in ``folder/<task name>`` (and a GPT-2 of config ``gpt2`` in
    ``folder/gpt2``), built on a rank of its own so that this process's memory stays clean, and set each task's
    checkpoint, model class and sizes; the GPT-2's bytes."""
    import os

    from _peer_ranks import save_checkpoint_folders

    from tpcore.ranks.process import RankPool

    models = [(task.auto_class, task.config, str(Path(folder) / task.name)) for task in tasks]
    if gpt2 is not None:
        models.append(("AutoModelForCausalLM", gpt2, str(Path(folder) / "gpt2")))
    with RankPool(1, "gloo", threads_per_rank=os.cpu_count()) as pool:
        built = pool.run(save_checkpoint_folders, models, 0)[0]
    for task, figures in zip(tasks, built[: len(tasks)], strict=True):
        task.checkpoint, task.model_class = str(Path(folder) / task.name), figures["class"]
        task.parameters, task.bytes = figures["parameters"], figures["bytes"]
    return built[-1]["bytes"] if gpt2 is not None else None
