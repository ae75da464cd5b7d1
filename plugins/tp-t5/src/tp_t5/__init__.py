"""tp-t5: tpcore policies for encoder-decoder T5 models (T5, T5 v1.1/FLAN, mT5, UMT5)."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_t5.policies import POLICIES  # imported here so that listing plugins stays cheap

    return list(POLICIES)
