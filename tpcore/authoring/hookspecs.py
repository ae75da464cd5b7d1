"""Hook specifications of tpcore plugins (pluggy project ``"tpcore"``).

A plugin distribution declares an entry point in the group ``tpcore`` naming the module that
holds its hook implementations, marked with :data:`tpcore.hookimpl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from tpcore.authoring.policy import Policy
    from tpcore.authoring.quantized_format import QuantizedFormat

PROJECT = "tpcore"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marker for hook implementations in plugins: ``@tpcore.hookimpl``."""


@hookspec
def tpcore_register_policies() -> list[type[Policy]]:
    """Return the :class:`tpcore.Policy` classes this plugin provides.

    :return: a list of ``Policy`` subclasses, one per transformer layer class.
    """


@hookspec
def tpcore_register_quantized_formats() -> list[QuantizedFormat]:
    """Return the quantized checkpoint formats this plugin splits (:class:`tpcore.QuantizedFormat` objects).

    :return: a list of format objects, each for its own ``quantization_config.quant_method``.
    """
