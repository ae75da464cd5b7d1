"""tpcore side by side with its peers: one Llama checkpoint, five ways of running it, in one invocation.

A random-init Llama of about 100 M parameters (hidden 768, 8 layers, 12 heads, intermediate 2048,
vocab 32000, untied LM head) is built from a seeded config and saved once with ``save_pretrained``
(safetensors) into a temporary folder; every way starts from that checkpoint:

- **unsplit**: ``from_pretrained`` in this process, ``--threads`` torch threads (default: all cores);
- **tpcore SPMD**: in the ranks of a ``tpcore.process.RankPool(2, "gloo")`` (1 thread per rank on
  2 cores), each rank runs ``ParallelEngine(2, "gloo", process_group=context.group)
  .parallelize(checkpoint)``;
- **tpcore parallelize()**: ``tpcore.parallelize(checkpoint, num_gpus=2)``, timed in this process
  (inputs in, outputs back);
- **DTensor TP**: in RankPool ranks, PyTorch's ``parallelize_module`` with ``ColwiseParallel`` for
  q/k/v/gate/up and ``RowwiseParallel`` for o/down over ``init_device_mesh("cpu", (2,))``;
- **HF tp_plan**: in RankPool ranks, ``from_pretrained(checkpoint, distributed_config=
  DistributedConfig(tp_plan="auto"))`` (needs ``accelerate``).

Measured per way: forward latency at batch 1 and 8 (seq 128), greedy ``generate()`` latency per
new token, parameter bytes a rank holds and its peak RSS, checkpoint-to-ready time, collectives
per layer and per forward (``CommDebugMode``), and the largest logit difference from the unsplit
model. A second part splits a random-init GPT-2 (124 M) with ``tpcore.parallelize()`` at N=2 and
N=4 from its checkpoint: a rank's parameter share and the caller's peak RSS. A way that cannot run
is reported as n/a with the reason. Writes ``bench/results/peers.md`` and ``bench/results/peers.png``.

    python bench/peers.py            # about 5-8 minutes on 2 CPU cores
    python bench/peers.py --quick    # tiny models, a trial run of about a minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import cloudpickle
import memory
import torch
from _common import MIB, _version, cpu_busy, load_average, markdown_table, median_ms, plain_table, write_result
from memory import RssSampler, proc_status, reset_peak, settle

# memory.py's helpers also run on the ranks here: send them by value, as the functions of this script.
cloudpickle.register_pickle_by_value(memory)

BACKEND = "gloo"
#: every way runs this attention (tpcore builds a model from a checkpoint with its config's default, sdpa)
ATTENTION = "sdpa"
STORE_KEY = "peers_model"  # where a rank of this script keeps its model (tpcore's proxy uses "model")
PROXY_STORE_KEY = "model"

# --- run on the ranks and in the caller (module-level, so cloudpickle sends them by value) ---------


def tensor_bytes(model) -> int:
    """Bytes of the parameters and buffers this process holds (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def attention(model) -> str:
    """The attention implementation the model's layers use."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "n/a"))


def run_round(model, inputs: dict, plan: dict) -> dict:
    """One round of one way: forward calls at batch 1 and at the large batch, ``generate()`` with 1
    and with ``1 + K`` new tokens; each call's seconds. ``plan["warmup"]``: untimed calls only."""
    import time

    import torch

    def timed(call) -> tuple[float, object]:
        start = time.perf_counter()
        output = call()
        return time.perf_counter() - start, output

    def generate(new_tokens: int):
        return model.generate(
            **inputs["prompt"],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # no early stop at an EOS token
            do_sample=False,
            pad_token_id=0,
        )

    times: dict[str, list[float]] = {"b1": [], "large": [], "gen1": [], "genK": []}
    logits = None
    with torch.inference_mode():
        if plan["warmup"]:
            model(**inputs["b1"])
            model(**inputs["large"])
            generate(2)
            return {"times": times, "logits": None}
        for _ in range(plan["b1_calls"]):
            seconds, output = timed(lambda: model(**inputs["b1"]))
            times["b1"].append(seconds)
            logits = output.logits
        for _ in range(plan["large_calls"]):
            times["large"].append(timed(lambda: model(**inputs["large"]))[0])
        times["gen1"].append(timed(lambda: generate(1))[0])
        times["genK"].append(timed(lambda: generate(1 + plan["new_tokens"]))[0])
    return {"times": times, "logits": logits.float().cpu() if plan["logits"] else None}


def rank_round(context, key: str, inputs: dict, plan: dict) -> dict:
    """``run_round`` on a rank's model; only rank 0 sends logits back."""
    return run_round(context.store[key], inputs, {**plan, "logits": plan["logits"] and context.rank == 0})


def rank_memory(context, key: str) -> dict:
    """A rank's tensor bytes, ``VmRSS`` and ``VmHWM`` (peak RSS since its start or its last reset)."""
    return {"tensor_bytes": tensor_bytes(context.store[key]), **proc_status()}


def rank_collectives(context, key: str, inputs: dict) -> dict:
    """Collectives of one forward, in total and inside the first decoder layer. tpcore's layers count
    their own (``tpcore.comm.count_collectives``: the shared-memory transport bypasses
    ``torch.distributed``); the peers' are seen by ``CommDebugMode`` (DTensor's functional
    collectives and c10d ops such as a plain ``dist.all_reduce``). A cross-check counts the calls
    of the ``torch.distributed`` functions themselves."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from tpcore.comm import count_collectives

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    calls = {"n": 0}

    def counting(function):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return function(*args, **kwargs)

        return wrapper

    model = context.store[key]
    layer0 = next(module for name, module in model.named_modules() if name.endswith("layers.0"))
    snapshots = {}
    hooks = []
    try:
        for name, function in originals.items():
            setattr(dist, name, counting(function))
        with (
            warnings.catch_warnings(),
            torch.inference_mode(),
            CommDebugMode() as mode,
            count_collectives() as own,
        ):
            warnings.simplefilter("ignore")  # "For backward hooks to be called, module output should be a Tensor"
            hooks.append(layer0.register_forward_pre_hook(lambda *_: snapshots.update(before=dict(own))))
            hooks.append(layer0.register_forward_hook(lambda *_: snapshots.update(after=dict(own))))
            model(**inputs)
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        for hook in hooks:
            hook.remove()
    if own:  # tpcore's layers issued them
        before, after = snapshots.get("before", {}), snapshots.get("after", {})
        layer = {op: after.get(op, 0) - before.get(op, 0) for op in after if after.get(op, 0) > before.get(op, 0)}
        by_op, total, counted_by = dict(own), sum(own.values()), "tpcore.comm.count_collectives"
    else:
        layer = {}
        for module_name, counts in mode.comm_module_counts.items():
            if module_name.endswith("layers.0"):
                layer = {str(op): n for op, n in counts["forward"].items()}
        by_op = {str(op): n for op, n in mode.get_comm_counts().items()}
        total, counted_by = mode.get_total_counts(), "CommDebugMode"
    return {
        "total": total,
        "by_op": by_op,
        "layer0": sum(layer.values()),
        "layer0_by_op": layer,
        "dist_calls": calls["n"],
        "counted_by": counted_by,
    }


# --- run on the ranks only -----------------------------------------------------------------------------


def save_checkpoints(context, models: list, seed: int) -> list[dict]:
    """Build each seeded random-init model and ``save_pretrained`` it (safetensors) into its folder."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    figures = []
    for config, directory in models:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(directory)
        figures.append(
            {
                "parameters": sum(p.numel() for p in model.parameters()),
                "bytes": tensor_bytes(model),
                "class": type(model).__name__,
            }
        )
        del model
    return figures


def load_tpcore(context, checkpoint: str, attn: str):
    """``ParallelEngine.parallelize`` of the checkpoint folder: each rank reads only its slices
    (with the config's default attention, sdpa)."""
    from tpcore import ParallelEngine

    engine = ParallelEngine(context.world_size, context.backend, process_group=context.group)
    return engine.parallelize(checkpoint)


def load_dtensor(context, checkpoint: str, attn: str):
    """PyTorch's native TP: colwise q/k/v/gate/up, rowwise o/down, over a 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (context.world_size,))  # over the default (gloo) group the ranks joined
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=attn).eval().requires_grad_(False)
    plan = {f"model.layers.*.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"model.layers.*.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")}
    plan |= {"model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, mesh, plan, src_data_rank=None)  # every rank loaded the weights: no scatter
    for layer in model.model.layers:  # local head counts, for attention classes that store them
        for name in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(layer.self_attn, name, None), int):
                setattr(layer.self_attn, name, getattr(layer.self_attn, name) // context.world_size)
    return model


def load_hf_tp(context, checkpoint: str, attn: str):
    """transformers' own TP (the config's ``base_model_tp_plan``) in the ranks' existing gloo world.

    ``DistributedConfig(tp_plan="auto")`` derives ``tp_size`` from ``WORLD_SIZE`` (default 1: no split
    at all), so it is passed explicitly; ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` are set as torchrun
    would (transformers reads ``LOCAL_RANK`` to bind an accelerator; nothing to bind on CPU).
    """
    import os

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(
        RANK=str(context.rank),
        LOCAL_RANK=str(context.rank),
        WORLD_SIZE=str(context.world_size),
        LOCAL_WORLD_SIZE=str(context.world_size),
    )
    config = DistributedConfig(tp_plan="auto", tp_size=context.world_size)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config, attn_implementation=attn)
    return model.eval()


LOADERS = {"tpcore SPMD": load_tpcore, "DTensor TP": load_dtensor, "HF tp_plan": load_hf_tp}


def rank_load(context, way: str, checkpoint: str, attn: str) -> dict:
    """Load and split the checkpoint one way; the figures of this rank. The clock starts after the
    imports, the floor is this rank's RSS then, and its peak RSS is reset there."""
    import time
    import warnings

    import torch.distributed.tensor.parallel  # noqa: F401
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401

    import tpcore  # noqa: F401

    transformers.utils.logging.disable_progress_bar()
    if way == "HF tp_plan":
        import accelerate  # noqa: F401  (transformers needs it for tp_plan; ImportError: n/a)
    settle()
    floor = proc_status()["VmRSS"]
    reset_peak()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = LOADERS[way](context, checkpoint, attn)
    ready = time.perf_counter() - start
    context.store[STORE_KEY] = model
    return {
        "ready_s": ready,
        "floor": floor,
        "load_peak": proc_status()["VmHWM"],
        "tensor_bytes": tensor_bytes(model),
        "attn": attention(model),
        "warnings": sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}" for w in caught}),
    }


# --- caller side -------------------------------------------------------------------------------------


@dataclass
class Way:
    name: str
    where: str  # "caller" or "ranks"
    new_tokens: int
    model: object = None
    pool: object = None  # the ranks (for the proxy: tpcore's own pool)
    key: str = STORE_KEY
    na: str | None = None
    ready_s: float | None = None
    start_s: float | None = None  # starting the ranks, before the clock of ready_s
    floor: int | None = None
    load_peak: int | None = None
    run_peak: int | None = None
    rank_bytes: int | None = None
    attn: str | None = None
    notes: list[str] = field(default_factory=list)
    times: dict[str, list[float]] = field(default_factory=dict)
    diff: float | None = None
    logits: object = None  # rank 0's batch-1 logits of the first timed round
    collectives: dict | None = None

    def figure(self, name: str) -> float | None:
        """The figures that the ratio tables and the chart compare (None: not available)."""
        if self.na:
            return None
        if name in ("b1", "large"):
            return median_ms(self.times[name]) if self.times.get(name) else None
        if name == "decode":  # (t(1 + K) - t(1)) / K from the medians over all rounds
            if not self.times.get("genK"):
                return None
            return (median_ms(self.times["genK"]) - median_ms(self.times["gen1"])) / self.new_tokens
        values = {
            "rank_bytes": self.rank_bytes,
            "peak_above_floor": (self.run_peak - self.floor) if self.run_peak and self.floor else None,
            "ready_s": self.ready_s,
        }
        return values[name]


def first_line(error: BaseException, limit: int = 200) -> str:
    """The gist of an error (a rank's error without the remote traceback), for an n/a cell."""
    message = getattr(error, "remote_message", None) or str(error)
    name = getattr(error, "type_name", None) or type(error).__name__
    text = f"{name}: {message.strip().splitlines()[0] if message.strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, args.seq + 1),
        tie_word_embeddings=False,
    )


def gpt2_config(args):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=args.gpt2_vocab, n_embd=args.gpt2_hidden, n_layer=args.gpt2_layers, n_head=args.gpt2_heads
    )


def make_inputs(args) -> dict:
    generator = torch.Generator().manual_seed(1234)

    def ids(batch: int, seq: int) -> dict:
        input_ids = torch.randint(0, args.vocab, (batch, seq), generator=generator)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    return {"b1": ids(1, args.seq), "large": ids(args.batch, args.seq), "prompt": ids(1, args.prompt)}


def load_unsplit(way: Way, checkpoint: str, args, inputs: dict, plan: dict) -> None:
    from transformers import AutoModelForCausalLM

    settle()
    way.floor = proc_status()["VmRSS"]
    reset_peak()
    start = time.perf_counter()
    way.model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=ATTENTION).eval()
    way.ready_s = time.perf_counter() - start
    way.load_peak = proc_status()["VmHWM"]
    way.rank_bytes = tensor_bytes(way.model)
    way.attn = attention(way.model)
    run_round(way.model, inputs, {**plan, "warmup": True})  # its peak with activations, before the others come
    way.run_peak = proc_status()["VmHWM"]


def load_proxy(way: Way, checkpoint: str, args, inputs: dict, plan: dict) -> None:
    import tpcore

    start = time.perf_counter()
    way.model = tpcore.parallelize(checkpoint, num_gpus=args.ranks, backend=BACKEND)  # the caller never holds it
    way.ready_s = time.perf_counter() - start
    way.pool, way.key = getattr(way.model._tpcore_handle, "pool", None), PROXY_STORE_KEY
    way.rank_bytes = max(way.model.memory_allocated().values())
    way.attn = attention(way.model)
    run_round(way.model, inputs, {**plan, "warmup": True})


def load_on_ranks(way: Way, checkpoint: str, args, inputs: dict, plan: dict) -> None:
    from tpcore.process import RankPool

    start = time.perf_counter()
    way.pool = RankPool(args.ranks, BACKEND)
    way.start_s = time.perf_counter() - start
    results = way.pool.run(rank_load, way.name, checkpoint, ATTENTION)
    way.ready_s = max(r["ready_s"] for r in results)
    way.floor = max(r["floor"] for r in results)
    way.load_peak = max(r["load_peak"] for r in results)
    way.rank_bytes = max(r["tensor_bytes"] for r in results)
    way.attn = results[0]["attn"]
    way.notes += [w for w in results[0]["warnings"] if "FutureWarning" in w or "Deprecat" in w]
    way.pool.run(rank_round, way.key, inputs, {**plan, "warmup": True})


def time_round(way: Way, inputs: dict, plan: dict) -> None:
    """One timed round of one way; a call's time on the ranks is the slowest rank's."""
    if way.where == "caller":
        result = run_round(way.model, inputs, plan)
        times, logits = result["times"], result["logits"]
    else:
        results = way.pool.run(rank_round, way.key, inputs, plan)
        times = {
            name: [max(per_rank) for per_rank in zip(*(r["times"][name] for r in results), strict=True)]
            for name in results[0]["times"]
        }
        logits = results[0]["logits"]
    for name, values in times.items():
        way.times.setdefault(name, []).extend(values)
    if logits is not None:
        way.logits = logits


def finish_ranks(way: Way, inputs: dict) -> None:
    """Collectives of one forward, and the ranks' memory after every timed call."""
    if way.name == "unsplit":
        way.collectives = {
            "total": 0,
            "layer0": 0,
            "by_op": {},
            "layer0_by_op": {},
            "dist_calls": 0,
            "counted_by": "none needed",
        }
        return
    if way.pool is None:
        way.notes.append("no access to its ranks: collectives and rank memory not measured")
        return
    way.collectives = way.pool.run(rank_collectives, way.key, inputs["b1"])[0]
    memory_figures = way.pool.run(rank_memory, way.key)
    way.rank_bytes = max(m["tensor_bytes"] for m in memory_figures)
    way.run_peak = max(m["VmHWM"] for m in memory_figures)


def close(way: Way) -> None:
    try:
        if way.name == "tpcore parallelize()" and way.model is not None:
            way.model.deparallelize()
        elif way.pool is not None:
            way.pool.close()
    except Exception as error:  # report, keep closing the others
        print(f"  {way.name}: closing failed: {first_line(error)}")
    way.model = way.pool = None


def gpt2_part(args, checkpoint: str, model_bytes: int) -> list[list[str]]:
    """Split the GPT-2 checkpoint with ``tpcore.parallelize()`` at each N: a rank's tensor bytes and
    the caller's peak RSS above its RSS just before the call, both against the model size."""
    import tpcore

    rows = []
    for n in args.gpt2_ranks:
        settle()
        before = proc_status()["VmRSS"]
        hwm_reset = reset_peak()
        start, model = time.perf_counter(), None
        try:
            with RssSampler() as sampler:
                model = tpcore.parallelize(checkpoint, num_gpus=n, backend=BACKEND)
            seconds = time.perf_counter() - start
            hwm = proc_status()["VmHWM"]
            allocated = model.memory_allocated()
            rank_peaks = model.memory_peak()
        except Exception as error:
            rows.append([str(n), f"n/a ({first_line(error)})", "", "", "", ""])
            continue
        finally:
            if model is not None:
                model.deparallelize()
            del model
            settle()
        share = max(allocated.values())
        sampled_extra, hwm_extra = sampler.peak - before, hwm - before
        rows.append(
            [
                str(n),
                f"{share / MIB:.1f} ({share / model_bytes:.3f}x)",
                f"{max(rank_peaks.values()) / MIB:.1f}",
                f"{sampled_extra / MIB:.1f} ({sampled_extra / model_bytes:.2f}x)",
                f"{hwm_extra / MIB:.1f} ({hwm_extra / model_bytes:.2f}x)" if hwm_reset else "n/a (no reset)",
                f"{seconds:.1f}",
            ]
        )
        print(
            f"  GPT-2 N={n}: rank tensors {share / MIB:.1f} MiB ({share / model_bytes:.3f}x of the model), caller "
            f"peak +{sampled_extra / MIB:.1f} MiB sampled ({sampled_extra / model_bytes:.2f}x), "
            f"+{hwm_extra / MIB:.1f} MiB VmHWM; {seconds:.1f} s"
        )
    return rows


def loaded_by(way: Way) -> str:
    """How a way went from the checkpoint folder to its model, for the loading table."""
    if way.name.startswith("tpcore"):
        return "tpcore from the checkpoint folder (each rank reads its slices)"
    return {
        "unsplit": "`from_pretrained`",
        "DTensor TP": "`from_pretrained` whole on each rank, then `parallelize_module`",
        "HF tp_plan": "`from_pretrained(..., distributed_config=DistributedConfig(tp_plan='auto'))` on each rank",
    }[way.name]


def spread_ms(seconds: list[float]) -> str:
    """``p25 - p75`` in ms, interpolated within the samples (so also right for a handful of them)."""
    if len(seconds) < 2:
        return f"{seconds[0] * 1e3:.1f}" if seconds else "n/a"
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return f"{q1 * 1e3:.1f} - {q3 * 1e3:.1f}"


def above(peak: int | None, floor: int | None) -> str:
    return "n/a" if peak is None or floor is None else f"{(peak - floor) / MIB:.0f}"


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def ratio_tables(ways: list[Way], figures: list[tuple[str, str]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per figure: row way / column way (below 1: the row way is faster or smaller)."""
    tables = []
    live = [w for w in ways if not w.na]
    for key, label in figures:
        header = [f"{label}: row / column", *(w.name for w in live)]
        rows = []
        for row in live:
            cells = [row.name]
            for column in live:
                a, b = row.figure(key), column.figure(key)
                cells.append("-" if row is column else ("n/a" if a is None or not b else f"{a / b:.2f}"))
            rows.append(cells)
        tables.append((label, header, rows))
    return tables


def plot(ways: list[Way], path: Path, title: str) -> str | None:
    """Bar chart: forward latency (batch 1 and large), decode ms per token, rank memory; None if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no chart: {error}"
    names = [w.name for w in ways]
    xs = range(len(ways))

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [(w.figure(key) or 0.0) * scale for w in ways]

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [
        (axes[0], "forward latency (ms, median)", [("b1", "batch 1", 1.0), ("large", "large batch", 1.0)]),
        (axes[1], "greedy decode (ms per new token)", [("decode", "batch 1", 1.0)]),
        (
            axes[2],
            "per-rank memory (MiB)",
            [("rank_bytes", "parameters + buffers", 1 / MIB), ("peak_above_floor", "peak RSS - floor", 1 / MIB)],
        ),
    ]
    for ax, panel_title, series in panels:
        width = 0.8 / len(series)
        for i, (key, label, scale) in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            bars = ax.bar([x + offset for x in xs], values(key, scale), width, label=label)
            ax.bar_label(bars, labels=[fmt(w.figure(key) and w.figure(key) * scale, ".0f") for w in ways], fontsize=7)
        ax.set_title(panel_title, fontsize=10)
        ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="Llama decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, default=768, help="Llama hidden size (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (= KV heads; default 12)")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--seq", type=int, default=128, help="forward sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="the large forward batch (default 8)")
    parser.add_argument("--prompt", type=int, default=32, help="generate() prompt length, batch 1 (default 32)")
    parser.add_argument("--new-tokens", type=int, default=16, help="K: decode = (t(1+K) - t(1)) / K (default 16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default 5)")
    parser.add_argument("--b1-calls", type=int, default=2, help="batch-1 forwards per round and way (default 2)")
    parser.add_argument(
        "--threads", type=int, default=cores, help=f"torch threads of the unsplit run (default {cores})"
    )
    parser.add_argument("--ranks", type=int, default=2, help="N for the Llama ways (default 2)")
    parser.add_argument("--gpt2-ranks", default="2,4", help="N of the GPT-2 memory part (default 2,4; '' skips it)")
    parser.add_argument("--skip-peers", action="store_true", help="only unsplit and the two tpcore ways")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds: a trial run")
    parser.add_argument("--note", default=None, help="a remark to put in the result file")
    parser.add_argument("--output", default=None, help="result file (default bench/results/peers.md; chart beside)")
    args = parser.parse_args(argv)
    args.gpt2_vocab, args.gpt2_hidden, args.gpt2_layers, args.gpt2_heads = 50257, 768, 12, 12
    if args.quick:
        args.layers, args.hidden, args.heads, args.intermediate, args.vocab = 2, 128, 4, 256, 1000
        args.seq, args.prompt, args.new_tokens, args.rounds = 32, 8, 4, 2
        args.gpt2_vocab, args.gpt2_hidden, args.gpt2_layers, args.gpt2_heads = 1000, 128, 2, 4
    args.gpt2_ranks = [int(n) for n in args.gpt2_ranks.split(",") if n.strip()]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    wall_start, load_at_start = time.perf_counter(), load_average()
    busy = cpu_busy()  # measured, not the load average, which still counts a script that just ended
    busy_at_start = busy is not None and busy > 0.25
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it
    import transformers
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401  (imported before any memory baseline)
    from transformers.models.llama import modeling_llama  # noqa: F401

    from tpcore.plugins import registered_policies
    from tpcore.process import RankPool

    transformers.utils.logging.disable_progress_bar()
    registered_policies()  # load tpcore's plugins now, so that no memory baseline below pays for it
    torch.set_num_threads(args.threads)
    inputs = make_inputs(args)
    plan = {
        "warmup": False,
        "b1_calls": args.b1_calls,
        "large_calls": 1,
        "new_tokens": args.new_tokens,
        "logits": False,
    }
    tmp = tempfile.TemporaryDirectory(prefix="tpcore-peers-")
    llama_dir, gpt2_dir = str(Path(tmp.name) / "llama"), str(Path(tmp.name) / "gpt2")
    models = [(llama_config(args), llama_dir)]
    if args.gpt2_ranks:
        models.append((gpt2_config(args), gpt2_dir))
    with RankPool(1, BACKEND, threads_per_rank=os.cpu_count()) as pool:  # keeps this process's memory clean
        built = pool.run(save_checkpoints, models, 0)[0]
    llama, model_bytes = built[0], built[0]["bytes"]
    print(
        f"LlamaForCausalLM {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate "
        f"{args.intermediate}, vocab {args.vocab}: {llama['parameters'] / 1e6:.1f} M parameters, "
        f"{model_bytes / MIB:.1f} MiB (fp32), saved with save_pretrained; {ATTENTION} attention; N={args.ranks} "
        f"ranks ({BACKEND}, {max(1, (os.cpu_count() or 1) // args.ranks)} thread(s) each), unsplit with "
        f"{args.threads} threads\n"
    )

    gpt2_rows, gpt2_line = [], ""
    if args.gpt2_ranks:  # first, while this process holds no model
        gpt2 = built[1]
        gpt2_line = (
            f"Random-init `GPT2LMHeadModel` (seed 0): vocab {args.gpt2_vocab}, hidden {args.gpt2_hidden}, "
            f"{args.gpt2_layers} layers, {args.gpt2_heads} heads, tied LM head: {gpt2['parameters'] / 1e6:.1f} M "
            f"parameters, **model size {gpt2['bytes'] / MIB:.1f} MiB** (parameter and buffer bytes, fp32)."
        )
        print("GPT-2 memory part: " + gpt2_line.replace("**", "").replace("`", ""))
        gpt2_rows = gpt2_part(args, gpt2_dir, gpt2["bytes"])
        print()

    names = ["unsplit", "tpcore SPMD", "tpcore parallelize()"]
    if not args.skip_peers:
        names += ["DTensor TP", "HF tp_plan"]
    ways = [
        Way(name, "caller" if name in ("unsplit", "tpcore parallelize()") else "ranks", args.new_tokens)
        for name in names
    ]
    loaders = {"unsplit": load_unsplit, "tpcore parallelize()": load_proxy}
    try:
        for way in ways:
            try:
                loaders.get(way.name, load_on_ranks)(way, llama_dir, args, inputs, plan)
                print(f"  {way.name}: ready in {way.ready_s:.1f} s")
            except Exception as error:
                way.na = first_line(error)
                print(f"  {way.name}: n/a ({way.na})")
                traceback.print_exc()  # the whole story on stderr; the result keeps the gist
                close(way)
        for round_ in range(args.rounds):
            live = [w for w in ways if not w.na]
            if not live:
                break
            order = live[round_ % len(live) :] + live[: round_ % len(live)]  # who goes first rotates
            for way in order:
                try:
                    time_round(way, inputs, {**plan, "logits": round_ == 0})
                except Exception as error:
                    way.na = f"failed in round {round_ + 1}: {first_line(error)}"
                    print(f"  {way.name}: n/a ({way.na})")
                    traceback.print_exc()
                    close(way)
            print(
                f"  round {round_ + 1}/{args.rounds}: "
                + ", ".join(
                    f"{w.name} {median_ms(w.times['b1'][-args.b1_calls :]):.0f} / "
                    f"{median_ms(w.times['large'][-1:]):.0f} ms, generate {median_ms(w.times['gen1'][-1:]):.0f} / "
                    f"{median_ms(w.times['genK'][-1:]):.0f} ms"
                    for w in ways
                    if not w.na
                )
            )
        reference = ways[0].logits if not ways[0].na else None
        for way in ways:
            if way.na:
                continue
            if reference is not None:
                way.diff = (way.logits - reference).abs().max().item()
            try:
                finish_ranks(way, inputs)
            except Exception as error:
                way.notes.append(f"collectives / rank memory not measured: {first_line(error)}")
    finally:
        for way in ways:
            close(way)
        tmp.cleanup()
    wall_s = time.perf_counter() - wall_start

    # --- report -------------------------------------------------------------------------------------
    header = [
        "way",
        "ready s",
        f"fwd 1x{args.seq} ms",
        f"fwd {args.batch}x{args.seq} ms",
        "decode ms/token",
        "rank params MiB (x model)",
        "rank peak RSS MiB",
        "peak - floor MiB: loaded / all calls",
        "collectives / layer",
        "collectives / forward",
        "max abs diff",
    ]
    by_name = {way.name: way for way in ways}
    if not by_name["tpcore parallelize()"].na:  # its ranks' floor: the SPMD ranks' (same imports)
        by_name["tpcore parallelize()"].floor = by_name["tpcore SPMD"].floor
    rows = []
    for way in ways:
        if way.na:
            rows.append([way.name, f"n/a ({way.na})", *[""] * (len(header) - 2)])
            continue
        comm = way.collectives or {}
        rows.append(
            [
                way.name,
                f"{way.ready_s:.1f}",
                fmt(way.figure("b1"), ".1f"),
                fmt(way.figure("large"), ".1f"),
                fmt(way.figure("decode"), ".1f"),
                f"{way.rank_bytes / MIB:.1f} ({way.rank_bytes / model_bytes:.3f}x)" if way.rank_bytes else "n/a",
                fmt(way.run_peak and way.run_peak / MIB, ".0f"),
                f"{above(way.load_peak, way.floor)} / {above(way.run_peak, way.floor)}",
                str(comm.get("layer0", "n/a")),
                str(comm.get("total", "n/a")),
                "0 (reference)" if way.name == "unsplit" else fmt(way.diff, ".1e"),
            ]
        )
    figures = [
        ("b1", f"fwd 1x{args.seq}"),
        ("large", f"fwd {args.batch}x{args.seq}"),
        ("decode", "decode per token"),
        ("rank_bytes", "rank params"),
        ("peak_above_floor", "rank peak RSS - floor"),
        ("ready_s", "checkpoint to ready"),
    ]
    ratios = ratio_tables(ways, figures)
    live = [w for w in ways if not w.na]
    spread_header = [
        "way",
        f"fwd 1x{args.seq}",
        f"fwd {args.batch}x{args.seq}",
        "generate, 1 new token",
        f"generate, {1 + args.new_tokens} new tokens",
        "timed calls (batch 1 / each other)",
    ]
    spread_rows = [
        [
            w.name,
            *(spread_ms(w.times[name]) for name in ("b1", "large", "gen1", "genK")),
            f"{len(w.times['b1'])} / {len(w.times['large'])}",
        ]
        for w in live
    ]
    comm_header = ["way", "counted by", "per forward, by op", "in layer 0, by op", "torch.distributed.* calls"]
    comm_rows = [
        [
            w.name,
            f"`{w.collectives['counted_by']}`",
            ", ".join(f"{op} x{n}" for op, n in w.collectives["by_op"].items()) or "none",
            ", ".join(f"{op} x{n}" for op, n in w.collectives["layer0_by_op"].items()) or "none",
            str(w.collectives["dist_calls"]),
        ]
        for w in live
        if w.collectives
    ]
    load_header = [
        "way",
        "loaded by",
        "attention",
        "ranks started s (before the clock)",
        "ready s",
        "rank peak RSS while loading MiB",
        "floor MiB",
    ]
    load_rows = [
        [
            w.name,
            loaded_by(w),
            w.attn or "n/a",
            fmt(w.start_s, ".1f") if w.where == "ranks" else ("in ready s" if w.name != "unsplit" else "-"),
            fmt(w.ready_s, ".1f"),
            fmt(w.load_peak and w.load_peak / MIB, ".0f"),
            fmt(w.floor and w.floor / MIB, ".0f"),
        ]
        for w in live
    ]
    gpt2_header = [
        "N",
        "rank tensors MiB (x model)",
        "rank peak RSS MiB",
        "caller peak above baseline, sampled MiB (x model)",
        "same, VmHWM MiB (x model)",
        "parallelize() s",
    ]

    print()
    print(plain_table(header, rows))
    for _, ratio_header, ratio_rows in ratios:
        print()
        print(plain_table(ratio_header, ratio_rows))
    print()
    print(plain_table(comm_header, comm_rows))
    print()
    print(plain_table(load_header, load_rows))
    if gpt2_rows:
        print()
        print(plain_table(gpt2_header, gpt2_rows))
    notes = [f"- **{w.name}** n/a: {w.na}" for w in ways if w.na]
    notes += [f"- {w.name}: {note}" for w in ways for note in w.notes]
    if busy_at_start:
        notes.append(
            f"- **The machine was busy** when the run started (other processes kept {busy:.0%} of its "
            f"{os.cpu_count()} cores busy over 2 s): they competed for the cores, which hurts the unsplit run's "
            "multi-threaded kernels most (a thread that loses its core stalls the other at every barrier). "
            "Rerun on an idle machine before drawing conclusions from the timings."
        )
    print("\n" + "\n".join(notes) if notes else "")
    print(f"\nwhole run: {wall_s / 60:.1f} min")

    output = Path(args.output) if args.output else None
    chart = output.with_suffix(".png") if output else Path(__file__).resolve().parent / "results" / "peers.png"
    title = f"random-init Llama, {llama['parameters'] / 1e6:.3g} M parameters, N={args.ranks} {BACKEND} ranks"
    chart_error = plot(ways, chart, title)
    model_line = (
        f"Random-init `LlamaForCausalLM` (seed 0): {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"(= KV heads), intermediate {args.intermediate}, vocab {args.vocab}, untied LM head: "
        f"{llama['parameters'] / 1e6:.1f} M parameters, **model size {model_bytes / MIB:.1f} MiB** (fp32), saved "
        f"once with `save_pretrained` (safetensors); every way loads that checkpoint with `{ATTENTION}` attention. "
        f"Split ways: N={args.ranks} `{BACKEND}` ranks with {max(1, (os.cpu_count() or 1) // args.ranks)} torch "
        f"thread(s) each; unsplit: this process with {args.threads} threads. Peers: torch {torch.__version__} "
        f"(DTensor), transformers {transformers.__version__} with accelerate {_version('accelerate')}. "
        f"**Whole run: {wall_s / 60:.1f} min** (wall clock, this script from start to end); load average "
        f"at the start: {load_at_start}; the other processes' use of the cores over 2 s before it: "
        + (f"{busy:.0%}." if busy is not None else "n/a.")
    )
    how = (
        f"Timed: {args.rounds} interleaved rounds (every way once per round, the first way rotating), after "
        f"untimed warm-up calls right after loading, under `torch.inference_mode`. Per round and way: "
        f"{args.b1_calls} forward(s) at 1 x {args.seq} and 1 at {args.batch} x {args.seq}, and greedy `generate()` "
        f"of a 1 x {args.prompt} prompt with 1 and with 1 + K = {1 + args.new_tokens} new tokens (`min_new_tokens` "
        f"= `max_new_tokens`, so no early stop); decode ms/token = (t(1 + K) - t(1)) / K, each t the median "
        "over the rounds. On ranks a call's time is the slowest rank's, measured there; `tpcore parallelize()` is "
        "timed in this process around the call (inputs sent, outputs brought back). Rank params: parameter and buffer "
        "bytes one rank holds (DTensor: `to_local()`), against the whole model. Rank peak RSS: the rank's `VmHWM` "
        "(the largest rank's) after every timed call; 'peak - floor' is that and the peak right after loading "
        "minus the floor, the rank's RSS after its imports and before loading (for the `parallelize()` ranks, "
        "whose loading is not observable, the SPMD ranks' floor; for unsplit: this process, its peak read "
        "after its warm-up calls, before the other ways start). `VmHWM` counts the pages of a memory-mapped "
        "checkpoint that a rank touched, and the batch-8 activations and logits dominate 'all calls'. "
        "Ready: checkpoint folder to a model ready to run (load + split, the slowest rank; "
        "`parallelize()` includes starting its ranks). Collectives over one 1 x "
        f"{args.seq} forward on rank 0, in `model.layers.0` and in the whole forward: tpcore counts its own "
        "(`tpcore.comm.count_collectives`), `CommDebugMode` the peers' (DTensor's functional collectives and "
        "c10d ops such as gloo's `allreduce_`). Max abs diff: batch-1 logits against the "
        "unsplit model's."
    )
    vocab_note = "tpcore splits the embeddings and the LM head over the vocabulary (`vocab_parallel=True`: default)."
    sections = [
        model_line + "\n\n" + how,
        (f"![forward, decode and memory per way]({chart.name})" if chart_error is None else chart_error),
        "## Per way\n\n" + markdown_table(header, rows),
        "## Ratios\n\nEach table: the row way's figure divided by the column way's (below 1: the row way is "
        "faster or smaller).\n\n" + "\n\n".join(markdown_table(h, r) for _, h, r in ratios),
        "## Spread\n\np25 - p75 of the timed calls in ms (how noisy the machine was).\n\n"
        + markdown_table(spread_header, spread_rows),
        "## Collectives\n\nBy operation during one forward: tpcore's layers count their own "
        "(`tpcore.comm.count_collectives`; its shared-memory transport does not go through `torch.distributed`), "
        "the peers' are seen by `CommDebugMode`; and the calls of `torch.distributed.all_reduce` and the other "
        "`torch.distributed` collective functions, counted by wrapping them during the same forward (DTensor's "
        "functional collectives and tpcore's shared-memory ones do not go through them).\n\n"
        + markdown_table(comm_header, comm_rows),
        "## Loading\n\n" + markdown_table(load_header, load_rows),
    ]
    if gpt2_rows:
        sections.append(
            "## GPT-2: what a rank and the caller hold\n\n"
            + gpt2_line
            + " `tpcore.parallelize(checkpoint, num_gpus=N)` with the checkpoint folder; rank tensors: "
            "`memory_allocated()` of the largest rank; the caller's "
            "peak above its RSS just before the call, sampled every ~10 ms and from `VmHWM` reset just before "
            "(the first call in this process also pays some one-time imports and caches, a few MiB).\n\n"
            + markdown_table(gpt2_header, gpt2_rows)
        )
    sections.append("## Notes\n\n" + "\n".join(["- " + vocab_note, *notes]))
    write_result("peers", "tpcore and its peers, side by side", sections, BACKEND, args.note, args.output)
    if chart_error is None:
        try:
            shown = os.path.relpath(chart)
        except ValueError:
            shown = chart.name
        print(f"wrote {shown}")


if __name__ == "__main__":
    main()
