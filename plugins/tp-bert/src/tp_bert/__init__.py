"""tp-bert: tpcore policies for BERT-like encoders (BERT, RoBERTa, XLM-RoBERTa, ELECTRA, ...)."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_bert.policies import POLICIES  # imported here so that listing plugins stays cheap

    return list(POLICIES)
