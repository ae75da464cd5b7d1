"""Quantized checkpoints split as stored: bytes per rank, load time and greedy decode, against transformers.

A random-init Llama of SmolLM2-135M's widths (``--layers``, 30 by default) saved in a quantized format
(``--format``), the LM head kept in fp32:

- ``fp8`` (default): block FP8 (``tpcore.testing.quantized_checkpoints.save_block_fp8``: DeepSeek-V3's layout,
  blocks of ``--block``, 64 by default so that its 576 and 1536 features make whole blocks, as transformers' CPU
  dequantization needs);
- ``w4a16``: compressed-tensors' pack-quantized int4 (``save_pack_quantized``: llmcompressor's W4A16 layout,
  groups of ``--group``, 64 by default since 576 features are not whole groups of 128), written by
  compressed-tensors itself;
- ``nvfp4``: compressed-tensors' ``NVFP4A16`` (e2m1 values two a byte, an e4m3 scale per 16 features, a global
  scale per tensor), both ways in bfloat16;
- ``fp8-dynamic``: compressed-tensors' ``FP8_DYNAMIC`` (e4m3 weights, a scale a row, each token's input rounded
  through e4m3 as it runs);
- ``fp8-block``: compressed-tensors' ``FP8_BLOCK`` (e4m3 weights, a scale per block of ``--block`` x ``--block``,
  each token's input rounded through e4m3 per group of ``--block`` features);
- ``w8a8``: compressed-tensors' ``W8A8`` (the same with int8);
- ``int8``: torchao's ``Int8WeightOnlyConfig`` (int8 values, a scale per row), quantized and saved by transformers'
  ``TorchAoConfig``; ``float8``: its ``Float8WeightOnlyConfig`` (e4m3 values, a scale per row), the same way;
- ``llm-int8``: bitsandbytes 8-bit (LLM.int8(): int8 rows, inputs rounded per token through int8, outlier columns
  of 6 or more in the input's dtype), quantized and saved by transformers' ``BitsAndBytesConfig``;
- ``nf4``: bitsandbytes 4-bit NF4 with nested block scales (``bnb_4bit_use_double_quant``), the same way;
- ``gptq``: GPTQ v1 4-bit, symmetric, groups of ``--group`` (``save_gptq``: packed by GPTQModel's own packer),
  loaded by transformers through optimum and GPTQModel, both ways in bfloat16; ``awq``: AWQ 4-bit (AutoAWQ's GEMM
  layout, ``save_awq``), the same way;
- ``mxfp4``: gpt-oss's MXFP4 experts (``save_mxfp4``), on a gpt-oss of the same widths (8 experts of 576 features,
  2 a token; attention, router and embeddings plain), which transformers dequantizes at load on a CPU;
- ``fp8-moe``: block FP8 (``save_block_fp8``, blocks of ``--block``) on a Qwen3-MoE of the same widths (8 experts of
  576 features, 2 a token), every expert stored per expert as DeepSeek-V3's and Qwen3-MoE FP8's releases are.

Two ways, one after the other in this process, each loading the directory ``--rounds`` times (median):

- **transformers**: ``AutoModelForCausalLM.from_pretrained(dir)`` (``--threads`` torch threads, default 2), which on
  a CPU dequantizes block FP8 at load, decompresses pack-quantized integers in its first forward, computes int8
  with torchao's tensor subclass and bitsandbytes' layers with its own products (4-bit: its dequantizing product,
  its fused bfloat16 CPU kernel turned off as in the tests, since it rounds the inputs to bfloat16; with ``nf4`` a
  further row decodes with that kernel, transformers' default, its tokens compared with the dequantizing product's;
  GPTQ: GPTQModel's torch kernel, as the tests, and a further row with its default CPU kernel, ``TorchAtenLinear``:
  torch's int4 matrix product, scales rounded to bfloat16);
- **tpcore**: ``tpcore.parallelize(dir, num_gpus=N)`` (gloo, the cores split between the ranks): each rank reads
  its part of the quantized values (and the scales it needs), and dequantizes a layer at a time in each forward;
  GPTQ and AWQ as transformers computes them by default (torch's int4 product on the rank's words), so their tokens
  are compared with that further row's.

A third way splits the same model saved unquantized (fp32) over 2 ranks: what starting the ranks and a split
decode cost without quantization. Figures: the bytes each way keeps (transformers: its parameters; tpcore: the
largest rank's, from its plan) against the checkpoint's quantized bytes, the wall time from the load to the end of a
first one-token forward (where transformers decompresses pack-quantized layers), and greedy decode of
``--new-tokens`` tokens after a 32-token prompt at batch 1 (tok/s, and whether the tokens are equal).

    python bench/quantized.py                   # about 3 minutes on 2 CPU cores -> bench/results/quantized.md
    python bench/quantized.py --format w4a16    # -> bench/results/quantized_w4a16.md
    python bench/quantized.py --format w4a16 --bfloat16  # -> bench/results/quantized_w4a16_bf16.md
    python bench/quantized.py --format int8     # -> bench/results/quantized_int8.md
    python bench/quantized.py --format float8   # -> bench/results/quantized_float8.md
    python bench/quantized.py --format nvfp4    # -> bench/results/quantized_nvfp4.md
    python bench/quantized.py --format fp8-dynamic  # -> bench/results/quantized_fp8-dynamic.md
    python bench/quantized.py --format fp8-block  # -> bench/results/quantized_fp8-block.md
    python bench/quantized.py --format w8a8     # -> bench/results/quantized_w8a8.md
    python bench/quantized.py --format llm-int8  # -> bench/results/quantized_llm-int8.md
    python bench/quantized.py --format nf4      # -> bench/results/quantized_nf4.md
    python bench/quantized.py --format gptq     # -> bench/results/quantized_gptq.md
    python bench/quantized.py --format awq      # -> bench/results/quantized_awq.md
    python bench/quantized.py --format mxfp4    # -> bench/results/quantized_mxfp4.md
    python bench/quantized.py --format fp8-moe  # -> bench/results/quantized_fp8-moe.md
    python bench/quantized.py --quick           # a smoke run
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import arguments, parse, printed, write_result
from _models import gpt_oss_spec, qwen3_moe_spec, smollm2_spec

import tpcore
from tpcore.testing.quantized_checkpoints import (
    dequantizing,
    save_awq,
    save_block_fp8,
    save_float8_weight_only,
    save_four_bit,
    save_fp8_block,
    save_fp8_dynamic,
    save_gptq,
    save_int8_weight_only,
    save_llm_int8,
    save_mxfp4,
    save_nvfp4,
    save_pack_quantized,
    save_w8a8,
)

#: each format's saver, its name in the tables, and what transformers holds of it on a CPU
FORMATS = {
    "fp8": (
        lambda model, directory, args: save_block_fp8(model, directory, (args.block, args.block)),
        "block FP8",
        "dequantized at load",
    ),
    "w4a16": (
        lambda model, directory, args: save_pack_quantized(model, directory, 4, args.group),
        "W4A16",
        "decompressed in its first forward",
    ),
    "nvfp4": (
        lambda model, directory, args: save_nvfp4(model, directory),
        "NVFP4A16",
        "decompressed in its first forward, bfloat16",
    ),
    "fp8-dynamic": (
        lambda model, directory, args: save_fp8_dynamic(model, directory),
        "FP8_DYNAMIC",
        "decompressed in its first forward",
    ),
    "fp8-block": (
        lambda model, directory, args: save_fp8_block(model, directory, args.block),
        "FP8_BLOCK",
        "decompressed in its first forward",
    ),
    "w8a8": (
        lambda model, directory, args: save_w8a8(model, directory),
        "W8A8",
        "decompressed in its first forward",
    ),
    "int8": (
        lambda model, directory, args: save_int8_weight_only(model, directory),
        "torchao int8 weight-only",
        "torchao's Int8Tensor",
    ),
    "float8": (
        lambda model, directory, args: save_float8_weight_only(model, directory),
        "torchao float8 weight-only",
        "torchao's Float8Tensor",
    ),
    "llm-int8": (
        lambda model, directory, args: save_llm_int8(model, directory),
        "bitsandbytes 8-bit",
        "bitsandbytes' Linear8bitLt",
    ),
    "nf4": (
        lambda model, directory, args: save_four_bit(model, directory, "nf4", nested=True),
        "bitsandbytes NF4",
        "bitsandbytes' Linear4bit",
    ),
    "gptq": (
        lambda model, directory, args: save_gptq(model, directory, 4, args.group),
        "GPTQ 4-bit",
        "GPTQModel's torch kernel",
    ),
    "awq": (
        lambda model, directory, args: save_awq(model, directory, args.group),
        "AWQ 4-bit",
        "GPTQModel's AWQ torch kernel",
    ),
    "mxfp4": (lambda model, directory, args: save_mxfp4(model, directory), "MXFP4 experts", "dequantized at load"),
    "fp8-moe": (
        lambda model, directory, args: save_block_fp8(model, directory, (args.block, args.block)),
        "block FP8",
        "dequantized at load",
    ),
}
#: the model each format is saved from where it is not the Llama (``smollm2_spec``), and its name in the tables
MODELS = {
    "mxfp4": (gpt_oss_spec, "gpt-oss (8 experts of 576 features, 2 a token)"),
    "fp8-moe": (qwen3_moe_spec, "Qwen3-MoE (8 experts of 576 features, 2 a token)"),
}


def reference_options(form: str) -> dict:
    """``from_pretrained`` options of the transformers way: GPTQ and AWQ through GPTQModel's torch kernels in
    bfloat16 (the dequantizing products; a further row decodes with the default kernel, whose product tpcore's ranks
    compute), NVFP4 in bfloat16 (transformers' float32 forward fails on it), every other format as transformers loads it
    by default."""
    import transformers

    kernels = {
        "gptq": lambda: transformers.GPTQConfig(bits=4, backend="torch"),
        "awq": lambda: transformers.AwqConfig(bits=4, backend="torch_awq"),
    }
    if form == "nvfp4":  # transformers decompresses NVFP4 to bfloat16 and runs in float32 with it no further
        return {"dtype": torch.bfloat16}
    return {"dtype": torch.bfloat16, "quantization_config": kernels[form]()} if form in kernels else {}


#: what transformers computes by default where the reference is another kernel: a further row decodes with it
DEFAULT_KERNELS = {
    "nf4": ("its default CPU kernel: bfloat16 where the CPU has AVX-512-BF16", {}),
    "gptq": ("GPTQModel's default CPU kernel: torch's int4 product in bfloat16", {"dtype": torch.bfloat16}),
    "awq": ("GPTQModel's default CPU kernel: torch's int4 product in bfloat16", {"dtype": torch.bfloat16}),
}


#: the formats whose ranks compute as transformers' default kernel does: their tokens are compared with its
SPLIT_AS_DEFAULT = ("gptq", "awq")


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds: a tensor subclass's (torchao's ``Int8Tensor``) inner tensors', else its own."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)
    return tensor.numel() * tensor.element_size()


def timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def ready(model, ids: torch.Tensor):
    """``model`` once it has run a one-token forward: transformers decompresses pack-quantized layers there."""
    with torch.no_grad():
        model(ids[:, :1])
    return model


def decode(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """tok/s of greedy ``generate`` (after one warm-up call) and its tokens."""
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    seconds, tokens = timed(
        lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    )
    return new_tokens / seconds, tokens


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "quantized", "2 layers, 1 round, 4 new tokens")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--format", choices=sorted(FORMATS), default="fp8")
    parser.add_argument("--block", type=int, default=64, help="fp8 and fp8-block: the blocks' side")
    parser.add_argument("--group", type=int, default=64, help="w4a16 and gptq: input features a scale")
    parser.add_argument("--world-sizes", default="2,3", help="tpcore's rank counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the transformers way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--bfloat16", action="store_true", help="both ways in bfloat16 (w4a16: the ranks' int4 product)"
    )
    args = parse(parser, argv, quick={"layers": 2, "rounds": 1, "new_tokens": 4, "world_sizes": "2"})
    torch.set_num_threads(args.threads)
    import transformers

    ids = torch.randint(2, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        save, name, held_as = FORMATS[args.format]
        spec, model_name = MODELS.get(args.format, (smollm2_spec, "Llama"))
        directory = save(spec(args.layers).build(), Path(scratch) / args.format, args)
        stored = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        options = reference_options(args.format) | ({"dtype": torch.bfloat16} if args.bfloat16 else {})
        loads = [timed(lambda: ready(dequantizing(transformers.AutoModelForCausalLM.from_pretrained(
                 directory, **options).eval()), ids)) for _ in range(3)]  # fmt: skip
        reference = loads[-1][1]
        speed, expected = decode(reference, ids, args.new_tokens)
        held = sum(tensor_bytes(t) for t in reference.state_dict().values())  # once it has computed
        load = statistics.median(seconds for seconds, _ in loads)
        rows.append([f"transformers ({held_as})", "1", f"{held / 2**20:.0f}", f"{held / stored:.2f}",
                     f"{load:.2f}", "1.00", f"{speed:.1f}", "-"])  # fmt: skip
        del reference, loads
        if args.format in DEFAULT_KERNELS:  # what transformers computes by default, where the reference is another
            kernel, kernel_options = DEFAULT_KERNELS[args.format]
            fused = transformers.AutoModelForCausalLM.from_pretrained(directory, **kernel_options).eval()
            fused_speed, fused_tokens = decode(fused, ids, args.new_tokens)
            rows.append([f"transformers ({kernel})", "1", "-", "-", "-", "-", f"{fused_speed:.1f}",
                         str(torch.equal(fused_tokens, expected))])  # fmt: skip
            del fused
            if args.format in SPLIT_AS_DEFAULT:
                expected = fused_tokens
        plain = Path(scratch) / "fp32"
        spec(args.layers).build().save_pretrained(plain)  # the same model unquantized: the split's own costs
        ways = [(f"tpcore N={n} ({name} on the ranks)", directory, n) for n in map(int, args.world_sizes.split(","))]
        ways.append(("tpcore N=2, the model saved unquantized (fp32)", plain, 2))
        for way, source, world_size in ways:
            times = []
            for _ in range(args.rounds):
                dtype = options.get("dtype") if source == directory else None
                seconds, model = timed(
                    lambda: ready(tpcore.parallelize(str(source), num_gpus=world_size, dtype=dtype), ids)  # noqa: B023
                )
                times.append(seconds)
                if len(times) < args.rounds:
                    model.deparallelize()
            try:
                plan = model._tpcore_handle.plan
                largest = max(plan.bytes_per_rank(rank) for rank in range(world_size))
                speed, tokens = decode(model, ids, args.new_tokens)
            finally:
                model.deparallelize()
            split_load = statistics.median(times)
            same = str(torch.equal(tokens, expected)) if source == directory else "-"
            rows.append([way, str(world_size), f"{largest / 2**20:.0f}", f"{largest / stored:.2f}", f"{split_load:.2f}",
                         f"{split_load / load:.2f}", f"{speed:.1f}", same])  # fmt: skip
            print(rows[-1], flush=True)
    header = [
        "way",
        "ranks",
        "MiB kept (largest rank)",
        "of the checkpoint's bytes",
        "load + first forward s",
        "load vs transformers",
        "decode tok/s",
        "same tokens",
    ]
    sections = [
        f"{model_name} of SmolLM2-135M's widths, {args.layers} layers, random init, saved in {name} ("
        + {
            "fp8": f"blocks of {args.block} x {args.block}",
            "fp8-moe": f"blocks of {args.block} x {args.block}, the experts too",
            "fp8-block": f"blocks of {args.block} x {args.block}, inputs rounded per group of {args.block}",
            "w4a16": f"int4 in groups of {args.group}",
            "nvfp4": "e2m1 in groups of 16, a global scale per tensor",
            "nf4": "blocks of 64, nested scales",
            "gptq": f"symmetric int4 in groups of {args.group}, bfloat16",
            "awq": f"int4 with zero points in groups of {args.group}, bfloat16",
            "mxfp4": "the experts' weights; attention, router and embeddings in fp32",
        }.get(args.format, "a scale a row")
        + f", the LM head in fp32): {stored / 2**20:.0f} MiB of safetensors. Loads: median of "
        f"3 (transformers) and {args.rounds} (tpcore); decode: greedy, {args.new_tokens} new tokens after a 32-token "
        f"prompt, batch 1; transformers on {args.threads} threads in this process"
        + ("; both ways run in bfloat16 (`dtype=`)." if args.bfloat16 else "."),
        printed(header, rows),
    ]
    result = ("quantized" if args.format == "fp8" else f"quantized_{args.format}") + ("_bf16" if args.bfloat16 else "")
    write_result(result, f"Quantized checkpoints split as stored: {name}", sections, "gloo", args.note, args.output)


if __name__ == "__main__":
    main()
