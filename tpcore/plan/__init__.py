"""The shard plan: how a model splits over N ranks, built and checked once, then applied by every path.

=================  ============================================================================
module             responsibility
=================  ============================================================================
``shard_plan``     :class:`ShardPlan`, the plan as data, and its queries (shapes, shares, bytes)
``build``          :func:`plan_for`: policies resolved on the model's layers and checked
``vocabulary``     which embeddings split over the vocabulary, and why the others stay whole
``apply``          :func:`apply_plan`: a copy of the model becomes one rank's shard
``tiny_copy``      the tiny copy (a tiny config, planned alike) the trial and the proof run
``trial``          each rank's shard of the tiny copy runs alone (``verify_by_trial``)
``proof``          the ranks together compute the tiny copy's outputs (``prove_by_trial``)
``report``         :func:`report`, :func:`log_plan`: what is cut how, bytes per rank, what stays whole
``paths``          attribute paths in a model
=================  ============================================================================
"""

from tpcore.plan.apply import apply_plan, class_for
from tpcore.plan.build import plan_for
from tpcore.plan.report import as_json, bytes_summary, describe, format_bytes, log_plan, replicated_warning, report
from tpcore.plan.shard_plan import ShardPlan, Whole

__all__ = [
    "ShardPlan",
    "Whole",
    "apply_plan",
    "as_json",
    "bytes_summary",
    "class_for",
    "describe",
    "format_bytes",
    "log_plan",
    "plan_for",
    "replicated_warning",
    "report",
]
