"""A split model under ``torch.compile``: tpcore's collectives are operators of their own
(``tpcore::all_reduce_``, ``tpcore::all_gather``), so a rank's forward compiles as one graph (``fullgraph=True``
fails at any break) and, when it runs, calls the same transports as the eager forward, with the same tokens."""

from __future__ import annotations

import pytest
import rank_helpers
import torch
import transformers

from tpcore.parallel.comm import all_gather, all_reduce
from tpcore.testing import ModelSpec, tiny_llama_config


def test_the_collectives_trace_as_operators_and_a_world_of_one_as_nothing():
    def both(x):
        return all_gather(all_reduce(x * 2, None), None) + 1

    graphs = torch._dynamo.explain(both)(torch.ones(3))
    assert graphs.graph_break_count == 0
    assert torch.equal(torch.compile(both, backend="aot_eager", fullgraph=True)(torch.ones(3)), torch.full((3,), 3.0))


@pytest.mark.slow  # ~15 s of tracing and compiling on 2 cores
@pytest.mark.parametrize("world_size", [2])
def test_a_compiled_split_llama_generates_the_eager_split_s_tokens(rank_pools, world_size):
    spec = ModelSpec(transformers.LlamaForCausalLM, tiny_llama_config(num_hidden_layers=1), seed=0)
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    results = rank_pools.get(world_size).run(rank_helpers.compiled_generate, spec, ids, 4)
    for eager, compiled, counts in results:
        assert torch.equal(compiled, eager)
        # one layer: embedding, attention and MLP all-reduced, the vocab-parallel head gathered
        assert counts == {"all_reduce": 3, "all_gather": 1}
