"""Which config a module reads: that of the sub-model it belongs to.

Composite transformers models nest sub-models that carry their own configs as ``module.config``:
LLaVA's language model holds ``config.text_config`` and its vision tower ``config.vision_config``,
CLIP's text and vision towers likewise, T5's encoder and decoder stacks copies of the top-level
config. The config of a module is that of the nearest enclosing module (the module itself
included) whose ``config`` is a ``PretrainedConfig``; for a model without one anywhere, the
model's own ``config`` attribute (or ``None``).

A *sub-model* is where a config begins: a module whose config is not of the class of the config
around it (a nested copy of the same class, as T5's stacks hold, belongs to the enclosing
sub-model). The model itself is the first sub-model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["config_of", "module_configs", "owning_sub_model", "sub_models"]


def _own_config(module: nn.Module) -> Any:
    """``module.config`` if it is a transformers ``PretrainedConfig``, else ``None``."""
    from transformers import PretrainedConfig

    config = getattr(module, "config", None)
    return config if isinstance(config, PretrainedConfig) else None


def module_configs(model: nn.Module) -> dict[str, Any]:
    """``{module name: config}`` for every module of ``model`` (names as ``named_modules`` gives them)."""
    root = _own_config(model)
    configs = {"": root if root is not None else getattr(model, "config", None)}
    for name, module in model.named_modules():
        if name:
            own = _own_config(module)
            configs[name] = own if own is not None else configs[name.rpartition(".")[0]]
    return configs


def config_of(model: nn.Module, module_name: str) -> Any:
    """The config of the sub-model that the module at ``module_name`` belongs to."""
    module = model.get_submodule(module_name)  # raises AttributeError naming a missing path
    while True:
        own = _own_config(module)
        if own is not None:
            return own
        if not module_name:
            return getattr(model, "config", None)
        module_name = module_name.rpartition(".")[0]
        module = model.get_submodule(module_name)


def sub_models(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of every sub-model, outermost first; ``""`` (the model) always leads."""
    found = {"": model}
    configs = module_configs(model)
    for name, module in model.named_modules():
        if not name:
            continue
        config, around = configs[name], configs[name.rpartition(".")[0]]
        if config is not around and _own_config(module) is config and type(config) is not type(around):
            found[name] = module
    return found


def owning_sub_model(names: list[str] | dict[str, Any], module_name: str) -> str:
    """Of the sub-model ``names``, the innermost that contains the module at ``module_name``."""
    return max((n for n in names if not n or module_name == n or module_name.startswith(n + ".")), key=len)
