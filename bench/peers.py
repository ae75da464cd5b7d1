"""tpcore beside its peers: the same seeded checkpoints run unsplit, by tpcore (SPMD and ``parallelize()``), by
PyTorch's DTensor TP and by transformers' tp_plan, in one invocation. What each part runs and how it is measured:
bench/README.md.

    python bench/peers.py                        # ~10 min on 2 CPU cores -> bench/results/peers.md, peers.png
    python bench/peers.py --quick --output /tmp  # tiny models: a trial run of a few minutes
    python bench/peers.py --device cuda          # NCCL ranks, one per GPU (the part bench/gpu.sh runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import cloudpickle
import memory
import torch
from _common import (
    MIB,
    Entry,
    Figure,
    _version,
    bar_chart,
    common_arguments,
    cpu_busy,
    first_line,
    fmt,
    load_average,
    markdown_table,
    max_abs_diff,
    ratio_tables,
    result_path,
    run_part,
    spread_ms,
    way_table,
    write_result,
)
from memory import RssSampler, proc_status, reset_peak, settle

# memory.py's helpers also run on the ranks here: send them by value, as the functions of this script.
cloudpickle.register_pickle_by_value(memory)

ATTENTION = "sdpa"  # every way runs it (tpcore builds a model from a checkpoint with its config's default, sdpa)
GENERATE = {"do_sample": False, "pad_token_id": 0}

# --- run on the ranks and in the caller (module-level, so cloudpickle sends them by value) ---------


def tensor_bytes(model) -> int:
    """Bytes of the parameters and buffers this process holds (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            total += local.numel() * local.element_size()
    return total


def reset_peaks(device) -> int:
    """Start measuring a peak here; returns the floor: the CUDA allocator's bytes on a GPU, else this process's RSS."""
    settle()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    reset_peak()
    return proc_status()["VmRSS"]


def peak(device) -> int:
    """The peak since :func:`reset_peaks`: the CUDA allocator's on a GPU, else ``VmHWM``."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else proc_status()["VmHWM"]


def model_facts(model) -> dict:
    """Tensor bytes, dtype and attention of a loaded model."""
    return {
        "rank_bytes": tensor_bytes(model),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn": str(getattr(getattr(model, "config", None), "_attn_implementation", "n/a")),
    }


def run_round(model, calls: dict, inputs: dict, plan: dict, device) -> dict:
    """Each call once (``plan["repeat"]`` times where given), timed; the outputs named in ``plan["keep"]``
    (``{call: attribute, or None for the output itself}``), on the CPU. ``plan["warmup"]``: untimed, once each."""
    import time

    import torch

    from tpcore.ranks.transfer import to_device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, kept = {}, {}
    with torch.inference_mode():
        for name, (method, key, kwargs) in calls.items():
            arguments = to_device(inputs[key], device)
            for _ in range(1 if plan["warmup"] else plan["repeat"].get(name, 1)):
                sync()
                start = time.perf_counter()
                output = getattr(model, method)(**arguments, **kwargs)
                sync()
                times.setdefault(name, []).append(time.perf_counter() - start)
            if name in plan["keep"]:
                attribute = plan["keep"][name]
                kept[name] = (getattr(output, attribute) if attribute else output).detach().cpu()
    return {"times": {} if plan["warmup"] else times, "outputs": kept}


def rank_round(context, key: str, calls: dict, inputs: dict, plan: dict) -> dict:
    """``run_round`` on a rank's model; only rank 0 keeps outputs."""
    plan = {**plan, "keep": plan["keep"] if context.rank == 0 else {}}
    return run_round(context.store[key], calls, inputs, plan, context.device)


def rank_memory(context, key: str) -> dict:
    """A rank's tensor bytes and its peak since loading."""
    return {"rank_bytes": tensor_bytes(context.store[key]), "peak": peak(context.device)}


def rank_drop(context, key: str) -> None:
    context.store.pop(key, None)
    settle()


def rank_collectives(context, key: str, inputs: dict) -> dict:
    """Collectives of one forward, in total and inside the first decoder layer. tpcore's layers count their own
    (``tpcore.parallel.comm.count_collectives``: its shared-memory transport bypasses ``torch.distributed``); the peers'
    are seen by ``CommDebugMode``. A cross-check counts the calls of the ``torch.distributed`` functions."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from tpcore.parallel.comm import count_collectives
    from tpcore.ranks.transfer import to_device

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
    snapshots, hooks = {}, []
    try:
        for name, function in originals.items():
            setattr(dist, name, counting(function))
        with warnings.catch_warnings(), torch.inference_mode(), CommDebugMode() as mode, count_collectives() as own:
            warnings.simplefilter("ignore")  # "For backward hooks to be called, module output should be a Tensor"
            hooks.append(layer0.register_forward_pre_hook(lambda *_: snapshots.update(before=dict(own))))
            hooks.append(layer0.register_forward_hook(lambda *_: snapshots.update(after=dict(own))))
            model(**to_device(inputs, context.device))
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        for hook in hooks:
            hook.remove()
    if own:  # tpcore's layers issued them
        before, after = snapshots.get("before", {}), snapshots.get("after", {})
        layer = {op: after.get(op, 0) - before.get(op, 0) for op in after if after.get(op, 0) > before.get(op, 0)}
        by_op, total, counted_by = dict(own), sum(own.values()), "tpcore.parallel.comm.count_collectives"
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
    """Build each seeded random-init model (``(auto class, config, folder)``) and ``save_pretrained`` it."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    figures = []
    for auto_class, config, directory in models:
        torch.manual_seed(seed)
        model = getattr(transformers, auto_class).from_config(config).eval()
        model.save_pretrained(directory)
        parameters = sum(p.numel() for p in model.parameters())
        figures.append({"parameters": parameters, "bytes": tensor_bytes(model), "class": type(model).__name__})
        del model
    return figures


def dtype_of(spec: dict):
    return getattr(torch, spec["dtype"]) if spec["dtype"] else None


def load_tpcore(context, spec: dict):
    """``ParallelEngine.parallelize`` of the checkpoint folder: each rank reads only its slices."""
    from tpcore import ParallelEngine

    engine = ParallelEngine(context.world_size, context.backend, process_group=context.tp_group, dtype=dtype_of(spec))
    return engine.parallelize(spec["checkpoint"], fp16=spec["fp16"])


def load_dtensor(context, spec: dict):
    """PyTorch's native TP: ``from_pretrained`` whole, then ``parallelize_module`` with the model's colwise and
    rowwise linears over a 1-D mesh of the ranks' devices."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(context.device.type, (context.world_size,))  # over the group the ranks joined
    model = getattr(transformers, spec["auto_class"]).from_pretrained(
        spec["checkpoint"], dtype=dtype_of(spec), attn_implementation=ATTENTION
    )
    model = model.eval().requires_grad_(False).to(context.device)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {pattern: styles[style]() for pattern, style in spec["dtensor_plan"].items()}
    return parallelize_module(model, mesh, plan, src_data_rank=None)  # every rank loaded the weights: no scatter


def load_hf(context, spec: dict):
    """transformers' own TP (the config's ``base_model_tp_plan``) in the ranks' existing group.

    ``DistributedConfig(tp_plan="auto")`` takes ``tp_size`` from ``WORLD_SIZE`` (default 1: no split), so it is
    passed; ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` are set as torchrun would (``LOCAL_RANK`` picks the GPU).
    """
    import os

    import transformers
    from transformers.distributed import DistributedConfig

    os.environ.update(
        RANK=str(context.rank),
        LOCAL_RANK=str(context.rank),
        WORLD_SIZE=str(context.world_size),
        LOCAL_WORLD_SIZE=str(context.world_size),
    )
    config = DistributedConfig(tp_plan="auto", tp_size=context.world_size)
    model = getattr(transformers, spec["auto_class"]).from_pretrained(
        spec["checkpoint"], distributed_config=config, dtype=dtype_of(spec), attn_implementation=ATTENTION
    )
    return model.eval()


def rank_load(context, loader, key: str, spec: dict) -> dict:
    """Load a checkpoint with ``loader`` and keep it under ``key``; the figures of this rank. The clock starts
    after the imports; the floor is this rank's memory then, and its peak is reset there."""
    import importlib
    import time
    import warnings

    import torch.distributed.tensor.parallel  # noqa: F401
    import transformers

    import tpcore  # noqa: F401

    transformers.utils.logging.disable_progress_bar()
    importlib.import_module(spec["modeling"])
    floor = reset_peaks(context.device)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = loader(context, spec)
    ready = time.perf_counter() - start
    context.store[key] = model
    return {
        "ready_s": ready,
        "floor": floor,
        "load_peak": peak(context.device),
        **model_facts(model),
        "warnings": sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}" for w in caught}),
    }


# --- the ways (caller side) ----------------------------------------------------------------------------


class Way:
    """One way of running a checkpoint, in ``dtype`` (or with ``fp16=True``) on N ranks: subclasses ``load``
    a task's checkpoint, time a ``round`` of its calls, report the largest rank's ``memory`` and the
    ``collectives`` of one forward, and ``unload`` it (``_common.run_part`` drives them)."""

    loaded_by = ""

    def __init__(self, name: str, ranks: int, device: str, dtype: str | None = None, fp16: bool = False):
        self.name, self.ranks, self.device, self.dtype, self.fp16 = name, ranks, device, dtype, fp16

    def spec(self, task: Task) -> dict:
        """What a rank needs to load ``task`` this way."""
        return {**task.spec(), "dtype": self.dtype, "fp16": self.fp16}


class Unsplit(Way):
    """``from_pretrained`` in this process (on ``cuda:0`` with ``--device cuda``)."""

    loaded_by = "`from_pretrained`"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = None
        self.torch_device = torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    def load(self, task: Task, entry: Entry) -> None:
        import transformers

        entry.floor = reset_peaks(self.torch_device)
        start = time.perf_counter()
        self.model = getattr(transformers, task.auto_class).from_pretrained(
            task.checkpoint, dtype=dtype_of(self.spec(task)), attn_implementation=ATTENTION
        )
        self.model = self.model.eval().to(self.torch_device)
        entry.ready_s = time.perf_counter() - start
        entry.load_peak = peak(self.torch_device)
        facts = model_facts(self.model)
        entry.rank_bytes, entry.dtype, entry.attn = facts["rank_bytes"], facts["dtype"], facts["attn"]

    def round(self, task: Task, plan: dict) -> dict:
        return run_round(self.model, task.calls, task.inputs, plan, self.torch_device)

    def memory(self) -> dict:
        return {"rank_bytes": tensor_bytes(self.model), "peak": peak(self.torch_device)}

    def collectives(self, task: Task) -> dict:
        return {"total": 0, "layer0": 0, "by_op": {}, "layer0_by_op": {}, "dist_calls": 0, "counted_by": "none needed"}

    def unload(self) -> None:
        self.model = None
        settle()


class Proxy(Way):
    """``tpcore.parallelize(checkpoint, num_gpus=N)``, timed in this process: inputs sent, outputs brought back."""

    loaded_by = "tpcore from the checkpoint folder (each rank reads its slices)"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = None

    def load(self, task: Task, entry: Entry) -> None:
        import tpcore

        options = {"fp16": True} if self.fp16 else {"dtype": dtype_of(self.spec(task))}
        start = time.perf_counter()
        self.model = tpcore.parallelize(task.checkpoint, num_gpus=self.ranks, backend=backend(self.device), **options)
        entry.ready_s = time.perf_counter() - start
        facts = self.model._tpcore_handle.pool.run(rank_facts)[0]
        entry.rank_bytes = max(self.model.memory_allocated().values())
        entry.dtype, entry.attn = facts["dtype"], facts["attn"]

    def round(self, task: Task, plan: dict) -> dict:
        return run_round(self.model, task.calls, task.inputs, plan, torch.device("cpu"))

    def memory(self) -> dict:
        return largest(self._pool().run(rank_memory, "model"))

    def collectives(self, task: Task) -> dict:
        return self._pool().run(rank_collectives, "model", task.inputs["b1"])[0]

    def _pool(self):
        return self.model._tpcore_handle.pool  # tpcore's own ranks keep the served model under "model"

    def unload(self) -> None:
        if self.model is not None:
            self.model.deparallelize()
        self.model = None


def rank_facts(context) -> dict:
    return model_facts(context.store["model"])


def largest(figures: list[dict]) -> dict:
    """The largest rank's figures."""
    return {key: max(f[key] for f in figures) for key in figures[0]}


class OnRanks(Way):
    """A way whose ranks are a ``RankPool`` of this script (shared by the ways of one ``pool`` name), each
    loading with ``loader`` and keeping its model under the way's name."""

    loader = None
    pool_name = ""

    def __init__(self, *args, pools: Pools, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools = pools
        self.pool = None

    def load(self, task: Task, entry: Entry) -> None:
        self.pool, entry.start_s = self.pools.get(self.pool_name, self.ranks, self.device)
        results = self.pool.run(rank_load, type(self).loader, self.name, self.spec(task))
        entry.ready_s = max(r["ready_s"] for r in results)
        entry.floor, entry.load_peak = max(r["floor"] for r in results), max(r["load_peak"] for r in results)
        entry.rank_bytes = max(r["rank_bytes"] for r in results)
        entry.dtype, entry.attn = results[0]["dtype"], results[0]["attn"]
        entry.notes += [w for w in results[0]["warnings"] if "FutureWarning" in w or "Deprecat" in w]

    def round(self, task: Task, plan: dict) -> dict:
        results = self.pool.run(rank_round, self.name, task.calls, task.inputs, plan)
        times = {
            name: [max(per_rank) for per_rank in zip(*(r["times"][name] for r in results), strict=True)]
            for name in results[0]["times"]
        }  # a call's time is the slowest rank's
        return {"times": times, "outputs": results[0]["outputs"]}

    def memory(self) -> dict:
        return largest(self.pool.run(rank_memory, self.name))

    def collectives(self, task: Task) -> dict:
        return self.pool.run(rank_collectives, self.name, task.inputs["b1"])[0]

    def unload(self) -> None:
        if self.pool is not None and self.pool.alive:
            self.pool.run(rank_drop, self.name)
        self.pool = None


class Spmd(OnRanks):
    """``ParallelEngine(N, process_group=context.tp_group).parallelize(checkpoint)`` on each rank, timed there."""

    loader = staticmethod(load_tpcore)
    pool_name = "tpcore SPMD"
    loaded_by = Proxy.loaded_by


class DTensorTP(OnRanks):
    loader = staticmethod(load_dtensor)
    pool_name = "DTensor TP"
    loaded_by = "`from_pretrained` whole on each rank, then `parallelize_module`"


class HFTpPlan(OnRanks):
    loader = staticmethod(load_hf)
    pool_name = "HF tp_plan"
    loaded_by = "`from_pretrained(..., distributed_config=DistributedConfig(tp_plan='auto'))` on each rank"


class Pools:
    """The script's ``RankPool``s, one per (name, N), started on first use and closed together."""

    def __init__(self):
        self.pools: dict = {}

    def get(self, name: str, ranks: int, device: str):
        """``(pool, seconds it took to start, or None if it was running already)``."""
        from tpcore.ranks.process import RankPool

        pool = self.pools.get((name, ranks))
        if pool is not None and pool.alive:
            return pool, None
        start = time.perf_counter()
        self.pools[name, ranks] = RankPool(ranks, backend(device), device=device)
        return self.pools[name, ranks], time.perf_counter() - start

    def close(self, ranks: int | None = None) -> None:
        for key in [key for key in self.pools if ranks is None or key[1] == ranks]:
            self.pools.pop(key).close()


def backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


# --- the models and what a round runs on them ----------------------------------------------------------------


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


# --- the parts ------------------------------------------------------------------------------------------


@dataclass
class Report:
    """The result's sections, in the order of ``SECTIONS``, rewritten after each part (a run cut short keeps
    what it had), with the Llama part's chart."""

    args: argparse.Namespace
    chart: list  # the chart's panels (chart_panels)
    chart_title: str
    header: str = ""
    sections: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    entries: dict[str, list[Entry]] = field(default_factory=dict)
    start: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, text: str) -> None:
        self.sections[name] = text
        print("\n" + text.replace("**", ""), flush=True)
        self.write()

    def write(self) -> None:
        sections = [self.header]
        if "llama" in self.entries:
            path = result_path("peers", self.args.output, ".png")
            title = f"{self.chart_title}, N={self.args.ranks} {backend(self.args.device)} ranks"
            error = bar_chart(self.entries["llama"], self.chart, path, title)
            sections.append(f"![forward, decode and memory per way]({path.name})" if error is None else error)
        sections += [self.sections[name] for name in SECTIONS if name in self.sections]
        if self.notes:
            sections.append("## Notes\n\n" + "\n".join(f"- {note}" for note in self.notes))
        title = "tpcore and its peers, side by side"
        write_result("peers", title, sections, backend(self.args.device), self.args.note, self.args.output)


def five_ways(args, n: int, pools: Pools) -> list[Way]:
    """Unsplit, tpcore SPMD and parallelize() at N = ``n``, and the peers unless ``--skip-peers``."""
    ways: list[Way] = [
        Unsplit("unsplit", 1, args.device),
        Spmd("tpcore SPMD", n, args.device, pools=pools),
        Proxy("tpcore parallelize()", n, args.device),
    ]
    if not args.skip_peers:
        ways += [
            DTensorTP("DTensor TP", n, args.device, pools=pools),
            HFTpPlan("HF tp_plan", n, args.device, pools=pools),
        ]
    return ways


def llama_part(args, task: Task, pools: Pools, report: Report) -> None:
    """The decoder, five ways at N = ``--ranks``: the full table, ratios, spread, collectives and loading."""
    n = args.ranks
    ways = five_ways(args, n, pools)
    entries = run_part(task, ways, args.rounds, measure_ranks=True)
    report.entries["llama"] = entries
    by_name = {e.way: e for e in entries}
    proxy, spmd = by_name["tpcore parallelize()"], by_name["tpcore SPMD"]
    if not proxy.na:  # its ranks' floor: the SPMD ranks' (the same imports); their loading is not observable
        proxy.floor = spmd.floor
    figures = [
        *task.figures,
        ("rank_bytes", "rank params", lambda e: e.rank_bytes),
        ("peak_above_floor", "rank peak - floor", Entry.peak_above_floor),
        ("ready_s", "checkpoint to ready", lambda e: e.ready_s),
    ]
    live = [e for e in entries if not e.na]
    spread_header = ["way", *(f"{name} ms" for name in task.calls), "timed calls"]
    spread_rows = [[e.way, *(spread_ms(e.times.get(name, [])) for name in task.calls),
                    " / ".join(str(len(e.times.get(name, []))) for name in task.calls)] for e in live]  # fmt: skip
    comm_header = ["way", "counted by", "per forward, by op", "in layer 0, by op", "torch.distributed.* calls"]
    comm_rows = [
        [
            e.way,
            f"`{e.collectives['counted_by']}`",
            ", ".join(f"{op} x{k}" for op, k in e.collectives["by_op"].items()) or "none",
            ", ".join(f"{op} x{k}" for op, k in e.collectives["layer0_by_op"].items()) or "none",
            str(e.collectives["dist_calls"]),
        ]
        for e in live
        if e.collectives
    ]
    load_header = ["way", "loaded by", "attention", "ranks started s", "ready s", "peak while loading MiB", "floor MiB"]
    loaded_by = {way.name: way.loaded_by for way in ways}
    load_rows = [
        [
            e.way,
            loaded_by[e.way],
            e.attn or "n/a",
            fmt(e.start_s, ".1f") if e.start_s is not None else ("in ready s" if e.way.endswith("()") else "-"),
            fmt(e.ready_s, ".1f"),
            fmt(e.load_peak and e.load_peak / MIB, ".0f"),
            fmt(e.floor and e.floor / MIB, ".0f"),
        ]
        for e in live
    ]
    text = [
        f"## Llama, N={n}\n\n{task.describe()}\n\n" + way_table(task, entries, task.bytes, with_memory=True),
        "### Ratios\n\nEach table: the row way's figure divided by the column way's (below 1: the row way is "
        "faster or smaller).\n\n" + "\n\n".join(markdown_table(h, r) for h, r in ratio_tables(entries, figures)),
        "### Spread\n\np25 - p75 of the timed calls in ms.\n\n" + markdown_table(spread_header, spread_rows),
        "### Collectives in one forward\n\n" + markdown_table(comm_header, comm_rows),
        "### Loading\n\n" + markdown_table(load_header, load_rows),
    ]
    report.notes += [f"{e.way}: {note}" for e in entries for note in e.notes]
    report.add("llama", "\n\n".join(text))


def other_part(args, task: Task, pools: Pools, report: Report, title: str) -> None:
    """A model through the same five ways, at N = ``--ranks``: timings, rank params and differences."""
    n = args.ranks
    ways = five_ways(args, n, pools)
    entries = run_part(task, ways, args.more_rounds, measure_ranks=False)
    report.entries[task.name] = entries
    report.add(task.name, f"## {title}, N={n}\n\n{task.describe()}\n\n" + way_table(task, entries, task.bytes, False))


def half_part(args, task: Task, pools: Pools, report: Report) -> None:
    """tpcore in fp16 and bf16 against the unsplit model in the same dtype and in fp32; ``fp16=True`` as tpcore
    resolves it on this machine."""
    n = args.ranks
    ways: list[Way] = []
    for dtype in ("float32", "float16", "bfloat16"):
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
        ways += [
            Unsplit(f"unsplit {short}", 1, args.device, dtype=dtype),
            Spmd(f"tpcore SPMD {short}", n, args.device, dtype=dtype, pools=pools),
            Proxy(f"tpcore parallelize() {short}", n, args.device, dtype=dtype),
        ]
    ways.append(Spmd("tpcore SPMD fp16=True", n, args.device, fp16=True, pools=pools))
    entries = run_part(task, ways, args.more_rounds, measure_ranks=False)
    report.entries["half"] = entries
    by_name = {e.way: e for e in entries}
    unsplit = {e.dtype: e for e in entries if e.way.startswith("unsplit") and not e.na}
    header = ["way", "dtype on the ranks", *(label for _, label, _ in task.figures)]
    header += [f"{label} x fp32" for _, label, _ in task.figures]
    header += ["logits max diff vs unsplit same dtype", "vs unsplit fp32", "finite", "greedy tokens vs fp32"]
    rows = []
    for entry in entries:
        if entry.na:
            rows.append([entry.way, f"n/a ({entry.na})", *[""] * (len(header) - 2)])
            continue
        fp32 = by_name.get(entry.way.rsplit(" ", 1)[0] + " fp32")  # the same way in fp32
        logits = entry.outputs.get("b1")
        rows.append(
            [
                entry.way,
                entry.dtype or "n/a",
                *(fmt(read(entry), ".1f") for _, _, read in task.figures),
                *(ratio(read, entry, fp32) for _, _, read in task.figures),
                max_abs_diff(logits, output_of(unsplit.get(entry.dtype), "b1")),
                max_abs_diff(logits, output_of(unsplit.get("float32"), "b1")),
                "n/a" if logits is None else ("yes" if bool(torch.isfinite(logits).all()) else "NO"),
                max_abs_diff(entry.outputs.get("genK"), output_of(unsplit.get("float32"), "genK")),
            ]
        )
    text = (
        f"## Half precision, N={n}\n\n{task.describe()} `fp16=True` resolves to **{resolved_fp16()}** on this "
        "machine (`tpcore.load.precision.resolve_dtype`). x fp32: against the same way in fp32.\n\n"
        + markdown_table(header, rows)
    )
    report.add("half", text)


def ratio(read, entry: Entry, base: Entry | None) -> str:
    mine, theirs = read(entry), None if base is None or base.na else read(base)
    return "n/a" if mine is None or not theirs else f"{mine / theirs:.1f}"


def output_of(entry: Entry | None, call: str):
    return None if entry is None or entry.na else entry.outputs.get(call)


def resolved_fp16() -> str:
    from tpcore.load.precision import resolve_dtype

    dtype = resolve_dtype(True, None, "cpu")
    return "no cast (the model's own dtype)" if dtype is None else str(dtype).removeprefix("torch.")


def wide_part(args, task: Task, pools: Pools, report: Report) -> None:
    """The Llama at N=4 where its heads allow, all ways (on 2 cores the ranks oversubscribe them)."""
    n = 4
    if args.heads % n:
        report.add("n4", f"## Llama, N={n}\n\nskipped: {args.heads} heads do not divide over {n} ranks.")
        return
    if args.device == "cuda" and torch.cuda.device_count() < n:
        report.add("n4", f"## Llama, N={n}\n\nskipped: {torch.cuda.device_count()} GPU(s); NCCL needs one per rank.")
        return
    ways = five_ways(args, n, pools)
    entries = run_part(task, ways, args.more_rounds, measure_ranks=False)
    report.entries["n4"] = entries
    cores = os.cpu_count() or 1
    crowd = (
        f" **{n} ranks on {cores} cores oversubscribe them**: each rank has 1 thread, and a rank waiting in a "
        "collective may hold a core another rank needs; read these timings as what oversubscription costs."
        if args.device == "cpu" and cores < n
        else ""
    )
    pools.close(n)
    report.add("n4", f"## Llama, N={n}\n\n{task.describe()}{crowd}\n\n" + way_table(task, entries, task.bytes, False))


def start_part(args, report: Report) -> None:
    """The bounds of a rank's start: a bare interpreter's ``import torch, transformers``, and with the model's
    modeling module too, each timed alone (median of ``--start-repeats``), beside ``parallelize(dir)``'s ready time."""
    commands = {
        "import torch, transformers": "import torch, transformers",
        "+ modeling_llama": "import torch, transformers; import transformers.models.llama.modeling_llama",
    }
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.start_repeats):  # interleaved, so that drifting load hits both alike
        for name, code in commands.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            seconds[name].append(time.perf_counter() - start)
    report.start = {name: statistics.median(values) for name, values in seconds.items()}
    start_section(args, report)


def start_section(args, report: Report) -> None:
    """Ready times of ``parallelize(dir)`` beside the import bounds."""
    rows = [[f"a bare interpreter: {name}", f"{value:.2f}"] for name, value in report.start.items()]
    for part in ("llama", "n4"):
        for entry in report.entries.get(part, []):
            if entry.way == "tpcore parallelize()" and not entry.na:
                n = args.ranks if part == "llama" else 4
                rows.append([f"`parallelize(dir, num_gpus={n})`, checkpoint to ready", f"{entry.ready_s:.2f}"])
            if entry.way == "tpcore SPMD" and entry.start_s is not None:
                n = args.ranks if part == "llama" else 4
                rows.append(
                    [f"a `RankPool({n})` started (all ranks joined, imports in the ranks)", f"{entry.start_s:.2f}"]
                )
    if rows:
        report.add(
            "start",
            "## Start\n\nThe bounds of a rank's start: a bare interpreter (`python -c`) importing torch and "
            f"transformers, and also the model's modeling module (median of {args.start_repeats}, each alone), "
            "beside what `parallelize()` takes from the checkpoint folder to a served model.\n\n"
            + markdown_table(["what", "s"], rows),
        )


def gpt2_part(args, checkpoint: str, model_bytes: int, report: Report) -> None:
    """``tpcore.parallelize(checkpoint)`` of a GPT-2 at each N: a rank's tensor bytes and the caller's peak
    RSS above its RSS just before the call, against the model size (run while the caller holds no model)."""
    import tpcore

    rows = []
    for n in args.gpt2_ranks:
        settle()
        before = proc_status()["VmRSS"]
        hwm_reset = reset_peak()
        start, model = time.perf_counter(), None
        try:
            with RssSampler() as sampler:
                model = tpcore.parallelize(checkpoint, num_gpus=n, backend=backend(args.device))
            seconds = time.perf_counter() - start
            hwm = proc_status()["VmHWM"]
            allocated, rank_peaks = model.memory_allocated(), model.memory_peak()
        except Exception as error:
            rows.append([str(n), f"n/a ({first_line(error)})", "", "", "", ""])
            continue
        finally:
            if model is not None:
                model.deparallelize()
            del model
            settle()
        share = max(allocated.values())
        sampled, by_hwm = sampler.peak - before, hwm - before
        rows.append(
            [
                str(n),
                f"{share / MIB:.1f} ({share / model_bytes:.3f}x)",
                f"{max(rank_peaks.values()) / MIB:.1f}",
                f"{sampled / MIB:.1f} ({sampled / model_bytes:.2f}x)",
                f"{by_hwm / MIB:.1f} ({by_hwm / model_bytes:.2f}x)" if hwm_reset else "n/a (no reset)",
                f"{seconds:.1f}",
            ]
        )
    header = ["N", "rank tensors MiB (x model)", "rank peak MiB", "caller peak above baseline, sampled MiB (x model)",
              "same, VmHWM MiB (x model)", "parallelize() s"]  # fmt: skip
    line = (
        f"Random-init `GPT2LMHeadModel`: vocab {args.gpt2['vocab']}, hidden {args.gpt2['hidden']}, "
        f"{args.gpt2['layers']} layers, {args.gpt2['heads']} heads, tied LM head: "
        f"model size {model_bytes / MIB:.1f} MiB."
    )
    report.add("gpt2", "## GPT-2: what a rank and the caller hold\n\n" + line + "\n\n" + markdown_table(header, rows))


def chart_panels(task: Task) -> list:
    """The chart's panels: ``(title, [(label, read, scale)])``."""
    reads = {key: read for key, _, read in task.figures}
    return [
        ("forward latency (ms, median)", [("batch 1", reads["b1"], 1.0), ("large batch", reads["large"], 1.0)]),
        ("greedy decode (ms per new token)", [("batch 1", reads["decode"], 1.0)]),
        (
            "per-rank memory (MiB)",
            [
                ("parameters + buffers", lambda e: e.rank_bytes, 1 / MIB),
                ("peak - floor", Entry.peak_above_floor, 1 / MIB),
            ],
        ),
    ]


# --- main ------------------------------------------------------------------------------------------------

#: the parts, in the order they run (gpt2 first: the caller must hold no model) and their sections' order
PARTS = ("gpt2", "start", "llama", "half", "bart", "vit", "n4")
SECTIONS = ("llama", "start", "half", "bart", "vit", "n4", "gpt2")


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, in this order (default {','.join(PARTS)})"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo ranks) or cuda (NCCL)")
    parser.add_argument("--layers", type=int, default=8, help="Llama decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, default=768, help="Llama hidden size (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (= KV heads; default 12)")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--seq", type=int, default=128, help="forward sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="the large forward batch (default 8)")
    parser.add_argument("--prompt", type=int, default=32, help="generate() prompt length, batch 1 (default 32)")
    parser.add_argument("--new-tokens", type=int, default=16, help="K: decode = (t(1+K) - t(1)) / K (default 16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds of the Llama part (default 5)")
    parser.add_argument("--more-rounds", type=int, default=2, help="rounds of the other parts (default 2)")
    parser.add_argument("--b1-calls", type=int, default=2, help="batch-1 forwards per round and way (default 2)")
    parser.add_argument(
        "--threads", type=int, default=cores, help=f"torch threads of the unsplit run (default {cores})"
    )
    parser.add_argument("--ranks", type=int, default=2, help="N of the split ways (default 2)")
    parser.add_argument("--gpt2-ranks", default="2,4", help="N of the GPT-2 memory part (default 2,4)")
    parser.add_argument(
        "--start-repeats", type=int, default=3, help="timed interpreter starts of each kind (default 3)"
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds: parts not started by then are skipped")
    parser.add_argument("--skip-peers", action="store_true", help="only unsplit and the two tpcore ways")
    common_arguments(parser, "peers", "tiny models, 1-2 rounds, GPT-2 at N=2 only")
    args = parser.parse_args(argv)
    args.gpt2 = {"vocab": 50257, "hidden": 768, "layers": 12, "heads": 12}
    args.bart = {"vocab": 50265, "hidden": 768, "layers": 6, "heads": 12}
    args.vit = {"hidden": 768, "layers": 12, "heads": 12, "image": 224, "patch": 16}
    args.half = {"layers": 2, "vocab": 8000, "new_tokens": 4}
    if args.quick:
        args.layers, args.hidden, args.heads, args.intermediate, args.vocab = 2, 128, 4, 256, 1000
        args.seq, args.prompt, args.new_tokens, args.rounds, args.more_rounds = 32, 8, 4, 2, 1
        args.start_repeats, args.gpt2_ranks = 1, "2"
        args.gpt2 = {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4}
        args.bart = {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4}
        args.vit = {"hidden": 128, "layers": 2, "heads": 4, "image": 32, "patch": 8}
        args.half = {"layers": 2, "vocab": 1000, "new_tokens": 2}
    args.parts = [part for part in args.parts.split(",") if part]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    args.gpt2_ranks = [int(n) for n in args.gpt2_ranks.split(",") if n.strip()]
    if args.device == "cuda":
        args.ranks = min(args.ranks, torch.cuda.device_count())
        args.gpt2_ranks = [n for n in args.gpt2_ranks if n <= torch.cuda.device_count()]
    return args


def gpt2_config(args):
    from transformers import GPT2Config

    size = args.gpt2
    return GPT2Config(vocab_size=size["vocab"], n_embd=size["hidden"], n_layer=size["layers"], n_head=size["heads"])


def half_task(args) -> Task:
    """A shorter Llama for the half-precision part (on a CPU without half arithmetic it runs 5-20x slower)."""
    half_args = argparse.Namespace(**{**vars(args), "new_tokens": args.half["new_tokens"]})
    task = llama_task(half_args, layers=args.half["layers"], vocab=args.half["vocab"], large=False)
    task.name = "half"
    return task


def main(argv=None) -> int:
    """Run the parts; 1 if a tpcore way could not run or a part failed (a peer that cannot run is only n/a)."""
    args = parse_args(argv)
    wall_start, load_at_start = time.perf_counter(), load_average()
    busy = cpu_busy()  # measured, not the load average, which still counts a script that just ended
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it
    import transformers
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401  (imported before any memory baseline)
    from transformers.models.llama import modeling_llama  # noqa: F401

    from tpcore.ranks.process import RankPool
    from tpcore.select.plugins import registered_policies

    transformers.utils.logging.disable_progress_bar()
    registered_policies()  # load tpcore's plugins now, so that no memory baseline below pays for it
    torch.set_num_threads(args.threads)
    tasks = {"llama": llama_task(args), "half": half_task(args), "bart": bart_task(args), "vit": vit_task(args)}
    wanted = {
        name: task for name, task in tasks.items() if name in args.parts or (name == "llama" and "n4" in args.parts)
    }
    tmp = tempfile.TemporaryDirectory(prefix="tpcore-peers-")
    models = [(task.auto_class, task.config, str(Path(tmp.name) / name)) for name, task in wanted.items()]
    if "gpt2" in args.parts:
        models.append(("AutoModelForCausalLM", gpt2_config(args), str(Path(tmp.name) / "gpt2")))
    with RankPool(1, "gloo", threads_per_rank=os.cpu_count()) as pool:  # keeps this process's memory clean
        built = pool.run(save_checkpoints, models, 0)[0]
    for (name, task), figures in zip(wanted.items(), built[: len(wanted)], strict=True):
        task.checkpoint, task.model_class = str(Path(tmp.name) / name), figures["class"]
        task.parameters, task.bytes = figures["parameters"], figures["bytes"]

    llama = tasks["llama"]
    report = Report(args, chart_panels(llama), f"random-init Llama, {llama.parameters / 1e6:.3g} M parameters")
    report.header = header_line(args, load_at_start, busy)
    if busy is not None and busy > 0.25:
        report.notes.append(
            f"**The machine was busy** when the run started (other processes kept {busy:.0%} of its cores busy): "
            "they hurt the unsplit run's multi-threaded kernels most. Rerun on an idle machine."
        )
    pools, failures = Pools(), []
    try:
        for part in args.parts:
            elapsed = time.perf_counter() - wall_start
            if args.budget is not None and elapsed > args.budget:
                report.notes.append(
                    f"part `{part}` skipped: {elapsed:.0f} s spent of the --budget of {args.budget:.0f} s"
                )
                continue
            print(f"\n== {part} ({elapsed:.0f} s in)", flush=True)
            try:
                run(part, args, tasks, pools, report, str(Path(tmp.name) / "gpt2"), built[-1]["bytes"])
            except Exception as error:
                failures.append(f"part `{part}` failed: {first_line(error)}")
                traceback.print_exc()
    finally:
        pools.close()
        tmp.cleanup()
    failures += [f"{e.way} ({part}): {e.na}" for part, entries in report.entries.items() for e in entries
                 if e.na and e.way.startswith("tpcore")]  # fmt: skip
    wall = time.perf_counter() - wall_start
    report.notes += [*failures, f"Whole run: {wall / 60:.1f} min (wall clock, this script from start to end)."]
    report.write()
    print(f"\nwhole run: {wall / 60:.1f} min" + "".join(f"\nFAILED: {failure}" for failure in failures))
    return 1 if failures else 0


def run(part: str, args, tasks: dict, pools: Pools, report: Report, gpt2_dir: str, gpt2_bytes: int) -> None:
    """One part of the run."""
    if part == "gpt2":
        gpt2_part(args, gpt2_dir, gpt2_bytes, report)
    elif part == "start":
        start_part(args, report)
    elif part == "llama":
        llama_part(args, tasks["llama"], pools, report)
        start_section(args, report)
    elif part == "half":
        half_part(args, tasks["half"], pools, report)
    elif part == "bart":
        other_part(args, tasks["bart"], pools, report, "BART generate, beam 4")
    elif part == "vit":
        other_part(args, tasks["vit"], pools, report, "ViT forward")
    elif part == "n4":
        wide_part(args, tasks["llama"], pools, report)
        start_section(args, report)


def header_line(args, load_at_start: str, busy: float | None) -> str:
    import transformers

    cores = os.cpu_count() or 1
    if args.device == "cpu":
        threads = max(1, cores // args.ranks)
        where = f"with {threads} torch thread(s) each; unsplit: this process with {args.threads} threads"
    else:
        where = f"on {args.ranks} GPU(s); unsplit: this process on cuda:0"
    return (
        f"Split ways: N={args.ranks} `{backend(args.device)}` ranks {where}. Peers: torch {torch.__version__} "
        f"(DTensor), transformers {transformers.__version__} with accelerate {_version('accelerate')}. Load average "
        f"at the start: {load_at_start}; the other processes' use of the cores over 2 s before it: "
        f"{fmt(None if busy is None else busy * 100, '.0f')}%. Parts: {', '.join(args.parts)}. What runs and how it "
        "is timed: [bench/README.md](../README.md#peerspy-tpcore-beside-pytorchs-and-transformers-tensor-parallelism)."
    )


if __name__ == "__main__":
    sys.exit(main())
