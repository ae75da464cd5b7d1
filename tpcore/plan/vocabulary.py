"""Which input and output embeddings split over the vocabulary, and why the others stay whole.

A vocabulary rarely divides by the world size, so a vocabulary-parallel table is padded to
``ceil(V / N)`` rows per rank (:class:`~tpcore.cut.split.Split` with ``pad``); which module types can
compute on such rows is the parallel layers' business (:func:`~tpcore.parallel.layers.vocab_parallel_class`).
"""

from __future__ import annotations

from torch import nn

from tpcore.configs import sub_models
from tpcore.parallel.layers import VocabParallelEmbedding, vocab_parallel_class

__all__ = ["vocabulary_choices", "vocabulary_modules"]


def _vocabulary_refusal(module: nn.Module) -> str | None:
    """Why ``module``'s type cannot be split over the vocabulary (:func:`~tpcore.parallel.layers.vocab_parallel_class`);
    ``None`` when it can."""
    if vocab_parallel_class(module) is not None:
        return None
    name = type(module).__name__
    if isinstance(module, VocabParallelEmbedding):
        return f"{name} is split over the vocabulary already"
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return f"{name} renormalizes the rows it looks up (max_norm)"
    if isinstance(module, nn.Embedding):
        return f"the forward of {name} is not a lookup times one scale, which is what splits over the vocabulary"
    if isinstance(module, nn.Linear):
        return f"{name} has a forward of its own; only an exact nn.Linear head splits over the vocabulary"
    return f"{name} is neither an nn.Embedding nor an nn.Linear"


def vocabulary_modules(model: nn.Module) -> list[nn.Module]:
    """The input and output embeddings to split over the vocabulary (see :func:`vocabulary_choices`)."""
    return [module for module, refusal in vocabulary_choices(model).values() if refusal is None]


def vocabulary_choices(model: nn.Module) -> dict[str, tuple[nn.Module, str | None]]:
    """The input and output embeddings of the model and its sub-models, by path, each with ``None`` where it
    splits over the vocabulary, else why it stays whole.

    A module splits when its type has a vocabulary-parallel class (:func:`~tpcore.parallel.layers.vocab_parallel_class`)
    and no module but it, its parents (BERT's head keeps the decoder's bias there) and the other
    vocabulary-parallel modules holding the same weight (BART's ``shared``, ``encoder.embed_tokens``,
    ``decoder.embed_tokens`` and ``lm_head``: one tied table) holds its weight or bias: a tensor that
    some other module reads must stay whole. Tied modules are split together or not at all.
    """
    holders = _holders(model)
    asked = _embeddings(model)
    refusals = {key: _vocabulary_refusal(module) for key, module in asked.items()}
    found = {key: module for key, module in asked.items() if refusals[key] is None}
    for module in list(found.values()):  # the modules a tied table is shared with
        for key, holder in holders.get(id(module.weight), {}).items():
            if holder.weight is module.weight and vocab_parallel_class(holder) is not None:
                found[key] = asked[key] = holder
                refusals[key] = None
    names = {id(module): name for name, module in model.named_modules()}
    parents = {names[key].rpartition(".")[0] for key in found if key in names}
    allowed = found.keys() | {id(module) for name, module in model.named_modules() if name in parents}
    for key, module in found.items():
        reader = _other_reader(module, holders, allowed)
        if reader is not None:
            refusals[key] = f"{names.get(id(reader), 'a module')} ({type(reader).__name__}) reads its tensors too"
    return {names[key]: (module, refusals[key]) for key, module in asked.items() if key in names}


def _holders(model: nn.Module) -> dict[int, dict[int, nn.Module]]:
    """``{id(parameter): {id(module): module}}``: every module holding each parameter (tied ones hold it twice)."""
    holders: dict[int, dict[int, nn.Module]] = {}
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None:
                holders.setdefault(id(tensor), {})[id(module)] = module
    return holders


def _embeddings(model: nn.Module) -> dict[int, nn.Module]:
    """The input and output embeddings the model and its sub-models name (CLIP's text tower names its own)."""
    found: dict[int, nn.Module] = {}
    for owner in sub_models(model).values():
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                module = getattr(owner, getter)()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(module, nn.Module):
                found[id(module)] = module
    return found


def _other_reader(module: nn.Module, holders: dict[int, dict[int, nn.Module]], allowed: set[int]) -> nn.Module | None:
    """A module not in ``allowed`` that holds ``module``'s weight or bias too, if any."""
    for table in (module.weight, getattr(module, "bias", None)):
        readers = [holder for other, holder in holders.get(id(table), {}).items() if other not in allowed]
        if table is not None and readers:
            return readers[0]
    return None
