"""tp-gpt: tpcore policies for decoder-only language models (GPT-2 to Llama with grouped KV heads, MoE)."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_gpt import moe, policies, state_space  # imported here so that listing plugins stays cheap

    return [*policies.POLICIES, *moe.POLICIES, *state_space.POLICIES]
