"""Models without weights: meta copies to split before any tensor exists, and filling them on a rank.

A skeleton is a model whose parameters live on the meta device: it has every module, config and
attribute of the model and costs no memory, so policies can be applied to it (slicing a meta tensor
only changes its shape). A rank then fills the skeleton with its own tensors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "empty_model",
    "install_tensors",
    "named_tensors",
    "parameters_on_meta",
    "register_output_recording",
    "weightless_copy",
]


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer (non-persistent ones too) by its first name."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return named


def weightless_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the meta device (no data).

    Ties survive: one meta tensor stands for each distinct original tensor. Tensors that modules hold
    as plain attributes are copied to the CPU if they are on another device (a model on a GPU), so
    the copy can travel to ranks on any device.
    """
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta") and id(value) not in memo:
                memo[id(value)] = value.detach().cpu()
    skeleton = copy.deepcopy(model, memo)
    drop_output_capturing_hooks(skeleton)
    return skeleton


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While inside, every ``nn.Parameter`` a module registers is moved to the meta device.

    Buffers stay real: the ones a checkpoint lacks (rotary frequencies, position ids) are computed
    by the constructor and would be lost on meta. A parameter is marked as transformers marks one it has
    loaded (``_is_hf_initialized``), so that the model's weight init passes over it (drawing values on meta
    computes nothing, yet costs a dispatch per tensor). Affects module construction in all threads.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        if param is not None:
            param._is_hf_initialized = True  # type: ignore[attr-defined]
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(config, model_class: Any = None) -> nn.Module:
    """The model a transformers ``config`` describes, with its parameters on meta, in eval mode.

    ``model_class`` defaults to the first of ``config.architectures`` (as saved by ``save_pretrained``);
    a transformers auto class (``AutoModel``) builds the class it maps the config to.
    """
    if model_class is None:
        model_class = _architecture(config)
    with parameters_on_meta():
        is_module = isinstance(model_class, type) and issubclass(model_class, nn.Module)
        model = model_class(config) if is_module else model_class.from_config(config)
    return model.eval().requires_grad_(False)


def _architecture(config) -> type[nn.Module]:
    import transformers

    names = getattr(config, "architectures", None) or []
    for name in names:
        model_class = getattr(transformers, name, None)
        if isinstance(model_class, type) and issubclass(model_class, nn.Module):
            return model_class
    raise ValueError(
        f"the checkpoint's config names no transformers model class (architectures={names!r}); "
        "pass model_class=, e.g. transformers.AutoModelForCausalLM's class for it"
    )


def install_tensors(skeleton: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``tensors`` (by the names of :func:`named_tensors`) into ``skeleton`` in place of its own.

    Every place that held one tensor (tied weights) gets the same new object; a name that
    ``tensors`` lacks keeps the skeleton's tensor.
    """
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    first_name: dict[int, str] = {}
    for module_name, module in skeleton.named_modules(remove_duplicate=False):
        for is_parameter, table in ((True, module._parameters), (False, module._buffers)):
            for leaf, tensor in table.items():
                if tensor is None:
                    continue
                places.setdefault(id(tensor), []).append((module, leaf, is_parameter))
                first_name.setdefault(id(tensor), f"{module_name}.{leaf}" if module_name else leaf)
    for key, slots in places.items():
        value = tensors.get(first_name[key])
        if value is None:
            continue
        for module, leaf, is_parameter in slots:
            if is_parameter:
                if not isinstance(value, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=False)
                module._parameters[leaf] = value
            else:
                module._buffers[leaf] = value


def drop_output_capturing_hooks(model: nn.Module) -> None:
    """Remove the forward hooks transformers installs to record hidden states and attentions.

    They are bound to this process (a ContextVar) and cannot travel; the rank installs its own.
    """
    for module in model.modules():
        module.__dict__.pop("_output_capturing_hooks_installed", None)
        for key, hook in list(module._forward_hooks.items()):
            if "output_capturing" in getattr(hook, "__qualname__", ""):
                del module._forward_hooks[key]


def register_output_recording(model: nn.Module) -> None:
    """Let transformers record hidden states and attentions of a model that was unpickled rather
    than constructed (its constructor registers what each model class can record)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers versions without output capturing need nothing
        return
    by_class_name = type(_CAN_RECORD_REGISTRY) is dict  # before 5.2x: a plain dict keyed on str(class)
    for module in model.modules():
        if hasattr(module, "_can_record_outputs") and hasattr(module, "config"):
            _CAN_RECORD_REGISTRY[str(type(module)) if by_class_name else module] = module._can_record_outputs


def portable(model: nn.Module) -> nn.Module:
    """``model`` (a skeleton about to travel to the ranks), its parametrized modules (weight norm, as in
    Wav2Vec2's positional convolution) made picklable in place: torch refuses to pickle them ("only through
    state_dict()"), so each pickles as its plain class, its state and the names of its parametrized tensors,
    and is parametrized again where it is unpickled (:func:`_parametrized_again`)."""
    from torch.nn.utils import parametrize

    for module in model.modules():
        if parametrize.is_parametrized(module) and not isinstance(module, _Portable):
            module.__class__ = _portable_class(type(module))
    return model


class _Portable:
    """Mixed into a parametrized module's class: pickles as the plain class, state and parametrized names."""

    def __reduce_ex__(self, protocol):
        plain = parametrize_base(type(self))
        return _parametrized_again, (plain, dict(self.__dict__), list(self.parametrizations))


def parametrize_base(cls: type) -> type:
    """The class a parametrized module had before torch gave it a subclass (``type_before_parametrizations``)."""
    while issubclass(cls, _Portable) or cls.__name__.startswith("Parametrized"):
        cls = cls.__bases__[-1] if issubclass(cls, _Portable) else cls.__bases__[0]
    return cls


_PORTABLE_CLASSES: dict[type, type] = {}


def _portable_class(cls: type) -> type:
    if cls not in _PORTABLE_CLASSES:
        _PORTABLE_CLASSES[cls] = type(cls.__name__, (_Portable, cls), {"__module__": cls.__module__})
    return _PORTABLE_CLASSES[cls]


def _parametrized_again(plain: type[nn.Module], state: dict, names: list[str]) -> nn.Module:
    """A module of class ``plain`` with ``state``, its tensors ``names`` parametrized again by the
    parametrizations the state holds (``state["_modules"]["parametrizations"]``)."""
    from torch.nn.utils import parametrize

    module = plain.__new__(plain)
    module.__dict__.update(state)
    parametrize._inject_new_class(module)
    for name in names:
        parametrize._inject_property(module, name)
    return module
