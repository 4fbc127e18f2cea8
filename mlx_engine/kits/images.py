"""Decoding and checking the base64 images of a request (``images_b64``).

Everything here runs eagerly in ``create_generator``, before any model work, so a
bad image raises a ``ValueError`` naming ``images_b64`` and the item."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import struct
import warnings
from dataclasses import dataclass

from ..errors import InvalidArgument

DEFAULT_MAX_IMAGE_PIXELS = 32_000_000  # width * height, per image
_DATA_URL = re.compile(r"^data:[\w.+/-]*;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class DecodedImage:
    """An RGB image and the hash of its encoded bytes (which identifies it in the
    prompt cache and the vision-feature cache)."""

    image: object  # PIL.Image.Image, RGB
    sha256: str

    @property
    def key(self) -> int:
        """A negative cache key derived from the hash: never a real token id, nor
        the cache's placeholder for a not-yet-known id (-1)."""
        return -(int(self.sha256[:15], 16) + 2)


def _header_size(raw: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG, GIF or BMP header, read without Pillow (which
    refuses zero-size images as 'not an image')."""
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) >= 24:
        return struct.unpack(">II", raw[16:24])
    if raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 10:
        return struct.unpack("<HH", raw[6:10])
    if raw[:2] == b"BM" and len(raw) >= 26:
        w, h = struct.unpack("<ii", raw[18:26])
        return abs(w), abs(h)
    return None


def validate_max_image_pixels(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"max_image_pixels must be a positive integer, got {value!r}")
    return value


def decode_images(images_b64, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[DecodedImage]:
    """Decode and check every image; raises ValueError naming ``images_b64``."""
    if isinstance(images_b64, (str, bytes)):
        raise InvalidArgument("{param} must be a list of base64-encoded images, not a single string", "images_b64")
    try:
        items = list(images_b64)
    except TypeError:
        raise InvalidArgument(
            "{param} must be a list of base64 strings, got {kind}", "images_b64", kind=type(images_b64).__name__
        ) from None
    return [_decode_one(i, item, max_pixels) for i, item in enumerate(items)]


def _bad(i: int, template: str, **values: object) -> InvalidArgument:
    """Image ``i`` (``images_b64[i]``) is refused: ``template`` says why."""
    return InvalidArgument("{param} " + template, "images_b64", index=i, **values)


def _decode_one(i: int, item, max_pixels: int) -> DecodedImage:
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(item, bytes):
        try:
            item = item.decode("ascii")
        except UnicodeDecodeError:
            raise _bad(i, "is not valid base64 (non-ASCII bytes)") from None
    if not isinstance(item, str):
        raise _bad(i, "must be a base64 string, got {kind}", kind=type(item).__name__)
    text = _DATA_URL.sub("", item.strip(), count=1)
    if not text:
        raise _bad(i, "is empty")
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(i, "is not valid base64: {detail}", detail=exc) from None
    if not raw:
        raise _bad(i, "is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
            width, height = img.size
            if width <= 0 or height <= 0:
                raise _bad(i, "has zero size ({size})", size=f"{width}x{height}")
            if width * height > max_pixels:
                raise _bad(
                    i,
                    "has too many pixels: {size} = {pixels} > the limit of {most} ({max_image_pixels})",
                    size=f"{width}x{height}",
                    pixels=width * height,
                    most=max_pixels,
                )
            img.load()
            rgb = ImageOps.exif_transpose(img).convert("RGB")  # honour camera orientation
    except ValueError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        if isinstance(exc, UnidentifiedImageError):
            size = _header_size(raw)
            if size is not None and 0 in size:
                raise _bad(i, "has zero size ({size})", size=f"{size[0]}x{size[1]}") from None
            raise _bad(i, "is not an image Pillow can read (PNG, JPEG, WebP, GIF, ...)") from None
        raise _bad(i, "has too many pixels: {detail}", detail=exc) from None
    except (OSError, SyntaxError, EOFError) as exc:
        raise _bad(i, "could not be decoded as an image (truncated or corrupt?): {detail}", detail=exc) from None
    if rgb.width <= 0 or rgb.height <= 0:
        raise _bad(i, "has zero size ({size})", size=f"{rgb.width}x{rgb.height}")
    return DecodedImage(rgb, hashlib.sha256(raw).hexdigest())
