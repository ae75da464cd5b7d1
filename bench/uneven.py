"""What each rank holds when the world size does not divide the head counts.

Two parts:

- **Plans of real shapes**, built on the meta device (no weights, no ranks): SmolLM2-135M (9 query,
  3 key/value heads), Qwen2.5-0.5B (14 and 2), GPT-2 XL (25 heads) and bert-base (12 heads) over
  2-5 ranks. For each: the heads each rank holds, each rank's tensor bytes from the shard plan, the
  largest rank against an equal share (``max / (whole / N)``) and the bound tpcore promises: no rank
  more than one head (one key/value group) per cut tensor above an equal share.
- **Measured on ranks**: a random-init model of SmolLM2's widths (4 layers by default) through
  ``tpcore.parallelize()`` over 2 and 3 ranks: each rank's ``memory_allocated()`` against the plan's
  bytes for that rank, and the largest absolute difference of any output from the unsplit model.

Writes ``bench/results/uneven.md``.

    python bench/uneven.py              # under a minute on 2 CPU cores (needs tp-gpt and tp-bert)
"""

from __future__ import annotations

import copy
import math

from _common import MIB, arguments, choose_backend, markdown_table, parse, plain_table, write_result
from _models import SMOLLM2_135M

SHAPES = {
    "SmolLM2-135M": ("LlamaForCausalLM", "LlamaConfig", dict(SMOLLM2_135M, tie_word_embeddings=True)),
    "Qwen2.5-0.5B": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
            num_hidden_layers=24, vocab_size=151936, tie_word_embeddings=True,
        ),
    ),
    "GPT-2 XL": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=1600, n_head=25, n_layer=48, vocab_size=50257)),
    "bert-base": ("BertModel", "BertConfig", dict()),
}  # fmt: skip


def plan_for(name: str, world_size: int):
    import torch
    import transformers

    import tpcore

    model_class, config_class, sizes = SHAPES[name]
    with torch.device("meta"):
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**sizes))
    return tpcore.TensorReplacer(model, None, False, world_size, rank=0).split_plan()


def heads_by_rank(plan) -> str:
    """The heads each rank holds of the first tensor the plan cuts by heads (the first query projection)."""
    for name, split in plan.splits.items():
        if split.heads:
            segments = 1 if split.interleaved else split.n_fused
            head_size = plan.shapes[name][split.dim] // (segments * split.heads)
            rows = [plan.shard_shape(name, rank)[split.dim] for rank in range(plan.world_size)]
            return ", ".join(str(r // (segments * head_size)) for r in rows)
    return "-"


def bound(plan) -> int:
    """Bytes of one dealt group (head, key/value group, or feature) of every packed part of every cut tensor."""
    total = 0
    for name, split in plan.splits.items():
        if split.pad:
            continue
        shape = plan.shapes[name]
        size = shape[split.dim]
        segments = len(split.parts) if split.parts else 1 if split.interleaved else split.n_fused
        groups = split.groups or (math.gcd(*split.parts) if split.parts else split.heads or size // segments)
        total += segments * (size // groups) * math.prod(shape) // size * plan.dtypes[name].itemsize
    return total


def plan_rows(world_sizes) -> list[list[str]]:
    rows = []
    for name in SHAPES:
        for world_size in world_sizes:
            plan = plan_for(name, world_size)
            per_rank = [plan.bytes_per_rank(rank) for rank in range(world_size)]
            whole = sum(math.prod(s) * plan.dtypes[n].itemsize for n, s in plan.shapes.items())
            replicated = sum(
                math.prod(s) * plan.dtypes[n].itemsize for n, s in plan.shapes.items() if n not in plan.splits
            )
            equal = (whole - replicated) / world_size + replicated
            excess = max(per_rank) - equal
            rows.append([
                name, str(world_size), heads_by_rank(plan),
                " / ".join(f"{b / MIB:.1f}" for b in per_rank),
                f"{max(per_rank) / (whole / world_size):.3f}",
                f"{excess / MIB:.2f}", f"{bound(plan) / MIB:.2f}", "yes" if excess <= bound(plan) else "NO",
            ])  # fmt: skip
    return rows


def measured_rows(layers: int, world_sizes, backend: str | None) -> list[list[str]]:
    import torch
    import transformers

    import tpcore
    from tpcore.testing import compare_outputs, padded_batch

    _, _, sizes = SHAPES["SmolLM2-135M"]
    config = transformers.LlamaConfig(**{**sizes, "num_hidden_layers": layers, "vocab_size": 8192})
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    inputs = padded_batch([16, 11], 16, config.vocab_size, seed=1, padding="left")
    with torch.inference_mode():
        expected = reference(**inputs)
    rows = []
    for world_size in world_sizes:
        plan = tpcore.TensorReplacer(reference, None, False, world_size, rank=0).split_plan()
        served = tpcore.parallelize(
            copy.deepcopy(reference), num_gpus=world_size, backend=choose_backend(backend, world_size)
        )
        try:
            differences = compare_outputs(expected, served(**inputs))
            allocated = list(served.memory_allocated().values())  # tensor bytes, rank by rank
        finally:
            served.deparallelize()
        for rank in range(world_size):
            rows.append([
                str(world_size), str(rank), f"{allocated[rank] / MIB:.2f}", f"{plan.bytes_per_rank(rank) / MIB:.2f}",
                f"{max(differences.values()):.2e}",
            ])  # fmt: skip
    return rows


def main() -> None:
    parser = arguments(__doc__, "uneven", "1 layer")
    parser.add_argument("--layers", type=int, default=4, help="layers of the measured model (default 4)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    args = parse(parser, quick={"layers": 1})

    header = [
        "model",
        "N",
        "query heads by rank",
        "MiB by rank (plan)",
        "max / (whole / N)",
        "excess MiB",
        "bound MiB",
        "within",
    ]
    plans = plan_rows((2, 3, 4, 5))
    print(plain_table(header, plans))
    measured_header = ["N", "rank", "allocated MiB", "plan MiB", "largest abs difference (all outputs)"]
    measured = measured_rows(args.layers, (2, 3), args.backend)
    print()
    print(plain_table(measured_header, measured))
    sections = [
        "## Shard plans of real shapes (meta device)\n\nexcess: the largest rank's bytes above an equal share of "
        "the cut tensors plus the replicated ones; bound: one dealt group (a head, a key/value group, a feature) of "
        "every packed part of every cut tensor.\n\n" + markdown_table(header, plans),
        f"## Measured: SmolLM2 widths, {args.layers} layers, vocabulary 8192, through parallelize()\n\n"
        + markdown_table(measured_header, measured),
    ]
    write_result(
        "uneven",
        "Uneven splits: what each rank holds",
        sections,
        choose_backend(args.backend, 2),
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
