"""Decoding and validating image content parts into RGB pixel tensors (no model code).

Images reach the server as OpenAI-style content parts, ``{"type": "image_url", "image_url": {"url": ...}}``
(the Anthropic adapter converts its base64 image blocks into that shape; ``messages.Image.part`` keeps the
part as sent). ``decode_image`` turns one part into an RGB ``uint8`` tensor ``[H, W, 3]`` or raises
``ImageError`` with a message that names where the part was, what was wrong and what is allowed.

The input is untrusted, so every limit is checked as early as the data allows: the encoded size before
base64 decoding, the file size before reading a local file, and the pixel count from the image header before
any pixel data is decoded (Pillow's ``Image.open`` only reads the header). Remote URLs are refused: the server
never fetches from the network.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import stat
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

LOCAL_IMAGES_FLAG = "--allow-local-images"

# Media types by Pillow format name; "image/jpg" is a common misspelling that clients send.
MEDIA_TYPES = {"PNG": ("image/png",), "JPEG": ("image/jpeg", "image/jpg"), "GIF": ("image/gif",),
               "WEBP": ("image/webp",), "BMP": ("image/bmp",), "TIFF": ("image/tiff",)}

# Magic numbers of common formats, only to name a refused format in the error message: the data is opened by
# the allowed formats' parsers alone, so no other format's parser ever runs on client bytes.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"),
    (b"%PDF", "PDF"), (b"8BPS", "PSD"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class ImageError(ValueError):
    """An image part that cannot be used; the message says where, what was wrong and what is allowed."""

    def __init__(self, where: str, detail: str):
        self.where, self.detail = where, detail
        super().__init__(f"{where}: {detail}")


@dataclass(frozen=True)
class ImageLimits:
    """What ``decode_image`` accepts. Sizes are limits on the decoded file and on width * height."""

    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    formats: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP")
    allow_local_files: bool = False  # file:// URLs and plain paths (the server's --allow-local-images)
    local_root: str | None = None  # when set, local files must resolve (realpath) inside this folder

    def __post_init__(self):
        # A misspelt format would otherwise surface as a KeyError inside Pillow on the first request. Loading
        # every Pillow plugin to check is slow, so it is done only for formats beyond the usual four.
        formats = tuple(str(f).upper() for f in self.formats)
        if not set(formats) <= {"PNG", "JPEG", "GIF", "WEBP"}:
            Image.init()
        unknown = [f for f in formats if f not in ("PNG", "JPEG", "GIF", "WEBP") and f not in Image.OPEN]
        if unknown or not formats:
            raise ValueError(f"unknown image formats {unknown}; Pillow reads {sorted(Image.OPEN)}")
        object.__setattr__(self, "formats", formats)


DEFAULT_LIMITS = ImageLimits()


def decode_image(part: Mapping[str, Any], where: str, limits: ImageLimits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode an image content part into an RGB ``uint8`` tensor ``[H, W, 3]``.

    Palette, grayscale, 16-bit, CMYK and alpha images become RGB (alpha composited on white); an animated
    image gives its first frame; the EXIF orientation is applied. Raises ``ImageError`` for anything refused.
    """
    data = _read(_url_of(part, where), where, limits)
    img = _open(data, where, limits)
    try:
        img.load()
        # exif_transpose returns a rotated copy (or a plain copy) and reads EXIF that may itself be malformed.
        img = ImageOps.exif_transpose(img)
        pixels = _to_rgb(img)
    except ImageError:
        raise
    except Exception as e:  # client bytes: any parser failure is the client's broken image, not a server error
        raise ImageError(where, f"could not decode the image: {str(e) or type(e).__name__}") from None
    return torch.from_numpy(pixels)


def image_digest(pixels: torch.Tensor) -> str:
    """A stable hex digest of decoded pixels (shape, dtype and bytes), used as a cache key."""
    array = pixels.detach().cpu().contiguous().numpy()
    h = hashlib.sha256(f"{tuple(array.shape)}|{array.dtype.str}|".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def to_data_url(image: Image.Image | torch.Tensor | np.ndarray, fmt: str = "PNG", **save_options: Any) -> str:
    """Encode an image as a ``data:<media type>;base64,...`` URL.

    A tensor or array must be ``uint8`` ``[H, W, 3]`` (RGB). A PIL image is saved in its own mode, so callers
    can also build palette, grayscale or RGBA test images. ``save_options`` go to ``PIL.Image.save``.
    """
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected a uint8 array [H, W, 3], got {image.dtype} {list(image.shape)}")
        image = Image.fromarray(np.ascontiguousarray(image), "RGB")
    fmt = fmt.upper()
    media = MEDIA_TYPES.get(fmt, (f"image/{fmt.lower()}",))[0]
    buf = io.BytesIO()
    image.save(buf, fmt, **save_options)
    return f"data:{media};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def _url_of(part: Mapping[str, Any], where: str) -> str:
    """The URL (data URL, file URL or path) of an image part, in any of the shapes clients send."""
    usage = 'expected {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}'
    if not isinstance(part, Mapping):
        raise ImageError(where, f"an image part must be an object; {usage}")
    source = part.get("source")
    if isinstance(source, Mapping):  # an Anthropic-style block that reached here unconverted
        if source.get("type") == "base64":
            return f"data:{source.get('media_type')};base64,{source.get('data') or ''}"
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return source["url"]
    for key in ("image_url", "url", "image"):
        value = part.get(key)
        if isinstance(value, Mapping):
            value = value.get("url")
        if isinstance(value, str) and value:
            return value
    raise ImageError(where, f"the image part has no image URL; {usage}")


def _read(url: str, where: str, limits: ImageLimits) -> bytes:
    """The encoded image file bytes behind a URL, within ``limits.max_bytes``."""
    scheme = _SCHEME.match(url)
    scheme = scheme.group(1).lower() if scheme else None
    if scheme == "data":
        return _read_data_url(url, where, limits)
    if scheme in ("http", "https"):
        raise ImageError(
            where,
            "remote image URLs are refused because the server does not fetch from the network; "
            "send the image inline as a base64 data URL (data:image/png;base64,...)",
        )
    if scheme == "file":
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ImageError(where, f"file URLs must name a local path (file:///path), got host {parsed.netloc!r}")
        return _read_local(unquote(parsed.path), where, limits)
    # A one-letter "scheme" is a Windows drive letter (C:\...), which is a path.
    if scheme is not None and len(scheme) > 1:
        raise ImageError(
            where, f"unsupported URL scheme {scheme + ':'!r}; send the image as a base64 data URL (data:image/...)"
        )
    return _read_local(url, where, limits)


def _read_data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise ImageError(where, "malformed data URL: no ',' before the data; expected data:image/png;base64,...")
    fields = [f.strip() for f in header.split(";")]
    media = fields[0].lower()
    allowed = [m for fmt in limits.formats for m in MEDIA_TYPES.get(fmt, (f"image/{fmt.lower()}",))]
    if media not in allowed:
        raise ImageError(where, f"data URL media type {fields[0]!r} is not one of {allowed}")
    if fields[-1].lower() != "base64":
        raise ImageError(where, "data URLs must be base64-encoded (data:<media type>;base64,<data>)")
    # Line breaks and spaces inside the base64 text are common (MIME-wrapped encoders) and harmless.
    payload = "".join(payload.split())
    if not payload:
        raise ImageError(where, "the image data is empty")
    # Refuse an oversized payload from its length, before allocating the decoded bytes.
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise ImageError(where, f"the image is about {len(payload) // 4 * 3} bytes, over the limit of "
                                f"{limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(where, "the data URL payload is not valid base64") from None
    if not data:
        raise ImageError(where, "the image data is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(where, f"the image is {len(data)} bytes, over the limit of {limits.max_bytes} bytes")
    return data


def _read_local(path: str, where: str, limits: ImageLimits) -> bytes:
    if not limits.allow_local_files:
        raise ImageError(
            where,
            f"local image files are refused (start the server with {LOCAL_IMAGES_FLAG} to allow them); "
            "send the image as a base64 data URL instead",
        )
    if not path:
        raise ImageError(where, "the local image path is empty")
    # realpath resolves every symlink and '..', so a link inside the root that points outside is caught.
    if limits.local_root is not None:
        root = os.path.realpath(limits.local_root)
        real = os.path.realpath(os.path.join(root, path))
        if os.path.commonpath([root, real]) != root:
            raise ImageError(where, f"local image path {path!r} is outside the allowed folder {limits.local_root!r}")
    else:
        real = os.path.realpath(path)
    try:
        # O_NOFOLLOW: the resolved path must not have become a symlink since realpath looked at it.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ImageError(where, f"local image file {path!r} does not exist") from None
    except OSError as e:
        raise ImageError(where, f"could not read local image file {path!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        # Only regular files: a device (/dev/zero), FIFO or folder has no meaningful size and may never end.
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(where, f"local image path {path!r} is not a regular file")
        if st.st_size > limits.max_bytes:
            raise ImageError(where, f"the image is {st.st_size} bytes, over the limit of {limits.max_bytes} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limits.max_bytes + 1)  # the file may have grown since fstat
    finally:
        os.close(fd)
    if not data:
        raise ImageError(where, "the image data is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(where, f"the image is over the limit of {limits.max_bytes} bytes")
    return data


def _open(data: bytes, where: str, limits: ImageLimits) -> Image.Image:
    """Open the image lazily (header only) with the allowed formats' parsers and check its size."""
    allowed = ", ".join(limits.formats)
    try:
        # Pillow warns above MAX_IMAGE_PIXELS and raises above twice that; our own max_pixels check below is
        # the authority, so the warning is silenced and the error is reported as a pixel-limit refusal.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(limits.formats))
    except Image.DecompressionBombError as e:
        raise ImageError(where, f"the image has too many pixels, over the limit of {limits.max_pixels} "
                                f"pixels ({e})") from None
    except UnidentifiedImageError:
        found = next((name for magic, name in _SIGNATURES if data.startswith(magic)), None)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            found = "WEBP"
        elif data[4:12] in (b"ftypavif", b"ftypheic", b"ftypheix", b"ftypmif1"):
            found = "AVIF/HEIF"
        elif data.lstrip()[:5].lower() in (b"<?xml", b"<svg ", b"<svg>"):
            found = "SVG"
        if found is not None and found not in limits.formats:
            raise ImageError(where, f"{found} images are not supported; allowed formats: {allowed}") from None
        if found is not None and 0 in _header_size(data):
            raise ImageError(where, f"the image has zero width or height ({found} header)") from None
        if found is not None:
            raise ImageError(where, f"could not decode the image: the {found} data is corrupt") from None
        raise ImageError(where, f"the data is not a recognised image; allowed formats: {allowed}") from None
    except Exception as e:  # a header that a parser chokes on: the client's broken image
        raise ImageError(where, f"could not decode the image: {str(e) or type(e).__name__}") from None
    # MPO (multi-picture JPEG, as many phone cameras write) is a JPEG file whose first picture is a JPEG.
    fmt = "JPEG" if img.format == "MPO" else img.format
    if fmt not in limits.formats:
        raise ImageError(where, f"{img.format} images are not supported; allowed formats: {allowed}")
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageError(where, f"the image has zero width or height ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageError(
            where, f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                   f"{limits.max_pixels} pixels",
        )
    return img


def _header_size(data: bytes) -> tuple[int, ...]:
    """Width and height from a PNG or GIF header (Pillow refuses zero sizes before saying so), else ()."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    return ()


def _to_rgb(img: Image.Image) -> np.ndarray:
    """An RGB uint8 array [H, W, 3] of a loaded image of any mode."""
    if img.mode.startswith(("I", "F")):
        # 16-bit (and 32-bit) grayscale: Pillow's convert clips to 255, so scale the full range down instead.
        array = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or array.max(initial=0) > 255 else 255.0
        gray = np.clip(np.rint(array * (255.0 / top)), 0, 255).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.array(img, dtype=np.uint8).reshape(img.size[1], img.size[0], 3)


# --- a conversation's images -----------------------------------------------------------------------------------
WHERE = "_where"  # an adapter may name an image part's place in its own API's request under this key


def image_parts(messages: list[Any]):
    """(where, part) for every image part of a conversation: ``messages[i].content[j]``, or the adapter's own
    name for the part under the ``_where`` key."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in ("image_url", "image"):
                yield part.get(WHERE) or f"messages[{i}].content[{j}]", part


def decode_conversation(messages: list[Any], limits: ImageLimits = DEFAULT_LIMITS) -> dict[int, torch.Tensor]:
    """Every image part's pixels, keyed by the part's id(); ImageError names the first bad one."""
    return {id(part): decode_image(part, where, limits) for where, part in image_parts(messages)}


def render_with_images(tokenizer, messages: list[Any], pixels: dict[int, torch.Tensor], tokens_for, **render):
    """(Rendered, the images' pixels in placeholder order): each image takes ``tokens_for(height, width)``
    placeholders (the model's vision config decides; this module knows no model)."""
    from horizon.chat.template import ChatTemplate

    template = ChatTemplate(tokenizer, image_tokens=lambda part: tokens_for(*pixels[id(part)].shape[:2]))
    out = template.render(messages, **render)
    return out, [pixels[id(part)] for part in out.images]
