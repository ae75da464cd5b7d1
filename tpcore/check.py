"""``tpcore check MODEL``: which policy applies to a model, and is its split equivalent?

MODEL is a saved model directory (its own weights are used) or a transformers class name, which
is built from its default config shrunk to a few small layers with random weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tpcore.testing import EquivalenceError, ModelSpec, PoolCache, check_equivalence

#: config attributes set to small values when MODEL is a class name (transformers maps the
#: usual aliases such as ``n_embd`` or ``d_model`` onto these names)
SMALL_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "d_ff": 128,
    "d_kv": 16,
    "head_dim": 16,
    "vocab_size": 128,
}


@dataclass(frozen=True)
class SavedModelSpec:
    """A model every rank loads from the same saved directory."""

    path: str
    model_class: type

    def build(self) -> torch.nn.Module:
        from transformers.utils import logging

        logging.disable_progress_bar()
        return self.model_class.from_pretrained(self.path).eval()


def resolve(model: str) -> Any:
    """A spec every rank can build: a saved directory, or a transformers class with a small config."""
    import transformers

    if os.path.isdir(model):
        config = transformers.AutoConfig.from_pretrained(model)
        name = (config.architectures or [None])[0]
        model_class = getattr(transformers, name, None) if name else None
        return SavedModelSpec(model, model_class or transformers.AutoModel)
    model_class = getattr(transformers, model, None)
    if model_class is None or not hasattr(model_class, "config_class"):
        raise SystemExit(f"tpcore check: {model!r} is neither a saved model directory nor a transformers model class")
    config = model_class.config_class()
    for name, value in SMALL_CONFIG.items():
        if hasattr(config, name):
            setattr(config, name, value)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    return ModelSpec(model_class, config, seed=0)


def sample_inputs(spec: Any, batch: int = 2, seq: int = 8) -> dict:
    """Token ids with one padded row (and decoder ids for encoder-decoder models)."""
    config = spec.build().config
    vocab = min(getattr(config, "vocab_size", 128) or 128, 128)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2 :] = 0
    inputs = {"input_ids": ids * mask, "attention_mask": mask}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, vocab, (batch, 4), generator=generator)
    return inputs


def run_check(model: str, world_sizes: list[int]) -> int:
    """Print the report; return the process exit code (0: every world size equivalent)."""
    from tpcore.auto import AutoPolicy, UnsupportedModelError
    from tpcore.policy import ShardingError
    from tpcore.replacer import TensorReplacer

    spec = resolve(model)
    built = spec.build()
    print(f"model: {type(built).__name__} ({sum(p.numel() for p in built.parameters()):,} parameters)")
    entries = AutoPolicy().entries_for(built)
    try:
        policies = [entry.policy for entry in entries] or AutoPolicy().get_policy(built)
    except UnsupportedModelError as error:
        print(error)
        print("FAIL")
        return 2
    source = {e.policy: f"{e.distribution} {e.version}" for e in entries}
    for policy in policies:
        print(f"  policy {policy.policy_name()} from {source.get(policy, 'the config tp plan')}")
    failed = False
    with PoolCache() as pools:
        for world_size in world_sizes:
            try:
                TensorReplacer(built, None, False, world_size, rank=0).validate()  # before any rank starts
            except ShardingError as error:
                failed = True
                print(f"  {world_size} ranks: REFUSED {error}")
                continue
            try:
                diffs = check_equivalence(spec, sample_inputs(spec), world_sizes=(world_size,), pools=pools)
                worst = max(diffs[world_size].items(), key=lambda item: item[1])
                print(f"  {world_size} ranks: PASS (largest difference {worst[1]:.2e} in {worst[0]})")
            except EquivalenceError as error:
                failed = True
                print(f"  {world_size} ranks: FAIL {error}")
            except Exception as error:  # a size that does not split, an unsupported model, ...
                failed = True
                print(f"  {world_size} ranks: ERROR {type(error).__name__}: {str(error).splitlines()[0]}")
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0
