"""`tpcore.parallelize()`, the one line: a split model served from the caller's own process, in three steps.

1. :func:`~tpcore.plan.plan_for`: the policies for the model (:func:`~tpcore.select.choose_policies`),
   every cut resolved and checked; nothing has started yet.
2. :class:`~tpcore.served.launch.Launch`: the ranks start and each gets its shard, streamed from the caller's
   model or read by the rank from a checkpoint's files (:mod:`tpcore.served.launch`).
3. :func:`~tpcore.served.handle.attach`: the caller's model object, its ``forward``, ``__call__`` and
   ``generate`` served by the ranks (:mod:`tpcore.served.handle`).

From a checkpoint the ranks start before step 1, so that their imports overlap the caller's building of
the model; a model object is checked before any rank starts.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tpcore.load.checkpoint import is_checkpoint_path
from tpcore.load.quantized_formats import adopt_quantized_model
from tpcore.plan import plan_for
from tpcore.ranks.process import CALL_TIMEOUT_S
from tpcore.select import choose_policies, refuse_unmerged_adapters
from tpcore.select.plugins import quantized_formats
from tpcore.served.compiled import compile_ranks, refuse_uncompilable
from tpcore.served.handle import attach
from tpcore.served.launch import CheckpointSource, Launch, LaunchOptions, ModelSource

__all__ = ["parallelize"]

_START_METHODS = (None, "spawn", "fork", "forkserver")


def parallelize(
    model: nn.Module | str | os.PathLike,
    num_gpus: int,
    fp16: bool = False,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    custom_policies=None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    *,
    timeout: float = CALL_TIMEOUT_S,
    threads_per_rank: int | None = None,
    verbose: bool | str | None = None,
    init_method: str | None = None,
    daemon: bool | None = None,
    seed: int | None = None,
    model_class: type[nn.Module] | None = None,
    vocab_parallel: bool = True,
    device: str | None = None,
    compile: bool = False,
) -> nn.Module:
    """Split ``model`` over ``num_gpus`` local ranks and serve it from this process.

    Args:
        model: the model; it is not changed, only given served methods. Or the directory of a saved
            model (``save_pretrained``: safetensors, or pickle files read with ``weights_only``): then
            only the ranks hold weights, each its own slices read from the files, and the caller
            gets the model with its parameters on the meta device.
        num_gpus: number of ranks: GPUs with NCCL, CPU processes with gloo.
        fp16: run the ranks in ``torch.float16`` (``dtype`` for any other dtype); the model is cast as
            ``from_pretrained(dtype=...)`` casts it (modules it keeps in fp32 stay, rotary buffers too).
            CPU ranks on a CPU without float16 arithmetic run bfloat16 where the CPU has it, else keep the
            model's dtype, with a warning (:func:`tpcore.load.precision.resolve_dtype`); ``dtype=torch.float16``
            casts them anyway.
        backend: ``"nccl"`` or ``"gloo"``; ``None`` is NCCL when there is a CUDA device per rank, else gloo.
        custom_policies: a Policy class or a list; ``None`` uses the installed plugins.
        master_addr, master_port: rendezvous of the ranks; loopback and a free port by default.
        timeout: seconds any call may take before the ranks are presumed lost; starting the ranks
            gives up after ``min(timeout, 180)`` seconds.
        threads_per_rank: torch threads per CPU rank; the cores are split evenly by default.
        verbose: once the model is loaded, print each rank's memory: ``True`` or ``"simple"`` its
            allocated and reserved MiB (CPU: tensor bytes and resident memory), ``"detail"`` the
            CUDA allocator's summary (CPU: resident, peak resident and tensor bytes).
        init_method, daemon: parallelformers' multiprocessing start method and daemon flag, accepted
            for compatibility and ignored: ranks are always fresh interpreters (CPU ranks forked from one that
            tpcore starts, never from the caller) that end with the caller, and the caller's start method is
            never changed.
        seed: seed the caller's torch RNG first (the ranks follow the caller's RNG on every call).
        model_class: the class to build from a checkpoint (default: the one its config names).
        vocab_parallel: split the input and output embeddings over the vocabulary too.
        device: ``"cuda"`` or ``"cpu"``; ``None`` is CUDA for NCCL, the CPU for gloo. gloo ranks on
            ``"cuda"`` share the GPUs (rank ``r`` on ``cuda:(r % devices)``); NCCL needs one per rank.
        compile: compile each rank's decode step with ``torch.compile`` (inductor) at load, under a bar, for a
            decoder-only model that generates (others are refused); prefills stay eager. Faster decoding for
            a compile of minutes (:mod:`tpcore.served.compiled`, docs/architecture.md).

    Returns:
        ``model`` itself, whose ``forward``/``__call__``/``generate`` now run on the ranks, with
        ``deparallelize()`` and memory queries added. ``model.to()``, ``.cpu()`` and ``.cuda()``
        end the parallelization (as ``deparallelize()``), then move the caller's model, which runs
        unsplit from then on; a model started from a checkpoint has no weights here to move, so
        they raise and the ranks serve on (``half()``/``float()`` change only the caller's copy).
        Validation errors (no policy, sizes that do not cut into whole heads, an unknown ``verbose``, a
        ``master_port`` already in use, more NCCL ranks than GPUs, a checkpoint's missing, truncated or
        corrupt file) are raised before any process starts. From a checkpoint, the ranks start while this
        process builds the model, so that their imports overlap: an error found then (no policy for the
        model, parameters the files lack) stops them before it is raised.
    """
    if isinstance(num_gpus, bool):  # parallelformers' positional order is (model, fp16, num_gpus)
        raise TypeError(f"num_gpus must be an int, got {num_gpus!r}: pass fp16= and num_gpus= by keyword")
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus is the number of ranks to split the model over, a positive int; got {num_gpus!r}")
    refuse_unmerged_adapters(model)
    adopt_quantized_model(model, quantized_formats())
    verbosity = _verbosity(verbose)
    if init_method not in _START_METHODS:
        raise ValueError(f"init_method is a multiprocessing start method {_START_METHODS[1:]}, got {init_method!r}")
    options = LaunchOptions.checked(
        num_gpus, backend, device, fp16, dtype, master_addr=master_addr, master_port=master_port,
        threads_per_rank=threads_per_rank, timeout=timeout,
    )  # fmt: skip
    if seed is not None:
        torch.manual_seed(seed)
    if getattr(model, "_tpcore_handle", None) is not None:
        raise RuntimeError("this model is already parallelized; call model.deparallelize() first")
    source = CheckpointSource(model, model_class) if is_checkpoint_path(model) else ModelSource(model)
    with Launch(source, options) as launch:
        policies = choose_policies(source.model, custom_policies)
        plan = plan_for(source.model, policies, num_gpus, vocab_parallel=vocab_parallel)
        if compile:
            refuse_uncompilable(source.model)
        pool = launch.load(plan)
    has_weights, dtype = source.has_weights, options.dtype
    model = attach(source.model, pool, plan, timeout, has_weights=has_weights, verbosity=verbosity, dtype=dtype)
    if compile:
        compile_ranks(model)  # on failure the ranks stop and the model is given back
    return model


def _verbosity(verbose) -> str | None:
    """``"simple"``, ``"detail"`` or ``None`` for a ``verbose`` argument (case-insensitive, as parallelformers)."""
    if verbose is None or isinstance(verbose, bool):
        return "simple" if verbose else None
    if isinstance(verbose, str) and verbose.lower() in ("simple", "detail"):
        return verbose.lower()
    raise ValueError(f"verbose must be None, False, True, 'simple' or 'detail', got {verbose!r}")
