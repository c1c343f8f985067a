"""Image content parts: decoding to RGB tensors, conversions, and every refusal (horizon.chat.images)."""

import base64
import io
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from horizon.chat.images import ImageError, ImageLimits, decode_image, image_digest, to_data_url

WHERE = "messages[2].content[1]"


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def encode(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def pattern(w: int = 7, h: int = 5) -> np.ndarray:
    """An RGB image with distinct pixels, so a transposition or channel swap shows."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 30, y * 40, (x + y) * 10 + 5], axis=2).astype(np.uint8)


def refused(url_or_part, phrase: str, limits: ImageLimits | None = None) -> str:
    p = part(url_or_part) if isinstance(url_or_part, str) else url_or_part
    with pytest.raises(ImageError) as info:
        decode_image(p, WHERE, limits or ImageLimits())
    message = str(info.value)
    assert WHERE in message and phrase in message, message
    return message


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR is patched (CRC fixed) to claim another size."""
    raw = bytearray(encode(Image.new("RGB", (1, 1)), "PNG"))
    raw[16:24] = struct.pack(">II", width, height)
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))
    return bytes(raw)


# ---- round trips and conversions


@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {})])
def test_lossless_round_trip(fmt, options):
    pixels = pattern()
    if fmt == "GIF":  # GIF holds at most 256 colours; keep few so the palette is exact
        pixels = (pixels // 128 * 255).astype(np.uint8)
    out = decode_image(part(to_data_url(torch.from_numpy(pixels), fmt, **options)), WHERE)
    assert out.dtype == torch.uint8 and out.shape == (5, 7, 3)
    assert torch.equal(out, torch.from_numpy(pixels))


def test_jpeg_round_trip_is_close():
    pixels = np.kron(pattern(4, 3), np.ones((8, 8, 1), dtype=np.uint8))  # flat 8x8 blocks suit JPEG
    out = decode_image(part(to_data_url(pixels, "JPEG", quality=95)), WHERE)
    assert out.shape == (24, 32, 3)
    assert (out.int() - torch.from_numpy(pixels).int()).abs().float().mean() < 4


def test_rgba_is_composited_on_white():
    img = Image.new("RGBA", (2, 1))
    img.putpixel((0, 0), (255, 0, 0, 0))  # fully transparent red -> white
    img.putpixel((1, 0), (0, 0, 255, 128))  # half-transparent blue -> light blue
    out = decode_image(part(to_data_url(img)), WHERE)
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [127, 127, 255]


def test_grayscale_palette_and_bilevel_become_rgb():
    gray = Image.new("L", (3, 2), 77)
    assert decode_image(part(to_data_url(gray)), WHERE).tolist() == [[[77] * 3] * 3] * 2
    pal = Image.new("P", (2, 2))
    pal.putpalette([10, 20, 30, 200, 100, 50])
    pal.putpixel((1, 1), 1)
    out = decode_image(part(to_data_url(pal)), WHERE)
    assert out[0, 0].tolist() == [10, 20, 30] and out[1, 1].tolist() == [200, 100, 50]
    bilevel = Image.new("1", (2, 2), 1)
    assert decode_image(part(to_data_url(bilevel)), WHERE).unique().tolist() == [255]


def test_palette_transparency_and_16_bit_gray():
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 0, 255, 0])
    pal.putpixel((1, 0), 1)
    out = decode_image(part(data_url(encode(pal, "PNG", transparency=0))), WHERE)
    assert out[0, 0].tolist() == [255, 255, 255] and out[0, 1].tolist() == [0, 255, 0]
    deep = Image.new("I;16", (2, 2), 65535)
    deep.putpixel((0, 0), 0)
    out = decode_image(part(to_data_url(deep)), WHERE)
    assert out[0, 0].tolist() == [0, 0, 0] and out[1, 1].tolist() == [255, 255, 255]


def test_cmyk_jpeg_becomes_rgb():
    out = decode_image(part(data_url(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"))), WHERE)
    assert out.shape == (8, 8, 3)
    r, g, b = out[4, 4].tolist()
    assert r > 200 and g < 60 and b < 60  # CMYK (0, 255, 255, 0) is red


def test_animated_gif_gives_first_frame():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    raw = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    out = decode_image(part(data_url(raw, "image/gif")), WHERE)
    assert out.shape == (4, 4, 3) and (out == torch.tensor([255, 0, 0], dtype=torch.uint8)).all()


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    out = decode_image(part(data_url(encode(img, "JPEG", exif=exif, quality=95), "image/jpeg")), WHERE)
    assert out.shape == (40, 20, 3)
    top, bottom = out[5, 10].tolist(), out[35, 10].tolist()
    assert top[0] > 200 and top[2] < 60  # the left edge (red) is now at the top
    assert bottom[2] > 200 and bottom[0] < 60


def test_other_part_shapes_and_declared_type_mismatch():
    url = to_data_url(pattern())
    expected = torch.from_numpy(pattern())
    shapes = [
        {"type": "image_url", "image_url": url},
        {"type": "image", "image_url": {"url": url}},
        {"type": "image", "url": url},
        {"type": "image", "image": url},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}},
    ]
    for p in shapes:
        assert torch.equal(decode_image(p, WHERE), expected), p
    # The declared media type is only a hint: the bytes decide (a PNG sent as image/jpeg decodes as PNG).
    assert torch.equal(decode_image(part(url.replace("image/png", "image/jpeg")), WHERE), expected)
    # Base64 wrapped over lines, as MIME encoders write it, is fine.
    head, payload = url.split(",", 1)
    wrapped = head + "," + "\n".join(payload[i:i + 76] for i in range(0, len(payload), 76))
    assert torch.equal(decode_image(part(wrapped), WHERE), expected)


def test_image_digest_is_stable_and_shape_sensitive():
    a = torch.from_numpy(pattern())
    assert image_digest(a) == image_digest(a.clone()) and len(image_digest(a)) == 64
    assert image_digest(a) != image_digest(a.reshape(7, 5, 3))
    b = a.clone()
    b[0, 0, 0] += 1
    assert image_digest(a) != image_digest(b)
    assert image_digest(a.permute(1, 0, 2)) == image_digest(a.permute(1, 0, 2).contiguous())


def test_to_data_url_checks_its_input():
    assert to_data_url(pattern(), "JPEG").startswith("data:image/jpeg;base64,")
    assert to_data_url(Image.new("RGB", (1, 1)), "webp").startswith("data:image/webp;base64,")
    with pytest.raises(ValueError):
        to_data_url(torch.zeros(2, 2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        to_data_url(torch.zeros(2, 2, 3))


# ---- refusals


def test_remote_urls_are_refused():
    for url in ("https://example.com/cat.png", "HTTP://example.com/cat.png"):
        message = refused(url, "remote image URLs are refused")
        assert "does not fetch from the network" in message and "base64 data URL" in message
    refused("ftp://example.com/cat.png", "unsupported URL scheme")


@pytest.mark.parametrize(
    "url,phrase",
    [
        ("data:image/png;base64,", "image data is empty"),
        ("data:image/png;base64,   \n", "image data is empty"),
        ("data:image/png;base64,!!!not base64!!!", "not valid base64"),
        ("data:image/png;base64,abc", "not valid base64"),
        ("data:image/png;base64" + "AAAA", "malformed data URL"),
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "media type 'text/plain' is not one of"),
        ("data:image/bmp;base64,Qk0=", "media type 'image/bmp' is not one of"),
        ("data:;base64,AAAA", "media type '' is not one of"),
        ("data:image/png,%89PNG", "must be base64-encoded"),
        (data_url(b"just some text, not an image"), "not a recognised image"),
        (data_url(encode(Image.fromarray(pattern(40, 30)), "PNG")[:-40]), "could not decode the image"),
        (data_url(encode(Image.new("RGB", (4, 4)), "JPEG")[:-200], "image/jpeg"), "could not decode the image"),
        (data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), "could not decode the image"),
        (data_url(png_claiming(0, 5)), "zero width or height"),
        ({"type": "image_url", "image_url": {"detail": "low"}}, "has no image URL"),
        ({"type": "image"}, "has no image URL"),
    ],
)
def test_bad_data_is_refused(url, phrase):
    refused(url, phrase)


def test_unsupported_formats_are_named():
    for fmt in ("BMP", "TIFF"):
        message = refused(data_url(encode(Image.new("RGB", (2, 2)), fmt)), f"{fmt} images are not supported")
        assert "allowed formats: PNG, JPEG, GIF, WEBP" in message
    # A format can be allowed explicitly; one not allowed is refused even though Pillow reads it.
    png = data_url(encode(Image.new("RGB", (2, 2)), "PNG"), "image/jpeg")  # the bytes decide, not the label
    refused(png, "PNG images are not supported", ImageLimits(formats=("JPEG", "webp")))
    bmp = data_url(encode(Image.new("RGB", (2, 2), (1, 2, 3)), "BMP"), "image/bmp")
    assert decode_image(part(bmp), WHERE, ImageLimits(formats=("PNG", "BMP")))[0, 0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown image formats"):
        ImageLimits(formats=("PNG", "NOPE"))


def test_byte_limit():
    url = to_data_url(pattern(64, 64))
    raw = base64.b64decode(url.split(",", 1)[1])
    assert decode_image(part(url), WHERE, ImageLimits(max_bytes=len(raw))).shape == (64, 64, 3)
    refused(url, "bytes, over the limit of", ImageLimits(max_bytes=len(raw) - 1))
    refused(url, "bytes, over the limit of", ImageLimits(max_bytes=len(raw) // 2))  # refused before decoding


def test_pixel_limit():
    url = to_data_url(pattern(10, 10))
    assert decode_image(part(url), WHERE, ImageLimits(max_pixels=100)).shape == (10, 10, 3)
    refused(url, "10x10 = 100 pixels, over the limit of 99 pixels", ImageLimits(max_pixels=99))


@pytest.mark.parametrize("size", [(5000, 5000), (100_000, 100_000)])
def test_decompression_bomb_header_is_refused_without_decoding(size, monkeypatch):
    def no_load(self):
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    raw = png_claiming(*size)
    assert len(raw) < 100
    refused(data_url(raw), "pixels", ImageLimits())
    message = refused(data_url(raw), "over the limit of 16777216 pixels")
    assert "could not decode" not in message


# ---- local files


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    inside = root / "sub" / "cat.png"
    inside.write_bytes(encode(Image.fromarray(pattern()), "PNG"))
    outside = tmp_path / "secret.png"
    outside.write_bytes(encode(Image.fromarray(pattern()), "PNG"))
    (root / "link.png").symlink_to(outside)
    (root / "dirlink").symlink_to(tmp_path)
    return root, inside, outside


def test_local_files_are_refused_by_default(files):
    root, inside, _ = files
    for url in (str(inside), f"file://{inside}", "cat.png", "./cat.png"):
        message = refused(url, "local image files are refused")
        assert "--allow-local-images" in message


def test_local_files_allowed(files):
    root, inside, outside = files
    expected = torch.from_numpy(pattern())
    anywhere = ImageLimits(allow_local_files=True)
    for url in (str(inside), f"file://{inside}", f"file://localhost{inside}", str(outside)):
        assert torch.equal(decode_image(part(url), WHERE, anywhere), expected), url
    rooted = ImageLimits(allow_local_files=True, local_root=str(root))
    for url in (str(inside), "sub/cat.png", f"file://{inside}"):
        assert torch.equal(decode_image(part(url), WHERE, rooted), expected), url
    for url in (str(outside), "../secret.png", "sub/../../secret.png", "link.png", "dirlink/secret.png",
                f"file://{outside}", "/etc/passwd"):
        refused(url, "is outside the allowed folder", rooted)
    refused("sub/missing.png", "does not exist", rooted)
    refused(str(root / "sub"), "not a regular file", rooted)
    refused("file://otherhost/x.png", "must name a local path", rooted)
    refused(str(inside), "bytes, over the limit of", ImageLimits(allow_local_files=True, max_bytes=50))
    empty = root / "empty.png"
    empty.write_bytes(b"")
    refused(str(empty), "image data is empty", rooted)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_local_device_files_are_refused():
    refused("/dev/zero", "not a regular file", ImageLimits(allow_local_files=True))
