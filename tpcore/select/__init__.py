"""The one place that chooses policies: installed plugins (:mod:`~tpcore.select.plugins`), policies derived
from a model's transformers tp plans (:mod:`~tpcore.select.tp_plan`), and the rule between them
(:mod:`~tpcore.select.auto`, :func:`choose_policies`)."""

from tpcore.select.adapters import refuse_unmerged_adapters
from tpcore.select.auto import AutoPolicy, choose_policies, describe_policies, policy_origin, sub_model_coverage

__all__ = [
    "AutoPolicy",
    "choose_policies",
    "describe_policies",
    "policy_origin",
    "refuse_unmerged_adapters",
    "sub_model_coverage",
]
