"""Images (and other content parts) in text graphs.

``image(data, mime_type=...)`` or ``image(url=...)`` makes the value of a Variable that
holds an image: a small dict (``{"kind": "image", "mime_type": ..., "data": <base64>}``
or ``{"kind": "image", "url": ...}``), so a Variable can carry it and a checkpoint can
store it. An ``LLMCall`` / ``FormattedLLMCall`` with an image input sends it as an
OpenAI ``image_url`` content part (a ``data:`` URL for bytes) after the text; wherever
the image appears in text (the template, feedback requests, reprs) it reads as
``[image: image/png, 12,345 bytes]``. The backward's feedback requests carry the images
too, so the feedback model sees what the forward saw; feedback *about* an image input
is text, like any other. Images cross to workers as msgpack bytes in the node's ctx,
within the wire's limits (a too-big image fails with the limit named).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["describe_content", "image", "image_part", "is_image", "wire_image", "with_images"]

IMAGE_KIND = "image"


def image(
    data: bytes | None = None, *, mime_type: str = "image/png", url: str | None = None
) -> dict[str, str]:
    """The value of a Variable holding an image: ``bytes`` with a MIME type, or a URL.

    Example::

        photo = Variable(image(png_bytes, mime_type="image/png"), role="photo of the meter")
        answer = await llm_call("Read the meter.", question, photo, model=...)
    """
    if (data is None) == (url is None):
        raise TypeError("image() takes either the image's bytes or url=..., not both or neither")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "data:")):
            raise ValueError(f"image(url=...) must be an http(s) or data: URL, got {url!r:.80}")
        return {"kind": IMAGE_KIND, "url": url}
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"image(data) takes bytes, got {type(data).__name__}")
    if not isinstance(mime_type, str) or not mime_type.startswith("image/"):
        raise ValueError(f"image(mime_type=...) must be an image/* type, got {mime_type!r}")
    return {
        "kind": IMAGE_KIND,
        "mime_type": mime_type,
        "data": base64.b64encode(bytes(data)).decode("ascii"),
    }


def is_image(value: Any) -> bool:
    """True for a value made by ``image()`` (after a JSON or msgpack round trip too)."""
    return (
        isinstance(value, Mapping)
        and value.get("kind") == IMAGE_KIND
        and (isinstance(value.get("data"), str) or isinstance(value.get("url"), str))
    )


def image_bytes(value: Mapping[str, Any]) -> bytes:
    try:
        return base64.b64decode(str(value["data"]), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"an image value's data is not base64: {exc}") from None


def describe_content(value: Any) -> str:
    """How an image reads in text: ``[image: image/png, 12,345 bytes]`` / ``[image: URL]``."""
    if "url" in value:
        return f"[image: {value['url'][:120]}]"
    return f"[image: {value['mime_type']}, {len(image_bytes(value)):,} bytes]"


def wire_image(value: Mapping[str, Any]) -> dict[str, Any]:
    """The image as ctx data for a worker: raw bytes (msgpack bin), not base64."""
    if "url" in value:
        return {"url": str(value["url"])}
    return {"mime_type": str(value["mime_type"]), "data": image_bytes(value)}


def image_part(wired: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI content part of an image kept as ``wire_image`` data."""
    if "url" in wired:
        url = str(wired["url"])
    else:
        encoded = base64.b64encode(bytes(wired["data"])).decode("ascii")
        url = f"data:{wired['mime_type']};base64,{encoded}"
    return {"type": "image_url", "image_url": {"url": url}}


def with_images(text: str, images: Sequence[Mapping[str, Any]]) -> str | list[dict[str, Any]]:
    """A user message's content: the text alone, or the text then the images as parts."""
    if not images:
        return text
    return [{"type": "text", "text": text}, *(image_part(i) for i in images)]
