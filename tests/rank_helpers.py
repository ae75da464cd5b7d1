"""Functions that tests send to RankPool workers (importable by the spawned ranks via pytest's pythonpath)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from tpcore import Layer, Policy, divide


def whoami(context):
    return context.rank, context.world_size, os.getpid()


def all_reduce_sum(context, value):
    tensor = torch.tensor([float(value + context.rank)])
    dist.all_reduce(tensor, group=context.tp_group)
    return tensor.item()


def raise_on(context, rank, message):
    if context.rank == rank:
        raise KeyError(message)
    return context.rank


def kill_on(context, rank):
    if context.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleep(context, seconds):
    time.sleep(seconds)
    return context.rank


def stopping_slowly_or_stuck(context, seconds):
    """Rank 0 answers at once, then takes ``seconds`` to stop once told to; the other ranks are stuck in this call."""
    if context.rank != 0:
        time.sleep(600)
    destroy = dist.destroy_process_group

    def destroy_slowly(*args, **kwargs):
        time.sleep(seconds)
        destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_slowly  # what the rank calls once told to stop
    return context.rank


def garbage_collection(context, enabled):
    """Turn the rank's automatic garbage collection on or off (off: what a reference cycle holds stays until on)."""
    (gc.enable if enabled else gc.disable)()


def watched_output(context, inputs, nbytes):
    """How many earlier inputs and outputs of this function are alive on this rank (it watches each through a weak
    reference), and a fresh ``nbytes`` output from rank 0 (``None`` from the others)."""
    watched = context.store.setdefault("watched", [])
    alive = sum(ref() is not None for ref in watched)
    watched.append(weakref.ref(inputs))
    output = torch.zeros(nbytes, dtype=torch.uint8) if context.rank == 0 else None
    if output is not None:
        watched.append(weakref.ref(output))
    return alive, output


def raise_or_reduce(context, rank):
    """``rank`` raises; the others wait for it in an all-reduce that never completes."""
    if context.rank == rank:
        raise ValueError("bad input on one rank")
    all_reduce_sum(context, 0)


def environment_variable(context, name):
    """The value of ``name`` in this rank's environment (``None`` if unset)."""
    return os.environ.get(name)


def parameter_shapes(context):
    """``{name: shape}`` of the model a ``parallelize()`` rank serves."""
    return {name: tuple(p.shape) for name, p in context.store["model"].named_parameters()}


def vocab_parallel_logits(context, spec, input_ids, gather_logits=True):
    """Build ``spec``, split it with ParallelEngine, return its logits and what its embeddings became."""
    from tpcore import ParallelEngine

    model = spec.build()
    engine = ParallelEngine(
        context.world_size, context.backend, process_group=context.tp_group, gather_logits=gather_logits
    )
    engine.parallelize(model)
    with torch.inference_mode():
        logits = model(input_ids=input_ids).logits
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return {
        "logits": logits,
        "classes": (type(embedding).__name__, type(head).__name__),
        "tied": embedding.weight is head.weight,
        "rows": embedding.weight.shape[0],
        "starts": (embedding.vocab_start, head.vocab_start),
    }


def engine_from_checkpoint(context, directory, input_ids, vocab_parallel=True):
    """ParallelEngine started from a checkpoint directory on this rank: logits and where the weights are."""
    from tpcore import ParallelEngine

    engine = ParallelEngine(
        context.world_size, context.backend, process_group=context.tp_group, vocab_parallel=vocab_parallel
    )
    model = engine.parallelize(directory)
    with torch.inference_mode():
        logits = model(input_ids=input_ids).logits
    devices = {p.device.type for p in model.parameters()}
    return logits, devices, sum(p.numel() for p in model.parameters())


def engine_logits_from_checkpoint(context, directory, policies, inputs):
    """ParallelEngine with ``policies`` started from a checkpoint directory on this rank: its logits for ``inputs``."""
    from tpcore import ParallelEngine

    engine = ParallelEngine(context.world_size, context.backend, policies, process_group=context.tp_group)
    model = engine.parallelize(directory)
    with torch.inference_mode():
        return model(**inputs).logits


def shm_against_backend(context, tensors):
    """All-reduce and all-gather each tensor (scaled by rank + 1) through tpcore.parallel.comm and through the
    group's backend directly; returns both, and whether shared-memory collectives are attached."""
    from tpcore.parallel import comm, shm

    results = []
    for tensor in tensors:
        mine = tensor * (context.rank + 1)
        reduced = comm.all_reduce(mine.clone(), context.tp_group)
        expected = mine.contiguous().clone()
        dist.all_reduce(expected, group=context.tp_group)
        parts = [torch.empty_like(mine.contiguous()) for _ in range(context.world_size)]
        dist.all_gather(parts, mine.contiguous(), group=context.tp_group)
        for dim in (0, -1):
            gathered = comm.all_gather(mine, context.tp_group, dim=dim)
            if not torch.equal(gathered, torch.cat(parts, dim=dim)):
                raise AssertionError(f"all_gather along dim {dim} of a {tuple(mine.shape)} tensor differs")
        results.append((reduced, expected, comm.all_gather(mine, context.tp_group, dim=0), torch.cat(parts, dim=0)))
    return shm.for_group(context.tp_group) is not None, results


def echo(context, *values):
    """The arguments, sent back as they came (rank 0 only)."""
    return values if context.rank == 0 else None


def change_on_rank_one_then_echo(context, tensor):
    """Rank 1 adds one to its copy of ``tensor`` in place; once it has, every rank returns its own."""
    if context.rank == 1:
        tensor.add_(1)
    dist.barrier(group=context.tp_group)
    return tensor


def gather_rows_into_shared_memory(context, rows, offset=0.0, reused_max=None):
    """All-gather ``(rows, 64)`` of the rank's number (plus ``offset``) as a served forward on rank 0 does; return
    the result and its segment (``None``: not in shared memory). ``reused_max``: memfd.REUSED_MAX_BYTES here."""
    from tpcore.parallel import comm, memfd

    if reused_max is not None:
        memfd.REUSED_MAX_BYTES = reused_max
    with memfd.gathered_outputs_shared():
        gathered = comm.all_gather(torch.full((rows, 64), float(context.rank) + offset), context.tp_group)
    return gathered, memfd.segment_of(gathered)


def fail_on_rank_one_after_rank_zero_answered(context):
    """Rank 0 answers at once; rank 1 raises once rank 0's answer is surely sent (no collective in between)."""
    if context.rank == 1:
        time.sleep(0.5)
        raise ValueError("rank 1 failed after the others answered")
    return "rank 0's result"


def echo_through_device(context, value):
    """``value`` moved to this rank's device and back to the CPU, as a served call moves inputs and outputs."""
    from tpcore.ranks.transfer import to_cpu, to_device

    return to_cpu(to_device(value, context.device))


def collectives_of_a_forward(context, spec, input_ids, layer_path):
    """tpcore's collectives during one forward of ``spec`` split over the pool: in total, and inside
    the module at ``layer_path``."""
    from tpcore import ParallelEngine
    from tpcore.parallel.comm import count_collectives

    model = spec.build()
    ParallelEngine(context.world_size, context.backend, process_group=context.tp_group).parallelize(model)
    layer = model.get_submodule(layer_path)
    inside = {}
    with count_collectives() as counts, torch.inference_mode():
        layer.register_forward_pre_hook(lambda *_: inside.update(before=dict(counts)))
        layer.register_forward_hook(lambda *_: inside.update(after=dict(counts)))
        model(input_ids=input_ids)
    in_layer = {op: inside["after"].get(op, 0) - inside["before"].get(op, 0) for op in inside["after"]}
    return dict(counts), {op: n for op, n in in_layer.items() if n}


def collective_routes(context):
    """Which tensors of tpcore's collectives reach torch.distributed (recorded by device type, not run),
    a meta tensor standing in for a CUDA one; and whether shared-memory collectives are attached."""
    from tpcore.parallel import comm, shm

    routed = {"all_reduce": [], "all_gather": []}
    originals = dist.all_reduce, dist.all_gather
    dist.all_reduce = lambda tensor, **kwargs: routed["all_reduce"].append(tensor.device.type)
    dist.all_gather = lambda parts, tensor, **kwargs: routed["all_gather"].append(tensor.device.type)
    try:
        for device in ("meta", "cpu"):  # the CPU ones go through shared memory
            comm.all_reduce(torch.ones(2, device=device), context.tp_group)
            comm.all_gather(torch.ones(2, device=device), context.tp_group)
    finally:
        dist.all_reduce, dist.all_gather = originals
    return shm.for_group(context.tp_group) is not None, routed


def tensor_dtypes(context):
    """``{name: dtype}`` of every parameter and buffer of the model a ``parallelize()`` rank serves."""
    model = context.store["model"]
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


def reduce_partial_sums(context, parts, with_dtype_sent=False):
    """tpcore's row-parallel reduction of this rank's ``parts[rank]``; with ``with_dtype_sent``, also the
    dtypes that went into the all-reduce."""
    from tpcore.parallel import layers

    sent, all_reduce = [], layers.all_reduce

    def recording(tensor, group):
        sent.append(tensor.dtype)
        return all_reduce(tensor, group)

    layers.all_reduce = recording
    try:
        result = layers.reduce_partial_sums(parts[context.rank].clone(), context.tp_group)
    finally:
        layers.all_reduce = all_reduce
    return (result, sent) if with_dtype_sent else result


class ViTLayerPolicy(Policy):
    """Test-only, shared by the check and checkpoint tests: the ViT block (q/k/v/o projections,
    fc1/fc2), passed as ``custom_policies`` so that the core's tests do not lean on tp-vision's."""

    layer_class = "transformers.models.vit.modeling_vit.ViTLayer"

    @staticmethod
    def replace_arguments(config, world_size):
        return {"attention.num_attention_heads": divide(config.num_attention_heads, world_size, "num_attention_heads")}

    @staticmethod
    def attn_qkv():
        return [Layer(weight=f"attention.{p}_proj.weight", bias=f"attention.{p}_proj.bias") for p in "qkv"]

    @staticmethod
    def attn_out():
        return [Layer(weight="attention.o_proj.weight", bias="attention.o_proj.bias")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="mlp.fc1.weight", bias="mlp.fc1.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="mlp.fc2.weight", bias="mlp.fc2.bias")]


def log_from_rank(context, message):
    """Log ``message`` with this rank's number to ``tpcore.tests`` at DEBUG, INFO and WARNING."""
    logger = logging.getLogger("tpcore.tests")
    for level in (logging.DEBUG, logging.INFO, logging.WARNING):
        logger.log(level, message, context.rank)
    return context.rank


def log_from_two_threads(context, count):
    """Log ``count`` numbered records to ``tpcore.tests`` from this thread and as many from another, at once."""
    logger = logging.getLogger("tpcore.tests")

    def numbered(thread):
        for index in range(count):
            logger.warning("%s %d", thread, index)

    other = threading.Thread(target=numbered, args=("other",))
    other.start()
    numbered("main")
    other.join()
    return count


def report_counts(context, counts):
    """Report each of ``counts`` as this rank's running count, then return the last."""
    for count in counts:
        context.report_progress(count)
    return counts[-1]


def compiled_generate(context, spec, input_ids, new_tokens, backend="aot_eager"):
    """Build ``spec``, split it with ParallelEngine, and greedy-generate from ``input_ids`` with its forward eager and
    then under ``torch.compile(fullgraph=True)`` (the graph whole: no break at a collective); both token tensors, and
    the collectives the compiled decode step called when it ran."""
    import torch._dynamo

    from tpcore import ParallelEngine
    from tpcore.parallel.comm import count_collectives

    model = spec.build()
    ParallelEngine(context.world_size, context.backend, process_group=context.tp_group).parallelize(model)
    mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        forward = model.forward
        torch._dynamo.reset()
        model.forward = torch.compile(forward, backend=backend, dynamic=True, fullgraph=True)
        try:
            compiled = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
            step = torch.tensor([[int(compiled[0, -1])]] * input_ids.shape[0])
            with count_collectives() as counts:
                model(input_ids=step)
        finally:
            model.forward = forward
    return eager, compiled, dict(counts)


def write_to_stderr(context, text):
    os.write(2, f"{text} from rank {context.rank}\n".encode())


def working_directory(context):
    return os.getcwd()


def importing_pid(context, module: str) -> tuple[int, int]:
    """The pid that imported ``module`` (its ``PID``, set at import) and this rank's."""
    return sys.modules[module].PID, os.getpid()


def frozen_objects(context):
    """The objects this rank's garbage collector passes over (``gc.freeze``)."""
    import gc

    return gc.get_freeze_count()
