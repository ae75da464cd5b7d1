"""Per-call overhead of the ``tpcore.parallelize()`` proxy against the same split model driven SPMD-style.

Three ways of running one forward pass of a random-init BERT (bert-base widths, fewer layers by
default so the whole run stays within a few minutes on two CPU cores):

- **unsplit**: the whole model in this process (``--threads`` torch threads; ``cuda:0`` with NCCL);
- **SPMD**: the model split over N ranks of a ``tpcore.ranks.process.RankPool`` with ``ParallelEngine``,
  the forward run back to back on the ranks and timed there (no round trip to this process; a
  call's time is the slowest rank's);
- **proxy**: the same model through ``tpcore.parallelize(model, num_gpus=N)``, timed in this
  process around ``model(**inputs)`` (send the inputs, run, bring the output back to the CPU).

The three run interleaved in rounds (so drifting background load hits all of them alike), each
with warm-up calls, under ``torch.inference_mode``; the figures are medians over every timed call.
The proxy overhead is ``proxy - SPMD``. Writes ``bench/results/proxy_overhead.md``.

    python bench/proxy_overhead.py            # about 2-3 minutes on 2 CPU cores
    python bench/proxy_overhead.py --quick    # a smoke run of a few seconds per case
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
from _common import arguments, choose_backend, markdown_table, parse, plain_table, write_result
from _models import BERT_VOCAB, bert_arguments, bert_spec, parameter_count
from _ranks import load_split
from _timing import median_ms, slowest_rank, spread_ms, timed_calls

# --- run on the ranks (module-level, so cloudpickle sends them by value from __main__) -------------


def spmd_time(context, inputs: dict, warmup: int, repeats: int):
    """Run the forward ``warmup + repeats`` times back to back; return each timed call's seconds
    (and rank 0's last output, to check it against the unsplit model)."""
    model = context.store["bench_model"]
    inputs = {k: v.to(context.device) for k, v in inputs.items()}
    with torch.inference_mode():
        times, output = timed_calls(lambda: model(**inputs), warmup, repeats, context.device)
    if context.rank != 0:
        return times, None
    context.store["bench_output"] = output
    return times, output.last_hidden_state.cpu()


def noop(context) -> None:
    """An empty call: what one RankPool round trip costs with nothing to send or compute."""


def transport(context, inputs: dict):
    """What the proxy moves, without the forward: take the inputs to the device, send rank 0's last
    output back to the caller as CPU tensors."""
    inputs = {k: v.to(context.device) for k, v in inputs.items()}
    if context.rank != 0:
        return None
    output = context.store["bench_output"]
    return type(output)(**{k: v.cpu() for k, v in output.items()})


# --- caller side -------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    batch: int
    seq: int
    warmup: int
    repeats: int  # timed calls per round and way
    transport_repeats: int


def make_inputs(batch: int, seq: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(batch * 1000 + seq)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if batch > 1:  # some padding, as a tokenizer gives for sentences of different lengths
        attention_mask[-1, seq // 2 :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def time_local(model, inputs: dict, warmup: int, repeats: int, device: torch.device):
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.inference_mode():
        times, output = timed_calls(lambda: model(**inputs), warmup, repeats, device)
    return times, output.last_hidden_state.cpu()


def time_proxy(model, inputs: dict, warmup: int, repeats: int):
    """Timed in the caller: CPU inputs in, CPU outputs back, as a user of parallelize() sees it."""
    with torch.inference_mode():
        times, output = timed_calls(lambda: model(**inputs), warmup, repeats)
    return times, output.last_hidden_state


def time_transport(pool, inputs: dict, repeats: int) -> tuple[list[float], int]:
    times, output = timed_calls(lambda: pool.run(transport, inputs)[0], 2, repeats)
    moved = sum(t.numel() * t.element_size() for t in [*inputs.values(), *output.values()])
    return times, moved


def quartiles_ms(seconds: list[float]) -> str:
    return spread_ms(seconds, digits=2, method="exclusive")


def parse_args(argv=None):
    parser = arguments(__doc__, "proxy_overhead", "1 round, few calls, 2 layers")
    parser.add_argument("--ranks", type=int, default=2, help="ranks N of the split model (default 2)")
    bert_arguments(parser, 4, "encoder layers (bert-base has 12; default 4)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the unsplit run (default 2)")
    parser.add_argument("--backend", default=None, help="gloo or nccl; default: NCCL with a GPU per rank, else gloo")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the three ways (default 10)")
    parser.add_argument("--small", default="1x8", help="small input, BATCHxSEQ (default 1x8)")
    parser.add_argument("--large", default="8x256", help="large input, BATCHxSEQ (default 8x256)")
    parser.add_argument("--small-repeats", type=int, default=10, help="timed calls per round and way (default 30)")
    parser.add_argument("--large-repeats", type=int, default=1, help="timed calls per round and way (default 4)")
    return parse(parser, argv, quick={"rounds": 2, "small_repeats": 5, "large_repeats": 1, "layers": 2})


def parse_shape(text: str) -> tuple[int, int]:
    batch, seq = (int(part) for part in text.lower().split("x"))
    return batch, seq


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tpcore
    from tpcore.ranks.process import RankPool

    backend = choose_backend(args.backend, args.ranks)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    spec = bert_spec(args.layers, args.hidden, args.heads)
    small, large = parse_shape(args.small), parse_shape(args.large)
    cases = [
        Case("small", *small, warmup=5, repeats=args.small_repeats, transport_repeats=50),
        Case("large", *large, warmup=1, repeats=args.large_repeats, transport_repeats=20),
    ]
    threads_per_rank = max(1, (os.cpu_count() or 1) // args.ranks)

    unsplit = spec.build().to(device)
    served = spec.build()
    parameters = parameter_count(unsplit)
    print(
        f"BertModel {args.layers} layers, hidden {args.hidden}, {args.heads} heads: {parameters / 1e6:.1f} M parameters"
    )
    print(f"backend {backend}, N={args.ranks} ranks ({threads_per_rank} torch threads each on CPU), unsplit run on")
    print(f"{device} with {args.threads} threads; {args.rounds} interleaved rounds\n")

    started = time.perf_counter()
    spmd_pool = RankPool(args.ranks, backend)
    spmd_pool.run(load_split, spec)
    tpcore.parallelize(served, num_gpus=args.ranks, backend=backend)
    setup_s = time.perf_counter() - started
    times: dict[tuple[str, str], list[float]] = {}
    paired: dict[str, list[float]] = {}  # per round: median proxy - median SPMD
    moved: dict[str, tuple[list[float], int]] = {}
    diffs: dict[str, float] = {}
    try:
        for case in cases:
            inputs = make_inputs(case.batch, case.seq, BERT_VOCAB)
            for round_ in range(args.rounds):
                warmup = case.warmup if round_ == 0 else 0  # the three stay warm between rounds
                local, reference = time_local(unsplit, inputs, warmup, case.repeats, device)
                results = spmd_pool.run(spmd_time, inputs, warmup, case.repeats)
                spmd = slowest_rank([rank_times for rank_times, _ in results])
                proxy, proxied = time_proxy(served, inputs, warmup, case.repeats)
                for way, values in (("unsplit", local), ("spmd", spmd), ("proxy", proxy)):
                    times.setdefault((case.name, way), []).extend(values)
                paired.setdefault(case.name, []).append(statistics.median(proxy) - statistics.median(spmd))
                diffs[case.name] = max(
                    diffs.get(case.name, 0.0),
                    (results[0][1] - reference).abs().max().item(),
                    (proxied - reference).abs().max().item(),
                )
                print(
                    f"  {case.name} {case.batch}x{case.seq} round {round_ + 1}: unsplit {median_ms(local):.2f} ms, "
                    f"SPMD {median_ms(spmd):.2f} ms, proxy {median_ms(proxy):.2f} ms"
                )
            moved[case.name] = time_transport(spmd_pool, inputs, case.transport_repeats)
        pool = served._tpcore_handle.pool
        roundtrip, _ = timed_calls(lambda: pool.run(noop), 3, 100 if not args.quick else 10)
    finally:
        served.deparallelize()
        spmd_pool.close()

    header = [
        "input (batch x seq)",
        "calls",
        "unsplit ms",
        f"SPMD N={args.ranks} ms",
        f"proxy N={args.ranks} ms",
        "proxy - SPMD ms",
        "paired proxy - SPMD ms",
        "proxy / SPMD",
        "SPMD / unsplit",
        "proxy / unsplit",
        "max abs diff",
    ]
    rows = []
    for case in cases:
        ms = {way: median_ms(times[(case.name, way)]) for way in ("unsplit", "spmd", "proxy")}
        rows.append(
            [
                f"{case.name} ({case.batch} x {case.seq})",
                str(len(times[(case.name, "proxy")])),
                f"{ms['unsplit']:.2f}",
                f"{ms['spmd']:.2f}",
                f"{ms['proxy']:.2f}",
                f"{ms['proxy'] - ms['spmd']:+.2f}",
                f"{statistics.median(paired[case.name]) * 1e3:+.2f}",
                f"{ms['proxy'] / ms['spmd']:.3f}",
                f"{ms['spmd'] / ms['unsplit']:.3f}",
                f"{ms['proxy'] / ms['unsplit']:.3f}",
                f"{diffs[case.name]:.1e}",
            ]
        )
    spread_header = ["input (batch x seq)", "unsplit p25 - p75 ms", "SPMD p25 - p75 ms", "proxy p25 - p75 ms"]
    spread_rows = [
        [f"{case.name} ({case.batch} x {case.seq})"]
        + [quartiles_ms(times[(case.name, way)]) for way in ("unsplit", "spmd", "proxy")]
        for case in cases
    ]
    transport_header = ["input (batch x seq)", "bytes in + out", "transport alone ms (p25 - p75)"]
    transport_rows = [
        [
            f"{case.name} ({case.batch} x {case.seq})",
            f"{moved[case.name][1] / 2**20:.2f} MiB",
            f"{median_ms(moved[case.name][0]):.2f} ({quartiles_ms(moved[case.name][0])})",
        ]
        for case in cases
    ]
    roundtrip_ms = median_ms(roundtrip)
    print()
    print(plain_table(header, rows))
    print()
    print(plain_table(transport_header, transport_rows))
    print(f"\nempty RankPool call (round trip, nothing to compute): {roundtrip_ms:.3f} ms median")
    print(f"setup (spawn, load and split both the SPMD pool and the proxy): {setup_s:.1f} s")

    model_line = (
        f"Random-init `BertModel`: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"intermediate {4 * args.hidden}, vocab 30522 ({parameters / 1e6:.1f} M parameters), fp32."
    )
    how = (
        f"Backend `{backend}`, N={args.ranks} ranks ({threads_per_rank} torch thread(s) per CPU rank, the "
        f"`RankPool`/`parallelize()` default); the unsplit model runs in the caller on `{device}` with "
        f"{args.threads} threads. Medians over {args.rounds} interleaved rounds: "
        f"{args.rounds * cases[0].repeats} / {args.rounds * cases[1].repeats} timed calls per way "
        f"(small / large), after {cases[0].warmup} / {cases[1].warmup} warm-up calls per way, "
        "under `torch.inference_mode`. "
        "SPMD: timed on the ranks, back to back, a call's time is the slowest rank's. Proxy: timed in the "
        "caller around `model(**inputs)` with CPU tensors in and out. Max abs diff: the SPMD and proxy "
        "`last_hidden_state` against the unsplit model's. 'Paired': the median over rounds of "
        "(proxy median - SPMD median) within each round, which cancels load that drifts between rounds."
    )
    results_table = markdown_table(header, rows)
    extra = (
        f"An empty `RankPool.run` (the bare round trip: no inputs, no output, no compute): "
        f"**{roundtrip_ms:.3f} ms** median over {len(roundtrip)} calls. Setup (spawn, load and split both "
        f"the SPMD pool and the proxy): {setup_s:.1f} s."
    )
    write_result(
        "proxy_overhead",
        "Proxy overhead of `tpcore.parallelize()` against SPMD",
        [
            model_line + "\n\n" + how,
            "## Median per call\n\n" + results_table,
            "Spread of the timed calls (how noisy the machine was):\n\n" + markdown_table(spread_header, spread_rows),
            "## Where the overhead goes\n\n"
            "'Transport alone' is a `RankPool` call that does what the proxy does around the forward, without "
            "the forward: it sends the same inputs to every rank and brings rank 0's last output (the same "
            "`ModelOutput`) back as CPU tensors. It needs no compute, so it is far less sensitive to the "
            "machine's load than the difference of two forward timings.\n\n"
            + markdown_table(transport_header, transport_rows),
            extra,
        ],
        backend,
        args.note,
        args.output,
    )


if __name__ == "__main__":
    main()
