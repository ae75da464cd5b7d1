"""The rank side of peers.py's ways: a checkpoint saved, loaded on a rank by tpcore (``ParallelEngine``), by
PyTorch's DTensor TP or by transformers' tp_plan, a round of its calls timed (also in the caller), a rank's memory
and the collectives of one forward.

These functions travel by value, as a script's own functions do (a rank imports nothing of bench/, so its memory
floor is what it was with them in the script).
"""

from __future__ import annotations

import functools
import sys

import _memory
import cloudpickle
import torch
from _memory import peak, reset_peaks, settle, tensor_bytes
from _timing import timed_calls

cloudpickle.register_pickle_by_value(sys.modules[__name__])
_memory.send_by_value()

ATTENTION = "sdpa"  # every way runs it (tpcore builds a model from a checkpoint with its config's default, sdpa)


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
    from tpcore.ranks.transfer import to_device

    times, kept = {}, {}
    with torch.inference_mode():
        for name, (method, key, kwargs) in calls.items():
            call = functools.partial(getattr(model, method), **to_device(inputs[key], device), **kwargs)
            repeats = 1 if plan["warmup"] else plan["repeat"].get(name, 1)
            times[name], output = timed_calls(call, 0, repeats, device)
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


def save_checkpoint_folders(context, models: list, seed: int) -> list[dict]:
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


def rank_facts(context) -> dict:
    """The facts of the model tpcore's own ranks serve (under "model")."""
    return model_facts(context.store["model"])
