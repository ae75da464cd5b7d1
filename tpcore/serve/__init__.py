"""``tpcore serve``: a model (split over ranks, or whole) behind an OpenAI-compatible HTTP server that batches
concurrent requests (continuous batching for generation, one padded batch per step for embeddings).

Needs the ``serve`` extra (``pip install tpcore[serve]``: FastAPI and uvicorn). See docs/serving.md.
"""

from tpcore.serve.server import NotServable, RanksLost, Server, free_port, load_model, serve
from tpcore.serve.service import Limits, Service

__all__ = ["Limits", "NotServable", "RanksLost", "Server", "Service", "free_port", "load_model", "serve"]
