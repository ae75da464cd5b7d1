"""tp-vision: tpcore policies for image encoders (ViT, DeiT, BEiT, DINOv2, Swin), two-tower and
captioning models (CLIP, SigLIP, BLIP), DETR, and the vision towers of LLaVA-style models."""

import tpcore

__version__ = "0.1.0"


@tpcore.hookimpl
def tpcore_register_policies():
    from tp_vision.policies import POLICIES  # imported here so that listing plugins stays cheap

    return list(POLICIES)
