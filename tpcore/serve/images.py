"""Images in chat messages, for a model that reads them (LLaVA, Qwen2-VL, Gemma 3, ...): the OpenAI API's
``image_url`` content parts turned into the model's inputs by its own processor.

A part ``{"type": "image_url", "image_url": {"url": ...}}`` names a ``data:image/...;base64,...`` URL (decoded here)
or, where the server allows fetching (``--allow-image-urls``), an ``http(s)`` one (fetched with a timeout and a size
bound). The messages go through the processor's chat template with an ``{"type": "image"}`` part in place of each
image, and the processor makes the prompt's token ids (each image's placeholder expanded to its image tokens) and
the image inputs (``pixel_values``, and what else the model takes: ``image_sizes``, ...), which the prompt's prefill
passes to the model's forward.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from tpcore.serve.requests import ServeError

__all__ = ["ImageChat", "has_images"]

#: the largest image a URL may give
MAX_IMAGE_BYTES = 20 << 20
#: seconds a fetch of an image URL may take
FETCH_TIMEOUT_S = 10.0


def has_images(messages: list[Any]) -> bool:
    """Whether any message (``ChatMessage``) holds an ``image_url`` part."""
    return any(
        isinstance(message.content, list) and any(part.get("type") == "image_url" for part in message.content)
        for message in messages
    )


class ImageChat:
    """Chat messages with images, through ``processor`` (its ``image_processor`` and chat template);
    ``fetch``: ``http(s)`` image URLs are fetched."""

    def __init__(self, processor: Any, fetch: bool = False):
        self.processor, self.fetch = processor, fetch

    def inputs(self, messages: list[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt's token ids and the image inputs of ``messages`` (``ChatMessage``)."""
        images, shaped = [], []
        for message in messages:
            if isinstance(message.content, str):
                shaped.append({"role": message.role, "content": [{"type": "text", "text": message.content}]})
                continue
            parts = []
            for part in message.content:
                if part.get("type") == "image_url":
                    images.append(self.image(part))
                    parts.append({"type": "image"})
                elif part.get("type") == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
            shaped.append({"role": message.role, "content": parts})
        text = self.processor.apply_chat_template(shaped, add_generation_prompt=True, tokenize=False)
        encoded = self.processor(text=text, images=images or None, return_tensors="pt")
        extras = {key: value for key, value in encoded.items() if key not in ("input_ids", "attention_mask")}
        return encoded["input_ids"][0].tolist(), extras

    def image(self, part: dict[str, Any]) -> Any:
        """The picture of an ``image_url`` part, RGB."""
        from PIL import Image, UnidentifiedImageError

        source = part.get("image_url")
        url = source.get("url") if isinstance(source, dict) else source
        if not isinstance(url, str) or not url:
            raise ServeError("an image_url part needs {'url': ...}", "messages")
        data = self._bytes(url)
        try:
            with Image.open(io.BytesIO(data)) as picture:
                return picture.convert("RGB")
        except (UnidentifiedImageError, OSError) as error:
            raise ServeError(f"an image_url is no image this server reads: {error}", "messages") from None

    def _bytes(self, url: str) -> bytes:
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if not header.endswith(";base64"):
                raise ServeError("a data URL of an image must be base64 (data:image/png;base64,...)", "messages")
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ServeError("a data URL of an image is not valid base64", "messages") from None
        if url.startswith(("http://", "https://")):
            if not self.fetch:
                raise ServeError(
                    "this server fetches no image URLs (start it with --allow-image-urls); send the image as a "
                    "data URL",
                    "messages",
                )
            return _fetched(url)
        raise ServeError("an image URL must be a data: URL (or http(s), where the server fetches them)", "messages")


def _fetched(url: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as response:
            response.raise_for_status()
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ServeError(f"the image at {url} is over {MAX_IMAGE_BYTES} bytes", "messages")
            return bytes(data)
    except httpx.HTTPError as error:
        raise ServeError(f"the image at {url} could not be fetched: {error}", "messages") from None
