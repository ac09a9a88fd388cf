"""A photo file to the RGB pixels the model sees: the one decoding every host path uses (image folders held in
memory, streamed shards, `job shard`'s check, and predict), so a photo is the same array whichever way it is read.

- EXIF orientation is applied (a phone stores a portrait photo sideways with a tag saying how to turn it): the
  model sees the photo as a person does, as any viewer shows it.
- HEIC/HEIF (iPhones' default) through pillow-heif, AVIF where the installed Pillow reads it.
- Every mode becomes 8-bit RGB: CMYK through Pillow's JPEG colour conversion, grey and palette images repeated
  across the channels, alpha dropped (the colour under it kept, as Pillow's convert("RGB") and torchvision's RGB
  mode do), 16-bit images scaled to 8 bits (v * 255 / 65535, rounded), never clipped or wrapped.

Pillow does the work (it is the reader every other tool's preprocessing is written against); this module only
decides the conversions above, in one place.
"""

from __future__ import annotations

import functools
import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from job.data.preprocess import Preprocess
from job.data.split import SUFFIXES
from job.errors import DataError, one_line


@functools.cache
def heif_readable() -> bool:
    """Pillow reads iPhones' HEIC from here on (pillow-heif's opener registered, once); False where pillow-heif is
    missing, and every other format is still read. Called before an image is opened, not at import: the import costs
    0.04 s of CPU that a run on a table never needs."""
    try:
        import pillow_heif
    except ImportError:  # pragma: no cover - installed with the project
        return False
    pillow_heif.register_heif_opener()
    return True


SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")


class UnreadableImage(DataError):
    """An image file that cannot be decoded; `reason` says why in words, without the file's name."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"cannot decode image {name}: {reason}")
        self.name, self.reason = name, reason

    def __reduce__(self):  # raised in a decoding process and sent back whole: the file stays named
        return (UnreadableImage, (self.name, self.reason))


def open_rgb(data: bytes, name: str, draft: int | None = None) -> Image.Image:
    """The photo upright in 8-bit RGB. `draft`: the smallest size (both sides) the caller will resize to; a large
    JPEG is then decoded at a reduced scale no smaller than it (libjpeg's DCT scaling: a 12 MP photo held at 224
    px decodes several times faster)."""
    heif_readable()
    try:
        with Image.open(io.BytesIO(data)) as img:
            if draft is not None and img.format == "JPEG":
                img.draft("RGB", (draft, draft))
            img.load()
            upright = ImageOps.exif_transpose(img)
            return to_rgb(upright)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UnreadableImage(name, image_fault(data, e)) from None


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in SIXTEEN_BIT:
        wide = np.asarray(img, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(wide * (255 / 65535)), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # Pillow asks for this step for palettes with transparency
    # A transparent colour of a grey or RGB image goes, as an alpha would: Pillow warns of it otherwise, and a
    # catch_warnings here is not thread-safe (the device decoder's thread decodes through this).
    img.info.pop("transparency", None)
    return img.convert("RGB")


def pixels(data: bytes, name: str, pre: Preprocess | None = None) -> np.ndarray:
    """uint8 H x W x 3 of an image file, held as `pre` says (job/data/preprocess.py; None: as the file is)."""
    pre = pre or Preprocess()
    return np.asarray(pre.hold(open_rgb(data, name, pre.draft)), dtype=np.uint8)


def pixel_bytes(img: np.ndarray) -> bytes:
    """A uint8 H x W x 3 image as the bytes a pack keeps it decoded in: numpy's .npy format."""
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(img, dtype=np.uint8), allow_pickle=False)
    return out.getvalue()


def stored_pixels(data: bytes, name: str, pre: Preprocess | None = None) -> np.ndarray:
    """uint8 H x W x 3 of an image a pack keeps decoded (pixel_bytes), held as `pre` says: resized, where it
    asks for another size, as a decoded file is (Pillow's), from the full-size pixels (as the device decoder does).
    Performance: about 2 us an image where nothing is resized (its header parsed once per layout; no copy)."""
    pre = pre or Preprocess()
    try:
        wide = data[6:7] != b"\x01"  # .npy version 1: a 2-byte header length; later versions: 4 bytes
        start = 12 + int.from_bytes(data[8:12], "little") if wide else 10 + int.from_bytes(data[8:10], "little")
        shape = npy_shape(bytes(data[:start]))
        img = np.frombuffer(data, np.uint8, offset=start).reshape(shape)
    except (ValueError, KeyError) as e:
        raise UnreadableImage(name, f"not the pixels of an image ({one_line(e)})") from None
    h, w = shape[:2]
    if pre.size is None or (pre.size == (h, w) and pre.box(w, h) == (0, 0, w, h)):
        return img
    return np.asarray(pre.hold(Image.fromarray(img, "RGB")), dtype=np.uint8)


@functools.lru_cache(64)
def npy_shape(header: bytes) -> tuple[int, int, int]:
    """The shape of a .npy array of uint8 H x W x 3 from its header (every image of a size has the same one)."""
    f = io.BytesIO(header)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    shape, fortran, dtype = read[np.lib.format.read_magic(f)](f)
    if dtype != np.uint8 or fortran or len(shape) != 3 or shape[2] != 3:
        raise ValueError(f"a {dtype} array of shape {shape}, not uint8 H x W x 3")
    return shape


def image_size(data: bytes, name: str) -> tuple[int, int]:
    """(width, height) of the photo as it is shown (after its EXIF turn), fully decoded: a truncated file is found
    here, not in the middle of training."""
    return open_rgb(data, name).size


ORIENTATION = 0x0112  # the EXIF tag


def exif_orientation(data: bytes) -> int:
    """A JPEG's EXIF orientation (1: upright, 2 to 8: how to turn it), from its header alone; 1 where it has none or
    it cannot be read (the decoder then names the file). For decoders that do not apply it (nvJPEG)."""
    if b"Exif\x00\x00" not in data[:65536]:  # EXIF lives in APP1, at the start of the file
        return 1
    heif_readable()
    try:
        with Image.open(io.BytesIO(data)) as img:
            value = img.getexif().get(ORIENTATION, 1)
    except Exception:  # Pillow raises many types on a damaged header; decoding names the file
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def image_fault(data: bytes, e: Exception) -> str:
    """Why Pillow could not read an image, in words (its own message for bytes names a BytesIO object)."""
    if not data:
        return "an empty file"
    if isinstance(e, UnidentifiedImageError):
        heic = not heif_readable() and data[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypmsf1")
        if heic:
            return "a HEIC photo: install pillow-heif to read it"
        return f"not an image file, or a damaged one (images read: {SUFFIXES.replace('|', ', ')})"
    if "truncated" in str(e).lower():
        return "truncated: the file ends before the image does"
    return one_line(e)
