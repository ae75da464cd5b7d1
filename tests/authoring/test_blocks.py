"""tpcore.authoring.blocks.keeping_local_attributes: a module that rebuilds its attention from the config keeps
the rank's counts on the new attention, and changes nothing else."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tpcore.authoring.blocks import keeping_local_attributes


class Inner(nn.Module):
    def __init__(self, config, kind: str):
        super().__init__()
        self.kind = kind
        self.num_attention_heads = config.num_attention_heads
        self.all_head_size = config.num_attention_heads * config.head_dim


class Switching(nn.Module):
    """As BigBird's attention: ``set_attention_type`` builds ``self.self`` anew from the config."""

    def __init__(self, config):
        super().__init__()
        self.config, self.self = config, Inner(config, "sparse")

    def set_attention_type(self, value: str, layer_idx=None) -> str:
        self.self = Inner(self.config, value)
        return f"{value}@{layer_idx}"


KEEPS = keeping_local_attributes("set_attention_type", "self", ("num_attention_heads", "all_head_size"))


@given(
    heads=st.integers(2, 16),
    local=st.integers(1, 16),
    head_dim=st.integers(1, 8),
    kinds=st.lists(st.text(), max_size=3),
)
def test_the_rebuilt_attention_keeps_the_rank_counts(heads, local, head_dim, kinds):
    module = Switching(SimpleNamespace(num_attention_heads=heads, head_dim=head_dim))
    module.__class__ = KEEPS(module)
    module.self.num_attention_heads, module.self.all_head_size = local, local * head_dim  # the rank's, as the plan sets
    for i, kind in enumerate(kinds):
        assert module.set_attention_type(kind, layer_idx=i) == f"{kind}@{i}"  # arguments and result pass through
        assert module.self.kind == kind  # the new attention, built from the config
        assert (module.self.num_attention_heads, module.self.all_head_size) == (local, local * head_dim)
    assert isinstance(module, Switching)


def test_one_subclass_per_class_and_none_without_a_module():
    config = SimpleNamespace(num_attention_heads=2, head_dim=4)
    assert KEEPS(Switching(config)) is KEEPS(Switching(config))
    assert KEEPS(None) is None
