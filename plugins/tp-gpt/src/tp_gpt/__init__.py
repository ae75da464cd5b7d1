"""tp-gpt: tpcore policies for decoder-only language models (GPT-2 to Llama with grouped KV heads)."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_gpt.policies import POLICIES  # imported here so that listing plugins stays cheap

    return list(POLICIES)
