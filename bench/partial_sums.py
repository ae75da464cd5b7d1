"""Row-parallel partial sums in bf16: summed in bf16, or in fp32 and rounded once?

A row-parallel layer's ranks each compute ``x_r @ W_r.T`` (rounded to bf16 by the matmul) and
all-reduce the partials. Summed in bf16, every addition rounds again; upcast to fp32, the sum is
exact for two ranks and rounded once, and the all-reduce moves twice the bytes.

Random-init tiny Llama (grouped KV heads) and GPT-2 (seed 0), split over N gloo ranks in bf16
(``ParallelEngine(dtype=torch.bfloat16)``, as ``from_pretrained(dtype=...)`` casts), each way run
on the same ranks: tpcore's ``reduce_partial_sums`` replaced by a bf16 and by an fp32 variant.
Reported: max abs diff of the logits against the unsplit bf16 model and against the unsplit fp32
model, the median ms of a forward on the ranks, and the bytes one row all-reduce moves per token.
"""

from __future__ import annotations

import os
import statistics

import torch
from _common import arguments, markdown_table, parse, plain_table, write_result
from _ranks import load_split
from _timing import timed_calls

WAYS = ("bf16", "fp32")


def reduce_in(way: str):
    """A ``reduce_partial_sums`` that sums in ``way``'s dtype and returns the partial's dtype."""
    from tpcore.parallel.comm import all_reduce

    def reduce_partial_sums(partial: torch.Tensor, group) -> torch.Tensor:
        if way == "fp32":
            return all_reduce(partial.float(), group).to(partial.dtype)
        return all_reduce(partial, group)

    return reduce_partial_sums


def rank_logits(context, spec, inputs: dict, repeats: int) -> dict:
    """On a rank: split ``spec`` in bf16, then per way the logits (rank 0) and the forward's ms."""
    from tpcore.parallel import layers

    load_split(context, spec, dtype=torch.bfloat16)
    model = context.store["bench_model"]
    results = {}
    for way in WAYS:
        layers.reduce_partial_sums = reduce_in(way)
        with torch.inference_mode():
            times, logits = timed_calls(lambda: model(**inputs).logits, 1, repeats)
        results[way] = (logits.float() if context.rank == 0 else None, statistics.median(times) * 1e3)
    return results


def diffs(logits: torch.Tensor, bf16: torch.Tensor, fp32: torch.Tensor) -> list[str]:
    """Max abs diff against the unsplit bf16 logits; max and mean abs diff against the fp32 ones."""
    off = (logits - fp32).abs()
    return [f"{(logits - bf16).abs().max():.4f}", f"{off.max():.4f}", f"{off.mean():.5f}"]


def specs():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from tpcore.testing import ModelSpec

    llama = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    gpt2 = GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=8, n_positions=256)
    return {"Llama": ModelSpec(LlamaForCausalLM, llama), "GPT-2": ModelSpec(GPT2LMHeadModel, gpt2)}


def main(argv=None) -> None:
    parser = arguments(__doc__, "partial_sums", "N=2, 2 timed forwards")
    parser.add_argument("--ranks", default="2,4", help="world sizes dividing 4 (KV heads), comma-separated")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per way (default 10)")
    args = parse(parser, argv, quick={"ranks": "2", "repeats": 2})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tpcore.load.precision import cast_model
    from tpcore.ranks.process import RankPool

    generator = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, 1000, (args.batch, args.seq), generator=generator)}
    references, rows = {}, []
    for name, spec in specs().items():
        with torch.inference_mode():
            model = spec.build()
            fp32 = model(**inputs).logits
            bf16 = cast_model(model, torch.bfloat16)(**inputs).logits.float()
        references[name] = bf16, fp32, model.config.hidden_size
        rows.append([name, "1", "(unsplit bf16)", *diffs(bf16, bf16, fp32), "-", "-", "-"])
    for world_size in (int(n) for n in args.ranks.split(",")):
        with RankPool(world_size, "gloo") as pool:
            for name, spec in specs().items():
                bf16, fp32, hidden = references[name]
                split = pool.run(rank_logits, spec, inputs, args.repeats)[0]
                for way, (logits, ms) in split.items():
                    same = "yes" if torch.equal(logits, split["bf16"][0]) else "no"
                    moved = hidden * (4 if way == "fp32" else 2)
                    rows.append([name, str(world_size), way, *diffs(logits, bf16, fp32), same, f"{ms:.1f}", str(moved)])
                    print(plain_table(HEADER, rows[-1:]))
    rows.sort(key=lambda row: (row[0], row[1]))
    print("\n" + plain_table(HEADER, rows))
    text = (
        f"Random-init {', '.join(specs())} (hidden 256, 4 layers, 8 heads; Llama 4 KV heads; vocab 1000, seed 0), "
        f"inputs {args.batch} x {args.seq} random ids; split over N gloo ranks in bf16 (cores // N torch threads "
        f"per rank, at least 1; {os.cpu_count()} cores). Abs diff of the logits (scale about 1) against the "
        "unsplit model cast the same way (bf16) and against it in fp32; 'same bits': the logits equal those of "
        f"bf16 sums; forward ms: median of {args.repeats} on rank 0 (a shared machine; on CPU compute dominates); "
        "bytes: what one row-parallel all-reduce moves per token and rank.\n\n" + markdown_table(HEADER, rows)
    )
    write_result("partial_sums", "Row-parallel partial sums in bf16 or fp32", [text], "gloo", args.note, args.output)


HEADER = [
    "model",
    "N",
    "partial sums",
    "max diff vs bf16",
    "max diff vs fp32",
    "mean diff vs fp32",
    "same bits",
    "forward ms",
    "bytes/token",
]

if __name__ == "__main__":
    main()
