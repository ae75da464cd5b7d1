"""Parallel layers: the "how" of row-parallel modules, and keeping module metadata true to shards.

Column-parallel modules need no new class: a ``Linear`` whose weight holds this rank's rows just
computes its slice of the output features. Row-parallel modules hold a slice of the input
features, so every rank computes a partial sum that must be all-reduced::

    y = x @ W.T + b = sum_r x_r @ W_r.T + b        x_r: [..., in / N],  W_r: [out, in / N]

The classes here subclass the original module type and are set on the instance
(``module.__class__``), so ``.weight`` and ``.bias`` stay where model code reads them; the bias is
kept whole and added once, after the all-reduce. Over more than two ranks, half-precision partial
sums are summed in fp32 and rounded once (:func:`reduce_partial_sums`); over two, a half-precision
sum already rounds once, so they travel as they are.

Vocab-parallel modules hold ``V_r = ceil(V / N)`` rows of a ``(V, H)`` table, rank ``r`` the rows from
``vocab_start = r * V_r`` (zero rows pad the last ranks, see :mod:`tpcore.compat.parallelformers`)::

    embedding:  E[ids] = sum_r  mask_r(ids) * E_r[ids - vocab_start_r]      one all-reduce
    LM head:    x @ W.T = concat_r (x @ W_r.T)[..., :V]                     one all-gather

The layers:

- :class:`RowParallelLinear`, :class:`RowParallelConv1D`: input-feature shards, output all-reduced,
  bias added once. :func:`row_parallel_class` also gives any other module type (fused MoE experts:
  every rank holds ``1 / N`` of every expert's intermediate size) a subclass whose output is
  all-reduced; a bias it adds inside its forward is held by rank 0 alone.
- :class:`VocabParallelEmbedding`, :class:`VocabParallelLMHead`: rows of the vocabulary.
  :func:`vocab_parallel_class` also splits ``nn.Embedding`` subclasses whose forward is the lookup
  times a scale (Gemma's, the BART family's scaled word embeddings), keeping their own forward.
- :class:`ColumnSplitRMSNorm`: an RMSNorm over a column-split activation (OLMo 2's full-width
  q/k norms), its statistic summed over the ranks by one all-reduce (:func:`column_split_norm_class`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.errors import ShardingError
from tpcore.parallel.comm import all_gather, all_reduce, group_rank, group_size

__all__ = [
    "GROUPED_MM_FEATURES",
    "ColumnSplitRMSNorm",
    "RowParallelConv1D",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "bind_group",
    "column_split_norm_class",
    "folded_linear",
    "make_column_split_norm",
    "make_row_parallel",
    "make_vocab_parallel",
    "reduce_partial_sums",
    "row_parallel_class",
    "sums_inside",
    "set_layer_size",
    "vocab_parallel_class",
]


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def reduce_partial_sums(partial: torch.Tensor, group) -> torch.Tensor:
    """``sum_r partial_r`` over ``group``, rounded once: fp16/bf16 partials of more than two ranks are summed
    in fp32 (twice the bytes; a sum of two halves is rounded once anyway)."""
    if partial.dtype in _HALF_DTYPES and group_size(group) > 2:
        return all_reduce(partial.float(), group).to(partial.dtype)
    return all_reduce(partial, group)


def folded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` as one matrix product over all leading dimensions: ``x [..., in] -> [..., out]``.

    ``F.linear`` of an input whose leading dimensions are no view of one (``hidden[:, -1:]``, the positions
    generate keeps for the logits) by a weight that needs no grad runs as a batched product over the weight
    broadcast to every row, reading it once per row; a split model's weights need no grad. Flattening first
    (a copy of those few rows) reads the weight once, as the unsplit model's product does.
    """
    if x.dim() <= 2:
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding an input-feature shard ``W_r: [out, in / N]``; output all-reduced."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_partial_sums(folded_linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` holding rows ``[vocab_start, vocab_start + V_r)``; looks up the ids it holds,
    zeros the others and all-reduces: ``ids [...] -> [..., H]``, equal to the whole table's lookup.

    An id outside the whole vocabulary fails as with the whole table: ``IndexError`` on the CPU (one
    host read per forward); on a GPU a device-side assert, so that the check costs no host sync.
    """

    tp_group = None
    vocab_start = 0
    vocab_size = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_range(ids)
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0), self.tp_group)

    def _check_range(self, ids: torch.Tensor) -> None:
        if not ids.numel():
            return
        low, high = torch.aminmax(ids)
        inside = (low >= 0) & (high < self.vocab_size)
        if (ids.device.type != "cpu" or torch.compiler.is_compiling()) and hasattr(torch, "_assert_async"):
            torch._assert_async(inside, "index out of range in self")
        elif not inside.item():
            raise IndexError("index out of range in self")


class VocabParallelLMHead(nn.Linear):
    """``nn.Linear`` holding rows ``[vocab_start, vocab_start + V_r)`` of an output embedding ``(V, H)``:
    ``x [..., H] -> logits [..., V]`` gathered from every rank, or this rank's ``[..., V_r]`` when
    ``gather_output`` is false (columns past ``V`` on the last ranks are padding)."""

    tp_group = None
    vocab_start = 0
    vocab_size = None
    gather_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = folded_linear(x, self.weight, self.bias)
        if not self.gather_output:
            return logits
        return all_gather(logits, self.tp_group)[..., : self.vocab_size]


def vocab_parallel_class(module: nn.Module) -> type[nn.Module] | None:
    """The vocab-parallel class for ``module``, or ``None`` when it cannot be split over the vocabulary.

    An exact ``nn.Linear`` becomes :class:`VocabParallelLMHead`, an exact ``nn.Embedding`` without
    ``max_norm`` :class:`VocabParallelEmbedding`. An ``nn.Embedding`` subclass qualifies when its forward
    is ``super().forward(ids) * scale``, as a probe shows (:func:`_is_scaled_lookup`); it gets a subclass
    of its own class with the vocab-parallel lookup next in line, so its forward (the scale) is kept::

        VocabParallelBartScaledWordEmbedding -> BartScaledWordEmbedding -> VocabParallelEmbedding -> nn.Embedding
    """
    if type(module) is nn.Linear:
        return VocabParallelLMHead
    if (
        not isinstance(module, nn.Embedding)
        or isinstance(module, VocabParallelEmbedding)
        or module.max_norm is not None
    ):
        return None
    if type(module) is nn.Embedding:
        return VocabParallelEmbedding
    return _vocab_parallel_subclass(type(module)) if _is_scaled_lookup(module) else None


@functools.cache
def _vocab_parallel_subclass(cls: type[nn.Embedding]) -> type[nn.Embedding]:
    doc = f"``{cls.__qualname__}`` whose lookup is vocab parallel (:class:`VocabParallelEmbedding`)."
    return type(f"VocabParallel{cls.__name__}", (cls, VocabParallelEmbedding), {"__doc__": doc, "__module__": __name__})


class _LookupProbe(nn.Embedding):
    """Stands where the vocab-parallel lookup would stand in a subclass's MRO: records the ids it is
    given and answers with rows of its own, unrelated to the module's weight."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.probe_calls.append(ids)
        return self.probe_rows


@functools.cache
def _probe_subclass(cls: type[nn.Embedding]) -> type[nn.Embedding]:
    return type(f"Probe{cls.__name__}", (cls, _LookupProbe), {"__module__": __name__})


def _is_scaled_lookup(module: nn.Embedding) -> bool:
    """Whether ``type(module).forward(ids)`` is ``super().forward(ids) * s`` for one scalar ``s``.

    Runs the class's forward on a CPU stand-in of ``module`` (its attributes; its buffers and other
    parameters copied, or random where they are on the meta device; a small random table) whose
    ``nn.Embedding`` lookup is replaced by :class:`_LookupProbe`, twice, with different tables, ids
    and rows ``R``: the lookup must be called once with the ids, and the output must be ``R * s`` with
    the same ``s`` both times. A forward that reads the table itself, adds to the rows, or normalizes
    them fails.
    """
    if module._modules:
        return False
    generator = torch.Generator().manual_seed(0)
    parameters = {name: _stand_in(tensor, generator) for name, tensor in module._parameters.items() if name != "weight"}
    buffers = {name: _stand_in(tensor, generator) for name, tensor in module._buffers.items()}
    scales = []
    for rows, magnitude in ((5, 1.0), (7, 3.0)):
        probe = _probe_subclass(type(module)).__new__(_probe_subclass(type(module)))
        probe.__dict__.update(module.__dict__)
        probe._parameters = {**parameters, "weight": torch.randn(rows, module.embedding_dim, generator=generator)}
        probe._buffers = buffers
        probe.num_embeddings = rows
        ids = torch.randint(0, rows, (2, 3), generator=generator)
        probe.probe_rows = magnitude * torch.randn(2, 3, module.embedding_dim, generator=generator)
        probe.probe_calls = []
        try:
            with torch.no_grad():
                out = type(probe).forward(probe, ids)
        except Exception:  # a forward the stand-in cannot run is not a scaled lookup we can vouch for
            return False
        if len(probe.probe_calls) != 1 or not torch.equal(probe.probe_calls[0], ids):
            return False
        rows_out = probe.probe_rows
        if not isinstance(out, torch.Tensor) or out.shape != rows_out.shape or not out.is_floating_point():
            return False
        out = out.double()
        scale = (out * rows_out).sum() / (rows_out * rows_out).sum()
        if not torch.isfinite(scale) or (out - scale * rows_out).abs().max() > 1e-5 * out.abs().max():
            return False
        scales.append(scale)
    return bool((scales[0] - scales[1]).abs() <= 1e-5 * scales[0].abs())


def _stand_in(tensor: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor | None:
    """A CPU copy of ``tensor``; for one on the meta device (a skeleton), a random one of its shape and dtype."""
    if tensor is None:
        return None
    if tensor.device.type != "meta":
        return tensor.detach().to("cpu", copy=True)
    if tensor.is_floating_point():
        return torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


def make_vocab_parallel(module: nn.Module, group, vocab_start: int, vocab_size: int, gather_output: bool = True):
    """Give ``module`` (already holding its rows) its :func:`vocab_parallel_class`, in place."""
    new_class = vocab_parallel_class(module)
    if new_class is None:
        raise ShardingError(
            f"no vocab-parallel layer for a {type(module).__qualname__}: only nn.Linear, nn.Embedding without "
            "max_norm and nn.Embedding subclasses whose forward is the lookup times a scale are split"
        )
    module.__class__ = new_class
    if new_class is VocabParallelLMHead:
        module.gather_output = gather_output
    module.tp_group = group
    module.vocab_start = vocab_start
    module.vocab_size = vocab_size
    set_layer_size(module)
    return module


def _conv1d_class() -> type[nn.Module] | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: nothing of that type can exist
        return None
    return Conv1D


_Conv1D = _conv1d_class()

if _Conv1D is not None:

    class RowParallelConv1D(_Conv1D):
        """HF ``Conv1D`` (weight ``(in, out)``) holding an input shard ``W_r: [in / N, out]``."""

        tp_group = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            size_out = x.shape[:-1] + (self.nf,)
            out = reduce_partial_sums(x.reshape(-1, x.shape[-1]) @ self.weight, self.tp_group)
            return (out + self.bias).view(size_out)

else:  # pragma: no cover - transformers is a dependency
    RowParallelConv1D = None


#: transformers' grouped-mm experts kernels need rows of a multiple of 16 bytes: 8 half-precision features, so a
#: rank's share of a fused experts' intermediate size that is no multiple of this runs the eager experts instead
GROUPED_MM_FEATURES = 8


def row_parallel_class(module: nn.Module) -> type[nn.Module]:
    """The row-parallel class for ``module``: :class:`RowParallelLinear` for an exact ``nn.Linear``,
    :class:`RowParallelConv1D` for an exact ``Conv1D``, the class a module's class names as its
    ``row_parallel_class`` (the block FP8 linear of :mod:`tpcore.parallel.quantized_linear`), and for any other
    module type a subclass of its own class whose forward all-reduces what the original forward returns
    (:func:`sums_inside` tells it apart).

    The latter suits a module whose output is the sum of what its shards compute, such as fused MoE
    experts (``gate_up_proj (E, 2I, H)`` split along dim 1 in its two halves, ``down_proj (E, H, I)``
    along dim 2): each rank runs every routed token through its ``I / N`` columns of every expert, and
    ``sum_r down_r(act(gate_r) * up_r) = down(act(gate) * up)``. A bias such a module adds inside its
    forward is added before the all-reduce, so the plan gives it to rank 0 alone (a ``summand`` cut) or
    refuses the module.
    """
    if type(module) is nn.Linear:
        return RowParallelLinear
    if _Conv1D is not None and type(module) is _Conv1D:
        return RowParallelConv1D
    own = getattr(type(module), "row_parallel_class", None)
    if isinstance(own, type):
        return own
    return _row_parallel_subclass(type(module))


def sums_inside(row_parallel: type[nn.Module]) -> bool:
    """Whether ``row_parallel`` (a :func:`row_parallel_class`) all-reduces its module's own output, so that a
    bias the module adds inside its forward is summed over the ranks (rather than added once after the sum)."""
    return issubclass(row_parallel, _ReducedOutput)


class _ReducedOutput(nn.Module):
    """Mixin placed before a module's class: its forward's output, a partial sum, is all-reduced."""

    tp_group = None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(self).__qualname__} all-reduces one output tensor, got a {type(out).__qualname__}")
        return reduce_partial_sums(out, self.tp_group)


@functools.cache
def _row_parallel_subclass(cls: type[nn.Module]) -> type[nn.Module]:
    doc = f"``{cls.__qualname__}`` holding a shard of its inputs' features; its output all-reduced."
    return type(f"RowParallel{cls.__name__}", (_ReducedOutput, cls), {"__doc__": doc, "__module__": __name__})


def make_row_parallel(module: nn.Module, group, replace: type[nn.Module] | None = None) -> nn.Module:
    """Turn ``module`` (already holding its shard) into its row-parallel class, in place."""
    module.__class__ = replace or row_parallel_class(module)
    module.tp_group = group
    return module


class ColumnSplitRMSNorm(nn.Module):
    """RMSNorm over an activation split along its features (the output of a column-parallel layer):
    rank ``r`` holds ``x_r [..., F_r]`` and the weight's matching slice ``w_r [F_r]``::

        mean(x^2) = sum_r sum(x_r^2) / sum_r F_r        one all-reduce of [sum(x_r^2), F_r] per row
        y_r = w_r * x_r / sqrt(mean(x^2) + eps)

    Computed in fp32; the result is cast to the input's dtype before the weight (``w * x_hat.to(dtype)``,
    Llama, OLMoE, MiniMax-M2) or after it (``weight_before_cast``: ``(w * x_hat).to(dtype)``, OLMo 2/3).
    Summing the widths ``F_r`` makes uneven splits and equally replicated heads (key/value heads fewer
    than ranks) right as well. Gemma-style ``x_hat * (1 + w)`` norms and LayerNorms are not covered.
    Set on a norm instance through :func:`column_split_norm_class`, which puts this class before the
    norm's own; ``eps`` is read from the attribute ``eps_attribute`` names.
    """

    tp_group = None
    weight_before_cast = False
    eps_attribute = "variance_epsilon"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, self.eps_attribute)
        return _rms_norm(hidden_states, self.weight, eps, self.weight_before_cast, self.tp_group)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_before_cast: bool, group) -> torch.Tensor:
    """:class:`ColumnSplitRMSNorm`'s forward on ``x [..., F_r]``, ``weight [F_r]`` (see there)."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    width = torch.full_like(x[..., :1], x.shape[-1])
    sums = all_reduce(torch.cat((x.pow(2).sum(-1, keepdim=True), width), dim=-1), group)
    x = x * torch.rsqrt(sums[..., :1] / sums[..., 1:] + eps)
    if weight_before_cast:
        return (weight * x).to(input_dtype)
    return weight * x.to(input_dtype)


_EPS_ATTRIBUTES = ("variance_epsilon", "eps")


def column_split_norm_class(module: nn.Module) -> type[nn.Module]:
    """A subclass of ``type(module)`` that computes it as :class:`ColumnSplitRMSNorm`, for an RMSNorm
    (a 1-D ``weight``, no other parameter, ``eps`` or ``variance_epsilon``) whose forward is
    ``w * x_hat`` in one of its two casts, as a probe on a CPU stand-in shows (fp32: the value,
    bf16: the cast); :class:`ShardingError` otherwise."""
    name = type(module).__qualname__
    weight = module._parameters.get("weight")
    eps_attribute = next((a for a in _EPS_ATTRIBUTES if isinstance(getattr(module, a, None), float)), None)
    if weight is None or weight.dim() != 1 or len(module._parameters) != 1 or module._modules or eps_attribute is None:
        raise ShardingError(f"no column-split norm for a {name}: not an RMSNorm with one 1-D weight and an eps")
    before_cast = _rms_norm_cast(module, eps_attribute)
    if before_cast is None:
        raise ShardingError(f"no column-split norm for a {name}: its forward is not an RMSNorm w * x_hat")
    return _column_split_subclass(type(module), before_cast, eps_attribute)


def make_column_split_norm(module: nn.Module, group) -> nn.Module:
    """Turn ``module`` (already holding its weight's slice) into its :func:`column_split_norm_class`, in place."""
    module.__class__ = column_split_norm_class(module)
    module.tp_group = group
    return module


@functools.cache
def _column_split_subclass(cls: type[nn.Module], weight_before_cast: bool, eps_attribute: str) -> type[nn.Module]:
    attributes = {
        "__doc__": f"``{cls.__qualname__}`` over a column-split activation (:class:`ColumnSplitRMSNorm`).",
        "__module__": __name__,
        "weight_before_cast": weight_before_cast,
        "eps_attribute": eps_attribute,
    }
    return type(f"ColumnSplit{cls.__name__}", (ColumnSplitRMSNorm, cls), attributes)


def _rms_norm_cast(module: nn.Module, eps_attribute: str) -> bool | None:
    """Run ``type(module).forward`` on a CPU stand-in (random weight, width 16) against :func:`_rms_norm`
    on one rank: ``None`` if the fp32 outputs differ, else whether the bf16 output is that of
    ``weight_before_cast`` (the cast that matches more of its elements)."""
    generator = torch.Generator().manual_seed(0)
    stand_in = type(module).__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in._buffers = {key: _stand_in(tensor, generator) for key, tensor in module._buffers.items()}
    x = 3 * torch.randn(4, 16, generator=generator)
    weight = 1 + torch.randn(16, generator=generator)
    eps = getattr(module, eps_attribute)
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        stand_in._parameters = {"weight": weight.to(dtype)}
        try:
            with torch.no_grad():
                outputs[dtype] = type(module).forward(stand_in, x.to(dtype))
        except Exception:  # a forward the stand-in cannot run is not an RMSNorm we can vouch for
            return None
        if not isinstance(outputs[dtype], torch.Tensor) or outputs[dtype].shape != x.shape:
            return None
    expected = _rms_norm(x, weight, eps, False, None)
    if (outputs[torch.float32].double() - expected).abs().max() > 1e-5 * expected.abs().max():
        return None
    matches = {
        before_cast: (outputs[torch.bfloat16] == _rms_norm(x.bfloat16(), weight.bfloat16(), eps, before_cast, None))
        .sum()
        .item()
        for before_cast in (False, True)
    }
    return matches[True] > matches[False]


def set_layer_size(module: nn.Module) -> None:
    """Make the size attributes of ``module`` match its (sliced) weight."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return
    if isinstance(module, nn.Linear):  # a packed weight's elements hold ``packing`` values each
        packing = getattr(module, "packing", (1, 1))
        sizes = [size * values for size, values in zip(weight.shape, packing, strict=True)]
        module.out_features, module.in_features = reversed(sizes) if getattr(module, "transposed", False) else sizes
    elif _Conv1D is not None and isinstance(module, _Conv1D):
        module.nx, module.nf = weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = weight.shape
    elif isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        set_conv_channels(module, weight.shape[0], weight.shape[1])


def set_conv_channels(module: nn.modules.conv._ConvNd, out_channels: int, in_per_group: int) -> None:
    """A convolution's channel attributes for its (sliced) weight ``(out, in / groups, *kernel)``. A depthwise
    one (``groups == in_channels``: each channel its own filters, ``out = m * in`` for a channel multiplier
    ``m``) cut by channels keeps ``m``: ``in_channels = groups = out / m``; any other takes
    ``in_channels = in_per_group * groups``."""
    if module.groups == module.in_channels and module.groups > 1:
        multiplier = module.out_channels // module.groups
        module.in_channels = module.groups = out_channels // multiplier
    else:
        module.in_channels = in_per_group * module.groups
    module.out_channels = out_channels


def bind_group(model: nn.Module, group) -> None:
    """Give the parallel modules of a model split elsewhere (a skeleton sent to a rank) this rank's
    group, and the vocab-parallel ones this rank's first row (every rank holds ``V_r`` rows)."""
    rank = group_rank(group)
    for module in model.modules():
        if hasattr(module, "tp_group"):
            module.tp_group = group
        if isinstance(module, VocabParallelEmbedding):
            module.vocab_start = rank * module.num_embeddings
        elif isinstance(module, VocabParallelLMHead):
            module.vocab_start = rank * module.out_features
