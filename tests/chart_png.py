"""Reading the charts back out of metadata in tests: the PNG of a Markdown image, decoded with Pillow."""

import base64
import io
import re

import numpy as np
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_CHART_BYTES = 64 * 1024


def decode_chart(markdown: str) -> tuple[bytes, Image.Image, str]:
    """The PNG bytes, the decoded image and the caption of a chart's Markdown."""
    match = re.fullmatch(r"!\[[^\]]+\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)(?:\n\n(.*))?", markdown, re.S)
    assert match, markdown[:200]
    png = base64.b64decode(match.group(1), validate=True)
    image = Image.open(io.BytesIO(png))
    image.load()
    return png, image, match.group(2) or ""


def has_color(image: Image.Image, hex_color: str, tolerance: int = 8) -> bool:
    rgb = np.asarray(image.convert("RGB"), dtype=np.int16)
    want = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return bool((np.abs(rgb - want).max(axis=-1) <= tolerance).any())
