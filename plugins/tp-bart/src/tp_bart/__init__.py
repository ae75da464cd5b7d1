"""tp-bart: tpcore policies for the BART family of encoder-decoder models (translation,
summarization, dialogue)."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_bart.policies import POLICIES  # imported here so that listing plugins stays cheap

    return list(POLICIES)
