"""transformers' model types, one tiny model each, for the scripts that go over them (coverage.py,
tp_plan_coverage.py, split_sweep.py): the types it registers and those whose config carries a tp plan, the model
class of a type, and the loop that checks each type on warm rank pools and prints its row."""

from __future__ import annotations

import contextlib
import io
import time

#: where a model type's class is looked up by default: its causal LM, else its base model
CAUSAL_LM_ELSE_BASE = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


def registered_model_types() -> dict[str, type]:
    """``{model_type: config class}`` of every config transformers registers (that imports here)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            found[model_type] = CONFIG_MAPPING[model_type]
        except Exception:  # a config module that does not import here
            continue
    return found


def planned_model_types() -> dict[str, type]:
    """``{model_type: config class}`` of every config class carrying a tp plan itself or in a sub-config."""
    found = {}
    for model_type, config_class in registered_model_types().items():
        subs = (getattr(config_class, "sub_configs", None) or {}).values()
        if getattr(config_class, "base_model_tp_plan", None) or any(
            getattr(sub, "base_model_tp_plan", None) for sub in subs
        ):
            found[model_type] = config_class
    return found


def model_class_for(model_type: str, mappings: tuple[str, ...] = CAUSAL_LM_ELSE_BASE):
    """The class of ``model_type`` in the first of transformers' auto ``mappings`` that names one (None if none)."""
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping in mappings:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name[0] if isinstance(name, (list, tuple)) else name
        model_class = getattr(transformers, name, None) if name else None
        if model_class is not None:
            return model_class
    return None


def quiet() -> None:
    """No transformers warnings and no Python warnings: the rows say what went wrong."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def check_each(types: dict[str, type], check, line, budget: float | None = None, stderr: bool = False):
    """``check(model_type, config class, pools)`` for each type on warm rank pools, its output swallowed (and its
    stderr where ``stderr``), a row or a list of rows each printed by ``line(row)``; the types not started
    within ``budget`` seconds skipped. ``(rows, seconds, skipped types)``."""
    from tpcore.testing import PoolCache

    rows, skipped, started = [], [], time.perf_counter()
    with PoolCache() as pools:
        for model_type, config_class in types.items():
            if budget is not None and time.perf_counter() - started > budget:
                skipped.append(model_type)
                continue
            with contextlib.ExitStack() as quieted:
                quieted.enter_context(contextlib.redirect_stdout(io.StringIO()))
                if stderr:
                    quieted.enter_context(contextlib.redirect_stderr(io.StringIO()))
                found = check(model_type, config_class, pools)
            for row in found if isinstance(found, list) else [found]:
                rows.append(row)
                print(line(row), flush=True)
    return rows, time.perf_counter() - started, skipped
