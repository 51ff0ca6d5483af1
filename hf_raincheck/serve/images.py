"""Loading the images of ``image_url`` content parts: ``data:`` URLs and local files; never a remote fetch.

A client sends a conversation's images again with every turn; the loader keeps the most recently decoded images
(keyed by a hash of their encoded bytes, within ``cache_mb`` of decoded pixels, LRU) so that a follow-up turn does
not decode and hash the same pixels again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import threading
from collections import OrderedDict
from urllib.parse import unquote, urlparse

from PIL import Image, ImageOps

from ..images import eight_bit
from .errors import RequestError

#: the largest encoded image accepted (bytes) and the most pixels a decoded image may have
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000
#: decoded images an `ImageLoader` keeps by default (MB of RGB pixels: ~20 images of 2048 x 2048)
DEFAULT_CACHE_MB = 256


class ImageLoader:
    """Turns an ``image_url`` URL into an RGB ``PIL.Image`` and a content hash (the image's identity).

    Args:
        image_dirs: folders a local path (``/abs/file.png``, ``rel/file.png`` or ``file://...``) may point into;
            a path outside them is refused (403). Empty: local paths are refused.
        cache_mb: decoded images kept for requests that send the same encoded bytes again (MB of RGB pixels; 0:
            none). The images handed out are shared: they must not be modified.
    """

    def __init__(self, image_dirs: list[str] | tuple[str, ...] = (), cache_mb: float = DEFAULT_CACHE_MB):
        if isinstance(cache_mb, bool) or not isinstance(cache_mb, (int, float)) or cache_mb < 0:
            raise ValueError(f"ImageLoader: cache_mb must be a number >= 0, got {cache_mb!r}")
        self.image_dirs = [os.path.realpath(d) for d in image_dirs]
        self.cache_bytes = int(cache_mb * 1024 * 1024)
        self._cache: OrderedDict[str, tuple[Image.Image, str, int]] = OrderedDict()  # sha256 of the bytes -> ...
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def load(self, url, where: str) -> tuple[Image.Image, str]:
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where}: image_url.url must be a non-empty string, got {type(url).__name__}")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url(url, where)
        elif scheme in ("http", "https", "ftp", "s3", "gs"):
            raise RequestError(
                f"{where}: remote image URLs ({scheme}://) are not fetched by this server; send the image as a "
                "data: URL (data:image/png;base64,...) or a local file path"
            )
        elif scheme == "file" or scheme == "" or (len(scheme) == 1 and os.name == "nt"):
            data = self._local_file(url, where)
        else:
            raise RequestError(f"{where}: unsupported image URL scheme {scheme!r}; use a data: URL or a local file path")
        if not self.cache_bytes:
            return self._decode(data, where)
        key = hashlib.sha256(data).hexdigest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached[0], cached[1]
        image, digest = self._decode(data, where)
        self._remember(key, image, digest)
        return image, digest

    def _remember(self, key: str, image: Image.Image, digest: str) -> None:
        size = image.width * image.height * 3
        if size > self.cache_bytes:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = (image, digest, size)
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, (_, _, freed) = self._cache.popitem(last=False)
                self._cached_bytes -= freed

    @property
    def cached_images(self) -> int:
        return len(self._cache)

    # ------------------------------------------------------------------ sources
    @staticmethod
    def _data_url(url: str, where: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise RequestError(f"{where}: malformed data: URL (no ',' between the header and the data)")
        params = header.split(";")
        media_type = params[0].strip().lower()
        if media_type and not media_type.startswith("image/"):
            raise RequestError(f"{where}: data: URL media type must be image/*, got {media_type!r}")
        if "base64" not in [p.strip().lower() for p in params[1:]]:
            raise RequestError(f"{where}: data: URL must be base64-encoded (data:image/png;base64,...)")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise RequestError(f"{where}: image larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB", status=413)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise RequestError(f"{where}: data: URL payload is not valid base64 ({error})") from None

    def _local_file(self, url: str, where: str) -> bytes:
        path = unquote(urlparse(url).path) if url.lower().startswith("file:") else url
        real = os.path.realpath(path)
        if not self.image_dirs:
            raise RequestError(f"{where}: local image paths are disabled on this server (start it with --image-dir)",
                               status=403)
        if not any(real == d or real.startswith(d + os.sep) for d in self.image_dirs):
            raise RequestError(f"{where}: local image path {path!r} is outside the allowed folders "
                               f"{self.image_dirs} (--image-dir)", status=403)
        if not os.path.isfile(real):
            raise RequestError(f"{where}: local image file not found: {path!r}", status=404)
        if os.path.getsize(real) > MAX_IMAGE_BYTES:
            raise RequestError(f"{where}: image larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB", status=413)
        with open(real, "rb") as f:
            return f.read()

    @staticmethod
    def _decode(data: bytes, where: str) -> tuple[Image.Image, str]:
        if not data:
            raise RequestError(f"{where}: the image is empty (0 bytes)")
        try:
            with Image.open(io.BytesIO(data)) as opened:
                if opened.width * opened.height > MAX_IMAGE_PIXELS:
                    raise RequestError(f"{where}: image of {opened.width}x{opened.height} pixels is larger than "
                                       f"{MAX_IMAGE_PIXELS} pixels", status=413)
                opened.load()
                # a 16-bit, int32 or float image is scaled to 8 bits (as RaincheckChat does), not clipped to white
                image = eight_bit(ImageOps.exif_transpose(opened), where).convert("RGB")
        except RequestError:
            raise
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise RequestError(f"{where}: the image cannot be decoded ({type(error).__name__}: {error})") from None
        digest = hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()
        return image, digest
