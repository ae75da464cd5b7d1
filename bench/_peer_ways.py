"""The caller side of peers.py's ways of running a checkpoint on N ranks: unsplit in this process, tpcore driven
SPMD on the ranks of a ``RankPool`` or through ``parallelize()``, PyTorch's DTensor TP and transformers' tp_plan on
the ranks of a ``RankPool``; each loads a task's checkpoint, times a round of its calls, reports the largest rank's
memory and the collectives of one forward, and unloads (``_ways.run_part`` drives them). Their rank side:
``_peer_ranks``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from _memory import peak, reset_peaks, settle, tensor_bytes
from _peer_ranks import (
    ATTENTION,
    dtype_of,
    load_dtensor,
    load_hf,
    load_tpcore,
    model_facts,
    rank_collectives,
    rank_drop,
    rank_facts,
    rank_load,
    rank_memory,
    rank_round,
    run_round,
)
from _timing import slowest_rank
from _ways import Entry

if TYPE_CHECKING:
    from _peer_models import Task


class Way:
    """One way of running a checkpoint, in ``dtype`` (or with ``fp16=True``) on N ranks: subclasses ``load``
    a task's checkpoint, time a ``round`` of its calls, report the largest rank's ``memory`` and the
    ``collectives`` of one forward, and ``unload`` it (``_ways.run_part`` drives them)."""

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
        times = {name: slowest_rank([r["times"][name] for r in results]) for name in results[0]["times"]}
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
