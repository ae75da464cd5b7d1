"""A decode step's matrix products under four weight layouts, on one core: what packing the weights would buy.

``x [M, K] @ W.T`` for the shapes of one rank of the 2-way split SmolLM2-135M (and its whole head), at ``M`` = 1,
8 and 16 rows (a decode step's batch), timed four ways:

- **linear**: ``F.linear(x, W)`` with ``W [N, K]`` row-major (transformers' layout);
- **W.T contiguous**: ``x @ W.T`` with ``W.T`` stored ``[K, N]`` contiguous (tpcore's CPU layout,
  ``tpcore/parallel/cpu_layout.py``);
- **MKL packed**: ``torch.ops.mkl._mkl_linear`` with the weight packed for ``M`` rows beforehand
  (``_mkl_reorder_linear_weight``: what inductor's weight freezing uses for fp32 on the CPU);
- **oneDNN packed**: ``torch.ops.mkldnn._linear_pointwise`` with a weight reordered by oneDNN for ``M`` rows.

Each product is checked against ``F.linear`` (``allclose`` at 1e-4). Median microseconds of ``--rounds`` rounds.
As in a decode step, where each weight is read once and the next layer's is not in the caches yet, every call
takes the next of copies of the weight that together hold at least ``--streamed-mib`` (the weights stream from
memory); ``--streamed-mib 0`` times one weight again and again, from the caches.

    python bench/gemm_layouts.py           # about a minute -> bench/results/gemm_layouts.md
    python bench/gemm_layouts.py --quick   # a smoke run
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import arguments, parse, printed, write_result

#: (what, K, N): rank 0's products of the 2-way split SmolLM2-135M (hidden 576, 5 of 9 query heads, 2 of 3
#: key/value heads of 64, half of intermediate 1536 and of vocabulary 49152)
SHAPES = (
    ("q (5 heads)", 576, 320),
    ("k or v (2 heads)", 576, 128),
    ("attention out (5 heads)", 320, 576),
    ("MLP gate or up (half)", 576, 768),
    ("MLP down (half)", 768, 576),
    ("head (half the vocabulary)", 576, 24576),
)


WAYS = ("linear", "W.T contiguous", "MKL packed", "oneDNN packed")


def microseconds(product: Callable[[], torch.Tensor], calls: int, rounds: int) -> float:
    for _ in range(5):
        product()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            product()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def rotating(calls: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """A product that runs the next of ``calls`` each time (each on its own copy of the weight)."""
    state = {"next": 0}

    def call() -> torch.Tensor:
        state["next"] = (state["next"] + 1) % len(calls)
        return calls[state["next"]]()

    return call


def products(x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, Callable[[], torch.Tensor] | None]:
    """Each way's product of ``x`` with the next of ``weights`` (copies of one weight) at each call."""
    rows = x.shape[0]

    def linear(weight):
        return lambda: F.linear(x, weight)

    def transposed(weight):
        weight_t = weight.t().contiguous()
        return lambda: x @ weight_t

    def mkl(weight):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        return lambda: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)

    def onednn(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=rows)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    ways: dict[str, Callable[[], torch.Tensor] | None] = {}
    for way, make in zip(WAYS, (linear, transposed, mkl, onednn), strict=True):
        try:
            ways[way] = rotating([make(weight) for weight in weights])
        except (AttributeError, RuntimeError):  # this torch build lacks the packing op
            ways[way] = None
    return ways


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, "gemm_layouts", "one round of few calls")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50, help="products timed together in a round")
    parser.add_argument("--streamed-mib", type=int, default=256, help="MiB of weight copies the calls go through")
    args = parse(parser, argv, quick={"rounds": 1, "calls": 3})
    torch.set_num_threads(1)  # a rank's share of the bench machine's cores
    generator = torch.Generator().manual_seed(0)
    header = ["product", "K x N", "M", "linear us", "W.T contiguous us", "MKL packed us", "oneDNN packed us",
              "packed best x W.T", "all equal"]  # fmt: skip
    rows = []
    for what, k, n in SHAPES:
        weight = torch.randn(n, k, generator=generator)
        copies = max(1, args.streamed_mib * 2**20 // (weight.numel() * 4))
        weights = [weight.clone() for _ in range(copies)]
        for m in (1, 8, 16):
            x = torch.randn(m, k, generator=generator)
            reference = F.linear(x, weight)
            timed, equal = {}, True
            for way, product in products(x, weights).items():
                if product is None:
                    continue
                equal &= torch.allclose(product(), reference, rtol=1e-4, atol=1e-4)
                timed[way] = microseconds(product, args.calls, args.rounds)
            packed = [timed[way] for way in ("MKL packed", "oneDNN packed") if way in timed]
            gain = f"{timed['W.T contiguous'] / min(packed):.2f}x" if packed else "-"
            cells = [f"{timed[way]:.0f}" if way in timed else "-" for way in WAYS]
            rows.append([what, f"{k} x {n}", str(m), *cells, gain, str(equal)])
            print(rows[-1], flush=True)
    sections = [
        "One thread. `x [M, K] @ W.T`, median microseconds of "
        f"{args.rounds} rounds of {args.calls} products, each call on the next of copies of the weight that "
        f"together hold {args.streamed_mib} MiB (0: one weight, from the caches).\n\n" + printed(header, rows)
    ]
    write_result("gemm_layouts", "Matrix products of a decode step under four weight layouts", sections, "gloo",
                 args.note, args.output)  # fmt: skip


if __name__ == "__main__":
    main()
