"""Decoding only a JPEG's crop: libjpeg-turbo 3's TurboJPEG API (``tj3SetCroppingRegion``) through ctypes.

A random resized crop keeps about half of an image. libjpeg-turbo can decode just a region: rows above
it are entropy-decoded and skipped (``jpeg_skip_scanlines``: no inverse DCT, no upsampling, no colour
conversion), columns outside it are not reconstructed (``jpeg_crop_scanline``) and decoding stops after
its last row, as TensorFlow's ``decode_and_crop_jpeg`` and DALI's ROI decoders do. TurboJPEG 3.0 exposes
this as a cropping region of ``tj3Decompress8``, combined with DCT scaling.

The library: PyPI's ``turbojpeg`` wheel (>= 0.0.2) ships libjpeg-turbo 3.0's ``libturbojpeg`` beside its
own module, which rayvit never imports (PyTurboJPEG installs a module of the same name); Debian 12 ships
only libjpeg-turbo 2.1, whose TurboJPEG API has no cropping region. ``RAYVIT_LIBTURBOJPEG`` names another
``libturbojpeg`` of version 3 or later. :func:`available` says whether one was found; where none is,
``data.cpu_decoder=turbojpeg`` stops with a message saying what to install (:func:`require`).

Errors are return codes here (TurboJPEG catches libjpeg's own), and warnings (a truncated file) count
as errors (``TJPARAM_STOPONWARNING``): the caller hands such a file to PIL, which decides.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import weakref
from functools import lru_cache
from typing import Optional

import numpy as np

# TurboJPEG 3.0's enums (turbojpeg.h).
_INIT_DECOMPRESS = 1
_STOPONWARNING, _SUBSAMP, _WIDTH, _HEIGHT, _COLORSPACE = 0, 4, 5, 6, 8
_PF_RGB = 0
_CS_CMYK, _CS_YCCK = 3, 4
# iMCU width in pixels per chroma subsampling (TJSAMP_444, 422, 420, GRAY, 440, 411, 441): a cropping
# region's left edge must fall on a multiple of it (scaled).
_MCU_WIDTH = {0: 8, 1: 16, 2: 16, 3: 8, 4: 8, 5: 32, 6: 8}

ENV = "RAYVIT_LIBTURBOJPEG"
INSTALL_HINT = ("pip install 'turbojpeg>=0.0.2' (its wheel ships libjpeg-turbo 3's libturbojpeg), or name a "
                f"libturbojpeg >= 3.0 in {ENV}, or set data.cpu_decoder=simplejpeg")


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _Scale(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


def _candidates() -> list[str]:
    """Where a libturbojpeg 3 may be: RAYVIT_LIBTURBOJPEG, the turbojpeg wheel's copy, the system's."""
    found = [os.environ[ENV]] if os.environ.get(ENV) else []
    try:
        from importlib import metadata

        dist = metadata.distribution("turbojpeg")
        found += [str(dist.locate_file(f)) for f in dist.files or () if "libturbojpeg" in f.name]
    except Exception:  # noqa: BLE001 - not installed, or metadata unreadable: try the system's
        pass
    system = ctypes.util.find_library("turbojpeg")
    return found + ([system] if system else [])


@lru_cache(maxsize=1)
def _library() -> tuple[Optional[ctypes.CDLL], str]:
    """(the library, "") or (None, why not)."""
    tried = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        if not hasattr(lib, "tj3SetCroppingRegion"):
            tried.append(f"{path}: no tj3SetCroppingRegion (libjpeg-turbo older than 3.0)")
            continue
        _declare(lib)
        return lib, ""
    return None, "; ".join(tried) or "no libturbojpeg found"


def _declare(lib: ctypes.CDLL) -> None:
    handle, buf = ctypes.c_void_p, ctypes.c_char_p
    lib.tj3Init.restype, lib.tj3Init.argtypes = handle, [ctypes.c_int]
    lib.tj3Destroy.restype, lib.tj3Destroy.argtypes = None, [handle]
    lib.tj3Set.argtypes = [handle, ctypes.c_int, ctypes.c_int]
    lib.tj3Get.argtypes = [handle, ctypes.c_int]
    lib.tj3DecompressHeader.argtypes = [handle, buf, ctypes.c_size_t]
    lib.tj3SetScalingFactor.argtypes = [handle, _Scale]
    lib.tj3SetCroppingRegion.argtypes = [handle, _Region]
    lib.tj3Decompress8.argtypes = [handle, buf, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tj3GetErrorStr.restype, lib.tj3GetErrorStr.argtypes = ctypes.c_char_p, [handle]


def available() -> bool:
    """Whether a libturbojpeg >= 3.0 was found and loaded."""
    return _library()[0] is not None


def require() -> ctypes.CDLL:
    """The library, or ImportError saying what was tried and what to install."""
    lib, why = _library()
    if lib is None:
        raise ImportError(f"data.cpu_decoder=turbojpeg needs libjpeg-turbo >= 3.0 ({why}): {INSTALL_HINT}")
    return lib


class _Handle:
    """One decompressor per thread (TurboJPEG handles are not thread-safe); destroyed with the thread."""

    _local = threading.local()

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.ptr = lib, lib.tj3Init(_INIT_DECOMPRESS)
        if not self.ptr:
            raise MemoryError("tj3Init failed")
        lib.tj3Set(self.ptr, _STOPONWARNING, 1)
        weakref.finalize(self, lib.tj3Destroy, self.ptr)

    @classmethod
    def get(cls) -> "_Handle":
        own = getattr(cls._local, "handle", None)
        if own is None:
            own = cls._local.handle = cls(require())
        return own

    def fail(self) -> ValueError:
        return ValueError(self.lib.tj3GetErrorStr(self.ptr).decode(errors="replace"))


def header(data: bytes) -> tuple[int, int, int]:
    """(width, height, subsampling) of a JPEG; ValueError for a CMYK/YCCK one or one the header fails."""
    h = _Handle.get()
    if h.lib.tj3DecompressHeader(h.ptr, data, len(data)) != 0:
        raise h.fail()
    if h.lib.tj3Get(h.ptr, _COLORSPACE) in (_CS_CMYK, _CS_YCCK):
        raise ValueError("CMYK JPEG")
    return h.lib.tj3Get(h.ptr, _WIDTH), h.lib.tj3Get(h.ptr, _HEIGHT), h.lib.tj3Get(h.ptr, _SUBSAMP)


def decode_region(data: bytes, box: tuple[int, int, int, int], divisor: int = 1) -> np.ndarray:
    """RGB uint8 (h, w, 3): the ``box`` (x, y, w, h) of the JPEG decoded at 1/``divisor`` scale, ``box`` given
    in that scaled image's pixels. Only the box's rows and columns are reconstructed (see the module).

    The region's left edge moves down to the scaled iMCU boundary and it takes up to two more columns each
    side where the image has them (the horizontal upsampler then sees the same neighbours as in a full
    decode: the pixels equal a full decode's); the array returned is exactly ``box``. ValueError for
    anything TurboJPEG reports, warnings included.
    """
    h = _Handle.get()
    lib = h.lib
    if lib.tj3DecompressHeader(h.ptr, data, len(data)) != 0:
        raise h.fail()
    if lib.tj3Get(h.ptr, _COLORSPACE) in (_CS_CMYK, _CS_YCCK):
        raise ValueError("CMYK JPEG")
    width, height = lib.tj3Get(h.ptr, _WIDTH), lib.tj3Get(h.ptr, _HEIGHT)
    mcu = _MCU_WIDTH.get(lib.tj3Get(h.ptr, _SUBSAMP))
    if mcu is None:
        raise ValueError("unusual chroma subsampling")
    if lib.tj3SetScalingFactor(h.ptr, _Scale(1, divisor)) != 0:
        raise h.fail()
    scaled_w, scaled_h = -(-width // divisor), -(-height // divisor)
    step = max(1, mcu // divisor)
    x, y, w, hh = box
    left = ((x - 2) // step) * step if x >= 2 else 0
    right = min(scaled_w, x + w + 2)
    rows = min(hh, scaled_h - y)
    if lib.tj3SetCroppingRegion(h.ptr, _Region(left, y, right - left, rows)) != 0:
        raise h.fail()
    out = np.empty((rows, right - left, 3), np.uint8)
    if lib.tj3Decompress8(h.ptr, data, len(data), out.ctypes.data, (right - left) * 3, _PF_RGB) != 0:
        raise h.fail()
    return out[:, x - left:x - left + w]
