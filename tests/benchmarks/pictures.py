"""What a drawn figure must be: a PNG file of a plausible size (matplotlib's smallest plot of ours is ~30 KB)."""

import struct
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, min_width: int = 400) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert width >= min_width and height >= 200, (width, height)
    assert len(data) > 10_000, f"{path}: {len(data)} bytes, too small to hold a drawn figure"
