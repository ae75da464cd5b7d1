"""Every family's models on the user's two paths: ``parallelize(model)`` and ``parallelize(directory)``.

The plugins' own tests run their models through long-lived rank pools, which build each model on the ranks;
users hand ``parallelize`` a model object (its skeleton pickled to the ranks) or a saved directory (read by
the ranks). This test takes the model classes of every registered policy (the public ``PreTrainedModel``
classes of the transformers module that defines the policy's layer class), builds each from its default
config shrunk as ``tpcore check`` shrinks it (:func:`tpcore.testing.samples.small_config`), and compares
both paths over 2 ranks with the unsplit model.

Every world start costs seconds, so a run draws a sample (slow tier): ``PER_FAMILY`` classes of each
plugin, chosen by a seed that changes every day (``TPCORE_CONFORMANCE_SEED`` fixes it; the seed is in
each test's id). ``TPCORE_CONFORMANCE=all`` runs every class. A class whose unsplit model the generic
sample does not fit (its own task's inputs) is skipped, saying why.
"""

from __future__ import annotations

import datetime
import importlib
import os
import random

import pytest
import torch
import transformers
from both_paths import assert_equal_on_both_paths

from tpcore.select.plugins import registered_policies
from tpcore.testing.samples import sample_inputs, small_config

#: classes drawn from each plugin in one run
PER_FAMILY = 2
SEED = int(os.environ.get("TPCORE_CONFORMANCE_SEED") or datetime.date.today().toordinal())


def model_classes_by_family() -> dict[str, list[str]]:
    """``{plugin distribution: [transformers model class name, ...]}`` for every registered policy: the public
    model classes of the module that defines its layer class."""
    families: dict[str, set[str]] = {}
    for entry in registered_policies():
        module_name = entry.policy.layer_class_name().rpartition(".")[0]
        if not module_name.startswith("transformers."):
            continue  # a layer class of another library's: no transformers model to build
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            model_class = getattr(transformers, name, None)
            if _is_model(name, model_class):
                families.setdefault(entry.distribution, set()).add(name)
    return {family: sorted(names) for family, names in sorted(families.items())}


def _is_model(name: str, model_class) -> bool:
    """A model class to build, not a base class (``BertPreTrainedModel``, ``PretrainedBartModel``)."""
    return (
        isinstance(model_class, type)
        and issubclass(model_class, transformers.PreTrainedModel)
        and "pretrained" not in name.lower()
    )


def drawn() -> list:
    """This run's classes: ``PER_FAMILY`` per plugin drawn by ``SEED``, or every one."""
    families = model_classes_by_family()
    if os.environ.get("TPCORE_CONFORMANCE") == "all":
        return [name for names in families.values() for name in names]
    draw = random.Random(SEED)
    return [name for names in families.values() for name in draw.sample(names, min(PER_FAMILY, len(names)))]


def test_every_plugin_has_model_classes_to_draw():
    families = model_classes_by_family()
    installed = {entry.distribution for entry in registered_policies()}
    assert set(families) == installed, f"plugins without a transformers model class: {installed - set(families)}"
    assert all(families.values())


def unsplit(model_class) -> tuple:
    """The model built small, its sample inputs and its outputs. A class the generic sample does not fit
    (inputs of its own task: multiple choice, entities, a padding token; a backbone from another library)
    fails here, unsplit, before any rank: the test is skipped, saying why."""
    try:
        torch.manual_seed(0)
        model = model_class(small_config(model_class.config_class())).eval()
        inputs = sample_inputs(model)
        with torch.inference_mode():
            return model, inputs, model(**inputs)
    except Exception as error:  # the unsplit model: nothing of tpcore's has run yet
        pytest.skip(f"the generic small sample does not fit {model_class.__name__}: {type(error).__name__}: {error}")


@pytest.mark.slow
@pytest.mark.parametrize("name", drawn(), ids=lambda name: f"{name}-seed{SEED}")
def test_a_model_equals_its_split_self_from_the_object_and_from_its_directory(name, tmp_path):
    model, inputs, expected = unsplit(getattr(transformers, name))
    assert_equal_on_both_paths(model, inputs, expected, tmp_path)
