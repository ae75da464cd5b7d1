"""Probe tpcore's CUDA paths on one GPU, recording every result as JSON (step 3 of ``bench/gpu.sh``).

    python3 bench/gpu_probe.py OUT                 # on a CUDA machine: OUT/probe.json
    python3 bench/gpu_probe.py --cpu OUT           # anywhere: CPU ranks (gloo); CUDA-only probes are skipped
    python3 bench/gpu_probe.py --only shard_on_load,parallelize_t5 OUT

Each probe runs in its own ``try``: one that raises records its error and traceback, and the next one runs.
A probe is ``pass`` when all its checks hold, ``fail`` (with the failed checks named) when one does not,
``error`` when it raised, ``skipped: <why>`` when the machine cannot run it. probe.json is rewritten after
every probe, so a run cut short by a timeout keeps what it had. The models are tiny random-init ones
built from a seeded config (no download); outputs are compared in fp32 with tpcore's own tolerance.

With ``--cpu`` the same probes run on CPU ranks (gloo) where they mean something there: the
collectives over 2 ranks, parallelize() of each model, shard-on-load.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from gpu_env import scrub_paths
from torch import nn

import tpcore
from tpcore.ranks.transfer import to_device
from tpcore.testing import DEFAULT_RTOL, ModelSpec

#: tokens per generate() call; ``min_new_tokens`` keeps an early end-of-sequence from shortening a draw
GENERATE = {"max_new_tokens": 8, "min_new_tokens": 8, "pad_token_id": 0}
SAMPLING_SEED = 1234
#: a model moved between the CPU and a GPU is compared with this tolerance (other kernels, same math)
CROSS_DEVICE_RTOL = 1e-4
DTYPES = ("float32", "float16", "bfloat16")


class Skip(Exception):
    """This machine cannot run the probe (the message says why)."""


@dataclass(frozen=True)
class Mode:
    """Where the probes run: ``cuda:0`` and tpcore's default backend, or the CPU and gloo (``--cpu``)."""

    cuda: bool
    workdir: Path

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def options(self) -> dict:
        """parallelize()'s options: tpcore's default backend (NCCL on a CUDA machine), or one-thread gloo ranks."""
        return {"backend": None} if self.cuda else {"backend": "gloo", "threads_per_rank": 1}

    def need_cuda(self) -> None:
        if not self.cuda:
            raise Skip("no CUDA" if not torch.cuda.is_available() else "CUDA only (--cpu)")


# -- models and inputs ---------------------------------------------------------------------------


def llama_spec(vocab: int = 128, seed: int = 0) -> ModelSpec:
    """A 2-layer Llama with grouped KV heads (4 query heads, 2 KV heads) and an untied LM head."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return ModelSpec(transformers.LlamaForCausalLM, config, seed)


def gpt2_spec(seed: int = 0) -> ModelSpec:
    config = transformers.GPT2Config(
        vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    return ModelSpec(transformers.GPT2LMHeadModel, config, seed)


def t5_spec(seed: int = 0) -> ModelSpec:
    config = transformers.T5Config(
        vocab_size=96,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return ModelSpec(transformers.T5ForConditionalGeneration, config, seed)


def prompts(spec: ModelSpec, seed: int = 3) -> dict:
    """Two prompts: left padded for a decoder, right padded for an encoder (the second row is shorter)."""
    ids = torch.randint(3, spec.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if spec.config.is_encoder_decoder:
        mask[1, 4:] = 0
    else:
        mask[1, :2] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


def forward_inputs(spec: ModelSpec) -> dict:
    inputs = prompts(spec)
    if spec.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.tensor([[0, 5, 7], [0, 9, 4]])
    return inputs


# -- comparing -----------------------------------------------------------------------------------


def logits_diff(expected: torch.Tensor, got: torch.Tensor, rtol: float = DEFAULT_RTOL) -> dict:
    """``max|expected - got|``, the scale ``max|expected|`` and whether the difference is within ``rtol * scale``."""
    expected, got = expected.detach().double().cpu(), got.detach().double().cpu()
    if expected.shape != got.shape:
        return {"shape": list(got.shape), "expected_shape": list(expected.shape), "within": False}
    diff, scale = (expected - got).abs().max().item(), max(expected.abs().max().item(), 1e-6)
    return {"max_abs_diff": diff, "scale": scale, "rtol": rtol, "within": diff <= rtol * scale}


def diff_text(record: dict) -> str:
    """``forward diff 1.2e-07 (scale 3.4)``, for the summary line of a probe."""
    forward = record.get("forward", {})
    if "max_abs_diff" not in forward:
        return f"forward {forward or 'not compared'}"
    return f"forward diff {forward['max_abs_diff']:.3g} (scale {forward['scale']:.3g})"


def unsplit(model: nn.Module, method: str, inputs: dict, device, **kwargs):
    with torch.inference_mode():
        return getattr(model, method)(**to_device(inputs, device), **kwargs)


def sampled_twice(model: nn.Module, inputs: dict, device) -> list[torch.Tensor]:
    """Two sampled ``generate()`` calls right after one ``torch.manual_seed`` (seeds CUDA too)."""
    torch.manual_seed(SAMPLING_SEED)
    return [unsplit(model, "generate", inputs, device, do_sample=True, **GENERATE).cpu() for _ in range(2)]


def rank_devices(context) -> list[str]:
    """On a rank: the devices of the served model's tensors."""
    model = context.store["model"]
    return sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]})


def served_devices(model: nn.Module) -> list[list[str]]:
    return model._tpcore_handle.pool.run(rank_devices)


@contextlib.contextmanager
def parallelized(model, **options) -> Iterator[nn.Module]:
    """``tpcore.parallelize(model, **options)``, deparallelized on the way out unless the probe did it."""
    served = tpcore.parallelize(model, **options)
    try:
        yield served
    finally:
        if getattr(served, "_tpcore_handle", None) is not None:
            served.deparallelize()


def check_equivalence(record: dict, served, reference, spec: ModelSpec, device, rtol: float = DEFAULT_RTOL) -> None:
    """Forward logits, greedy and beam tokens of ``served`` against ``reference`` (unsplit, on ``device``)."""
    checks = record["checks"]
    inputs, prompt = forward_inputs(spec), prompts(spec)
    record["forward"] = logits_diff(unsplit(reference, "forward", inputs, device).logits, served(**inputs).logits, rtol)
    checks["forward_within_tolerance"] = record["forward"]["within"]
    greedy = unsplit(reference, "generate", prompt, device, do_sample=False, **GENERATE).cpu()
    checks["greedy_identical"] = torch.equal(served.generate(**prompt, do_sample=False, **GENERATE), greedy)
    beam = unsplit(reference, "generate", prompt, device, do_sample=False, num_beams=3, **GENERATE).cpu()
    checks["beam_identical"] = torch.equal(served.generate(**prompt, do_sample=False, num_beams=3, **GENERATE), beam)


def check_sampling(record: dict, served, reference, spec: ModelSpec, device) -> None:
    """Seeded sampling twice: each draw is the unsplit model's, and the second differs from the first."""
    prompt = prompts(spec)
    expected, got = sampled_twice(reference, prompt, device), sampled_twice(served, prompt, "cpu")
    record["checks"].update(
        sampling_first_identical=torch.equal(got[0], expected[0]),
        sampling_second_identical=torch.equal(got[1], expected[1]),
        sampling_draws_differ=not torch.equal(got[0], got[1]),
    )


def check_memory(record: dict, served, world_size: int, cuda: bool) -> None:
    """The memory queries answer per rank, with a positive tensor figure."""
    figures = {q: getattr(served, q)() for q in ("memory_allocated", "memory_reserved", "memory_cached", "memory_peak")}
    record["memory"] = figures
    allocated = figures["memory_allocated"]
    record["checks"]["memory_per_rank"] = all(len(f) == world_size for f in figures.values())
    record["checks"]["memory_allocated_positive"] = all(v > 0 for v in allocated.values())
    if cuda:
        record["checks"]["memory_names_cuda"] = all(key.startswith("cuda:") for key in allocated)


def check_deparallelize(record: dict, served, reference, spec: ModelSpec, device) -> None:
    """``deparallelize()`` stops the ranks and the model runs unsplit again, where it is, with the same logits."""
    pool = served._tpcore_handle.pool
    returned = served.deparallelize()
    checks = record["checks"]
    checks["deparallelize_returns_model"] = returned is served and not hasattr(served, "_tpcore_handle")
    checks["deparallelize_stops_ranks"] = not pool.alive
    inputs = forward_inputs(spec)
    here = next(served.parameters()).device
    logits = unsplit(served, "forward", inputs, here).logits
    expected = unsplit(reference, "forward", inputs, device).logits
    record["after_deparallelize"] = logits_diff(expected, logits, CROSS_DEVICE_RTOL if here != device else DEFAULT_RTOL)
    checks["deparallelized_runs_unsplit"] = record["after_deparallelize"]["within"]


# -- the probes ----------------------------------------------------------------------------------

PROBES: dict[str, Callable[[Mode, dict], None]] = {}


def probe(function: Callable[[Mode, dict], None]) -> Callable[[Mode, dict], None]:
    """Register a probe: ``function(mode, record)`` fills ``record`` (``record["checks"]``: name -> bool)."""
    PROBES[function.__name__] = function
    return function


def collectives_on_rank(context, dtype_names: list[str]) -> dict:
    """On a rank: all_reduce and all_gather of exactly representable values, through tpcore.parallel.comm and
    torch.distributed, on the rank's device; the largest error of each and the device each ran on."""
    from tpcore.parallel import comm

    world, results = context.world_size, {}
    base = torch.arange(1.0, 7.0).reshape(2, 3)
    expected = {"sum": base * world * (world + 1) / 2, "gather": torch.cat([base * (r + 1) for r in range(world)], -1)}
    for name in dtype_names:
        mine = (base * (context.rank + 1)).to(device=context.device, dtype=getattr(torch, name))
        direct_sum = mine.clone()
        dist.all_reduce(direct_sum, group=context.tp_group)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=context.tp_group)
        outputs = {
            "tpcore.parallel.comm.all_reduce": (comm.all_reduce(mine.clone(), context.tp_group), "sum"),
            "tpcore.parallel.comm.all_gather": (comm.all_gather(mine, context.tp_group, dim=-1), "gather"),
            "dist.all_reduce": (direct_sum, "sum"),
            "dist.all_gather": (torch.cat(parts, -1), "gather"),
        }
        results[name] = {
            op: {"error": (out.float().cpu() - expected[kind]).abs().max().item(), "device": str(out.device)}
            for op, (out, kind) in outputs.items()
        }
    return results


def check_collectives(record: dict, results: list[dict], device_type: str) -> None:
    record["ranks"] = results
    flat = [(dtype, op, r) for rank in results for dtype, ops in rank.items() for op, r in ops.items()]
    record["checks"]["collectives_exact"] = bool(flat) and all(r["error"] == 0 for _, _, r in flat)
    record["checks"][f"collectives_on_{device_type}"] = all(r["device"].startswith(device_type) for _, _, r in flat)


@probe
def collectives(mode: Mode, record: dict) -> None:
    """NCCL at world size 1 on cuda:0 (``--cpu``: gloo over 2 CPU ranks), fp32/fp16/bf16. At world size 1
    tpcore.parallel.comm returns its input (nothing to exchange); torch.distributed's calls still go through NCCL."""
    from tpcore.ranks.process import RankPool

    world_size, backend = (1, "nccl") if mode.cuda else (2, "gloo")
    record.update(world_size=world_size, backend=backend)
    with RankPool(world_size, backend, threads_per_rank=1) as pool:
        check_collectives(record, pool.run(collectives_on_rank, list(DTYPES)), mode.device.type)
    record["summary"] = f"{backend} x{world_size}: " + ("exact" if record["checks"]["collectives_exact"] else "WRONG")


def _parallelize_probe(spec: ModelSpec, mode: Mode, record: dict) -> None:
    """parallelize(num_gpus=1) against the unsplit model on the probe's device."""
    reference = spec.build().to(mode.device)
    with parallelized(spec.build(), num_gpus=1, **mode.options) as served:
        record["backend"] = served._tpcore_handle.pool.backend
        record["rank_devices"] = served_devices(served)
        record["checks"]["ranks_on_device"] = record["rank_devices"] == [[str(mode.device)]]
        check_equivalence(record, served, reference, spec, mode.device)
        check_sampling(record, served, reference, spec, mode.device)
        check_memory(record, served, 1, mode.cuda)
        check_deparallelize(record, served, reference, spec, mode.device)
    record["summary"] = diff_text(record)


@probe
def parallelize_llama(mode: Mode, record: dict) -> None:
    _parallelize_probe(llama_spec(), mode, record)


@probe
def parallelize_gpt2(mode: Mode, record: dict) -> None:
    _parallelize_probe(gpt2_spec(), mode, record)


@probe
def parallelize_t5(mode: Mode, record: dict) -> None:
    _parallelize_probe(t5_spec(), mode, record)


@probe
def caller_model_on_cuda(mode: Mode, record: dict) -> None:
    """``parallelize(model.cuda(), num_gpus=1)``: the shards are cut from CUDA tensors in the caller."""
    mode.need_cuda()
    spec = gpt2_spec(seed=4)
    reference = spec.build().to(mode.device)
    with parallelized(spec.build().to(mode.device), num_gpus=1, **mode.options) as served:
        record["rank_devices"] = served_devices(served)
        check_equivalence(record, served, reference, spec, mode.device)
        check_deparallelize(record, served, reference, spec, mode.device)
        record["checks"]["caller_model_stays_on_cuda"] = next(served.parameters()).device == mode.device
    record["summary"] = diff_text(record)


@probe
def shard_on_load(mode: Mode, record: dict) -> None:
    """``parallelize(path, num_gpus=1)`` of a saved (safetensors) Llama: the rank reads its slices onto its device."""
    spec = llama_spec(seed=5)
    reference = spec.build()
    directory = mode.workdir / "llama-checkpoint"
    reference.save_pretrained(directory)
    reference.to(mode.device)
    with parallelized(str(directory), num_gpus=1, **mode.options) as served:
        record["rank_devices"] = served_devices(served)
        record["checks"]["ranks_on_device"] = record["rank_devices"] == [[str(mode.device)]]
        record["checks"]["caller_holds_no_weights"] = all(p.device.type == "meta" for p in served.parameters())
        check_equivalence(record, served, reference, spec, mode.device)
        check_memory(record, served, 1, mode.cuda)
    record["summary"] = diff_text(record)


@probe
def gloo_two_ranks_one_gpu(mode: Mode, record: dict) -> None:
    """Two gloo ranks on cuda:0 with CUDA tensors (``device="cuda"``): a Llama with an odd vocabulary (101,
    padded to 2 x 51) and grouped KV heads, so the vocabulary masks, the logits' all-gather and the row
    all-reduce run on CUDA; then tpcore.parallel.comm and torch.distributed collectives of CUDA tensors over gloo."""
    mode.need_cuda()
    if "device" not in inspect.signature(tpcore.parallelize).parameters:
        raise RuntimeError("this tpcore's parallelize() has no device= option")
    spec = llama_spec(vocab=101, seed=6)
    reference = spec.build().to(mode.device)
    with parallelized(spec.build(), num_gpus=2, backend="gloo", device="cuda") as served:
        record["rank_devices"] = served_devices(served)
        expected = [[f"cuda:{rank % torch.cuda.device_count()}"] for rank in range(2)]
        record["checks"]["ranks_on_cuda"] = record["rank_devices"] == expected
        check_equivalence(record, served, reference, spec, mode.device)
        check_sampling(record, served, reference, spec, mode.device)
        results = served._tpcore_handle.pool.run(collectives_on_rank, list(DTYPES))
        check_collectives(record, results, "cuda")
    record["summary"] = diff_text(record)


@contextlib.contextmanager
def counting_rank_starts() -> Iterator[list]:
    """The command lines of the tpcore ranks started while inside (``subprocess.Popen`` is watched)."""
    started, original = [], subprocess.Popen

    class Watched(original):
        def __init__(self, args, *rest, **kwargs):
            if any("tpcore.ranks.worker" in str(arg) for arg in args):
                started.append(args)
            super().__init__(args, *rest, **kwargs)

    subprocess.Popen = Watched
    try:
        yield started
    finally:
        subprocess.Popen = original


@probe
def nccl_two_ranks_one_gpu(mode: Mode, record: dict) -> None:
    """``parallelize(num_gpus=2, backend="nccl")`` with one GPU: expected refused before any rank starts;
    records what tpcore (or, if it lets the ranks start, NCCL) says."""
    mode.need_cuda()
    if torch.cuda.device_count() >= 2:
        raise Skip(f"{torch.cuda.device_count()} GPUs visible: two NCCL ranks get a GPU each")
    started = time.perf_counter()
    with counting_rank_starts() as ranks:
        try:
            with parallelized(gpt2_spec().build(), num_gpus=2, backend="nccl", timeout=45) as served:
                record["accepted"] = True
                served(**forward_inputs(gpt2_spec()))  # the first collective: where NCCL itself would refuse
        except Exception as error:
            record["refusal"] = f"{type(error).__name__}: {error}"[:3000]
    record["seconds_to_refusal"] = round(time.perf_counter() - started, 2)
    record["ranks_started"] = len(ranks)
    record["checks"]["refused"] = "refusal" in record and not record.get("accepted")
    record["checks"]["refused_before_any_rank_started"] = not ranks
    record["summary"] = record.get("refusal", "accepted")[:120]


# -- running -------------------------------------------------------------------------------------


def environment(mode: Mode) -> dict:
    return {
        "mode": "cuda" if mode.cuda else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tpcore": tpcore.__version__,
        "gpu": torch.cuda.get_device_name(0) if mode.cuda else None,
    }


def run_probes(names: list[str], mode: Mode, output: Path, probes: dict | None = None) -> dict:
    """Run each probe in turn, recording its result or its error; write ``output`` after each one."""
    probes = probes or PROBES
    report = {"environment": environment(mode), "probes": {}}
    for name in names:
        record: dict = {"checks": {}}
        started = time.perf_counter()
        try:
            probes[name](mode, record)
            failed = [check for check, passed in record["checks"].items() if not passed]
            record["status"] = "fail" if failed or not record["checks"] else "pass"
            if failed:
                record["failed"] = failed
        except Skip as skip:
            record = {"status": f"skipped: {skip}"}
        except Exception as error:
            record["status"] = "error"
            record["error"] = scrub_paths(f"{type(error).__name__}: {error}")[:3000]
            record["traceback"] = scrub_paths(traceback.format_exc())[-6000:]
        record["seconds"] = round(time.perf_counter() - started, 2)
        report["probes"][name] = record
        output.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"{name:<26} {record['status']:<18} {record['seconds']:6.1f} s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="output folder (probe.json)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU ranks (gloo) even if CUDA is there")
    parser.add_argument("--only", help=f"comma-separated probes (default all: {','.join(PROBES)})")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(PROBES)
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        parser.error(f"unknown probes {unknown}; known: {list(PROBES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpcore-probe-") as workdir:
        mode = Mode(cuda=torch.cuda.is_available() and not args.cpu, workdir=Path(workdir))
        report = run_probes(names, mode, args.out / "probe.json")
    statuses = [record["status"] for record in report["probes"].values()]
    return 0 if all(s == "pass" or s.startswith("skipped") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
