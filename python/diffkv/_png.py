"""A small PNG writer and line-chart renderer with no dependencies beyond zlib and struct.

``python -m diffkv bench`` draws its plot with matplotlib when it is importable and with this
module otherwise (the GPU machine may not have matplotlib).  Text uses a built-in 5x7 bitmap
font of upper-case letters, digits and a little punctuation; lower-case text is drawn in upper
case and characters outside the font as '?'.

Entry points: encode_png (RGB bytes -> PNG bytes), Canvas (an RGB surface: rectangles, thick
lines, text), line_chart (panels of series -> PNG bytes), PALETTE.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence

Color = tuple[int, int, int]

# Distinct line colours (the "tab10" hues), assigned in order of first appearance.
PALETTE: tuple[Color, ...] = (
    (214, 39, 40),
    (255, 127, 14),
    (31, 119, 180),
    (44, 160, 44),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)

# 5x7 glyphs: seven rows, each a 5-bit mask (bit 4 = leftmost pixel), as hex.
_GLYPH_HEX = {
    " ": "00 00 00 00 00 00 00",
    "0": "0E 11 13 15 19 11 0E",
    "1": "04 0C 04 04 04 04 0E",
    "2": "0E 11 01 02 04 08 1F",
    "3": "1F 02 04 02 01 11 0E",
    "4": "02 06 0A 12 1F 02 02",
    "5": "1F 10 1E 01 01 11 0E",
    "6": "06 08 10 1E 11 11 0E",
    "7": "1F 01 02 04 08 08 08",
    "8": "0E 11 11 0E 11 11 0E",
    "9": "0E 11 11 0F 01 02 0C",
    "A": "0E 11 11 11 1F 11 11",
    "B": "1E 11 11 1E 11 11 1E",
    "C": "0E 11 10 10 10 11 0E",
    "D": "1C 12 11 11 11 12 1C",
    "E": "1F 10 10 1E 10 10 1F",
    "F": "1F 10 10 1E 10 10 10",
    "G": "0E 11 10 17 11 11 0F",
    "H": "11 11 11 1F 11 11 11",
    "I": "0E 04 04 04 04 04 0E",
    "J": "07 02 02 02 02 12 0C",
    "K": "11 12 14 18 14 12 11",
    "L": "10 10 10 10 10 10 1F",
    "M": "11 1B 15 15 11 11 11",
    "N": "11 11 19 15 13 11 11",
    "O": "0E 11 11 11 11 11 0E",
    "P": "1E 11 11 1E 10 10 10",
    "Q": "0E 11 11 11 15 12 0D",
    "R": "1E 11 11 1E 14 12 11",
    "S": "0F 10 10 0E 01 01 1E",
    "T": "1F 04 04 04 04 04 04",
    "U": "11 11 11 11 11 11 0E",
    "V": "11 11 11 11 11 0A 04",
    "W": "11 11 11 15 15 15 0A",
    "X": "11 11 0A 04 0A 11 11",
    "Y": "11 11 11 0A 04 04 04",
    "Z": "1F 01 02 04 08 10 1F",
    ".": "00 00 00 00 00 0C 0C",
    ",": "00 00 00 00 0C 04 08",
    ":": "00 0C 0C 00 0C 0C 00",
    "/": "00 01 02 04 08 10 00",
    "-": "00 00 00 1F 00 00 00",
    "+": "00 04 04 1F 04 04 00",
    "=": "00 00 1F 00 1F 00 00",
    "*": "00 04 15 0E 15 04 00",
    "_": "00 00 00 00 00 00 1F",
    "(": "02 04 08 08 08 04 02",
    ")": "08 04 02 02 02 04 08",
    "%": "18 19 02 04 08 13 03",
    "?": "0E 11 01 02 04 00 04",
}
_FONT = {ch: tuple(int(v, 16) for v in rows.split()) for ch, rows in _GLYPH_HEX.items()}
GLYPH_W, GLYPH_H = 5, 7


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """PNG file bytes of an 8-bit RGB image.  rgb: width * height * 3 bytes, rows top to
    bottom.  Every scanline uses filter type 0 (none).  ValueError on a size mismatch."""
    if width < 1 or height < 1:
        raise ValueError(f"encode_png(): width and height must be >= 1, got {width}x{height}")
    stride = width * 3
    if len(rgb) != stride * height:
        raise ValueError(f"encode_png(): rgb must hold {stride * height} bytes, got {len(rgb)}")
    raw = bytearray()
    for y in range(height):
        raw.append(0)
        raw += rgb[y * stride : (y + 1) * stride]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(bytes(raw), 9))
        + _chunk(b"IEND", b"")
    )


class Canvas:
    """An RGB drawing surface of width x height pixels, (0, 0) top left.  Drawing outside the
    surface is clipped."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fills the pixels x0 <= x < x1, y0 <= y < y1."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1 or y0 >= y1:
            return
        run = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start : start + len(run)] = run

    def rect_outline(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """A one-pixel frame on the border of the rectangle x0 <= x < x1, y0 <= y < y1."""
        self.fill_rect(x0, y0, x1, y0 + 1, color)
        self.fill_rect(x0, y1 - 1, x1, y1, color)
        self.fill_rect(x0, y0, x0 + 1, y1, color)
        self.fill_rect(x1 - 1, y0, x1, y1, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """A straight line (Bresenham), each point stamped as a width x width square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = width // 2
        while True:
            self.fill_rect(x0 - half, y0 - half, x0 - half + width, y0 - half + width, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    @staticmethod
    def text_width(text: str, scale: int = 1) -> int:
        """Width in pixels of text drawn at scale (one pixel column between glyphs)."""
        return max(0, len(text) * (GLYPH_W + 1) * scale - scale)

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 1) -> None:
        """Draws text with its top-left corner at (x, y), each font pixel a scale x scale square."""
        for ch in text.upper():
            glyph = _FONT.get(ch, _FONT["?"])
            for row, bits in enumerate(glyph):
                for col in range(GLYPH_W):
                    if bits & (1 << (GLYPH_W - 1 - col)):
                        px, py = x + col * scale, y + row * scale
                        self.fill_rect(px, py, px + scale, py + scale, color)
            x += (GLYPH_W + 1) * scale

    def to_png(self) -> bytes:
        """The surface as PNG file bytes."""
        return encode_png(self.width, self.height, self.pixels)


def nice_ticks(vmax: float, target: int = 5) -> list[float]:
    """Tick values 0, step, 2*step, ... covering [0, vmax], step from {1, 2, 2.5, 5} x 10^k."""
    if not vmax > 0:
        return [0.0, 1.0]
    raw = vmax / target
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw)
    count = math.ceil(vmax / step - 1e-9)
    return [i * step for i in range(count + 1)]


def _tick_label(value: float, step: float) -> str:
    """value with as many decimals as step needs (2.5 -> one, 0.25 -> two)."""
    decimals = next((d for d in range(7) if abs(round(step, d) - step) <= 1e-9 * step), 6)
    return f"{value:.{decimals}f}"


Series = Sequence[tuple[float, float | None]]


def line_chart(
    panels: Sequence[tuple[str, Mapping[str, Series]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    x_ticks: Sequence[tuple[float, str]],
    colors: Mapping[str, Color] | None = None,
    panel_size: tuple[int, int] = (520, 360),
) -> bytes:
    """A PNG of line charts side by side, a log2 x axis and a linear y axis from 0.

    panels: (panel title, {series name: [(x, y), ...]}) each; a y of None is a gap in the
    line.  x values must be > 0.  x_ticks: (x, label) marks on every x axis.  colors: a colour
    per series name (others get PALETTE colours in order of first appearance).  The legend
    under the panels has one colour swatch per series.  Returns the PNG file bytes."""
    if not panels:
        raise ValueError("line_chart(): panels must not be empty")
    names: list[str] = []
    for _, series in panels:
        for name in series:
            if name not in names:
                names.append(name)
    palette = dict(colors or {})
    spare = [c for c in PALETTE if c not in palette.values()]
    for name in names:
        if name not in palette:
            palette[name] = spare.pop(0) if spare else PALETTE[len(palette) % len(PALETTE)]

    xs = [x for x, _ in x_ticks] + [x for _, s in panels for pts in s.values() for x, _ in pts]
    if any(x <= 0 for x in xs):
        raise ValueError("line_chart(): x values must be > 0 (log2 axis)")
    lx_min, lx_max = math.log2(min(xs)), math.log2(max(xs))
    if lx_max - lx_min < 1e-9:
        lx_min, lx_max = lx_min - 1, lx_max + 1
    ys = [y for _, s in panels for pts in s.values() for _, y in pts if y is not None]
    yticks = nice_ticks(max(ys) if ys else 1.0)
    y_top = yticks[-1]
    ystep = yticks[1] - yticks[0]

    scale = 2
    char_h = 7 * scale
    pw, ph = panel_size
    left, right, top, gap = 90, 30, 70, 80
    legend_cols = max(1, (len(panels) * pw + (len(panels) - 1) * gap) // 300)
    legend_lines = -(-len(names) // legend_cols)
    bottom = 80 + legend_lines * (char_h + 14) + 20
    width = left + len(panels) * pw + (len(panels) - 1) * gap + right
    height = top + ph + bottom
    cv = Canvas(width, height)
    ink, grid, frame = (20, 20, 20), (222, 222, 222), (90, 90, 90)

    cv.text((width - cv.text_width(title, scale)) // 2, 18, title, ink, scale)
    for p, (panel_title, series) in enumerate(panels):
        x0 = left + p * (pw + gap)
        y0, x1, y1 = top, x0 + pw, top + ph

        def px(x: float, x0=x0) -> int:
            frac = (math.log2(x) - lx_min) / (lx_max - lx_min)
            return round(x0 + pw * (0.05 + 0.9 * frac))

        def py(y: float, y1=y1) -> int:
            return round(y1 - ph * (y / y_top))

        for t in yticks:
            yy = py(t)
            cv.fill_rect(x0, yy, x1, yy + 1, grid)
            label = _tick_label(t, ystep)
            cv.text(x0 - 8 - cv.text_width(label, scale), yy - char_h // 2, label, ink, scale)
        for x, label in x_ticks:
            xx = px(x)
            cv.fill_rect(xx, y0, xx + 1, y1, grid)
            cv.fill_rect(xx, y1, xx + 1, y1 + 6, frame)
            cv.text(xx - cv.text_width(label, scale) // 2, y1 + 10, label, ink, scale)
        cv.rect_outline(x0, y0, x1 + 1, y1 + 1, frame)
        cv.text(x0, y0 - char_h - 10, y_label, ink, scale)
        cv.text(x1 - cv.text_width(panel_title, scale), y0 - char_h - 10, panel_title, ink, scale)
        xl = x_label
        cv.text(x0 + (pw - cv.text_width(xl, scale)) // 2, y1 + 10 + char_h + 12, xl, ink, scale)
        for name, pts in reversed(list(series.items())):  # the first series drawn on top
            color = palette[name]
            prev = None
            for x, y in sorted(pts, key=lambda pt: pt[0]):
                if y is None:
                    prev = None
                    continue
                cur = (px(x), py(y))
                if prev is not None:
                    cv.line(prev[0], prev[1], cur[0], cur[1], color, width=3)
                cv.fill_rect(cur[0] - 4, cur[1] - 4, cur[0] + 5, cur[1] + 5, color)
                prev = cur

    # Legend: a framed box of colour swatches and names under the panels.
    ly = top + ph + 10 + char_h + 12 + char_h + 22
    col_w = max(cv.text_width(n, scale) for n in names) + 60
    box_w = min(legend_cols, len(names)) * col_w + 10
    bx = left
    cv.rect_outline(bx, ly, bx + box_w, ly + legend_lines * (char_h + 14) + 12, frame)
    for i, name in enumerate(names):
        cx = bx + 12 + (i % legend_cols) * col_w
        cy = ly + 10 + (i // legend_cols) * (char_h + 14)
        cv.fill_rect(cx, cy, cx + 30, cy + char_h, palette[name])
        cv.text(cx + 40, cy, name, ink, scale)
    return cv.to_png()
