"""`python -m diffkv bench`: the sweep runs, writes its JSON record and a valid, non-blank PNG,
and prints the table; options are checked; the built-in PNG writer round-trips."""

import io
import json
import os
import struct
import subprocess
import sys
import zlib

import pytest
import torch

import diffkv.__main__ as cli
from diffkv import _bench, _png

ENV_KEYS = {"time_utc", "device", "python", "torch", "torch_cuda", "diffkv", "diffkv_build", "diffkv_commit"}


def _decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB, non-interlaced PNG; every chunk's
    CRC verified; every filter type undone (0-4) so that any writer's output decodes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert depth == 8 and interlace == 0 and color in (2, 6)
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * bpp
    assert len(raw) == height * (stride + 1)
    rows, prev = [], bytearray(stride)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
            else:
                assert ftype == 0
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return width, height, rows


def _colors(rows: list[bytes]) -> set[tuple[int, int, int]]:
    return {tuple(row[i : i + 3]) for row in rows for i in range(0, len(row), 3)}


def _check_record(record, *, quick=True):
    assert {"benchmark", "schema", "config", "env", "points", "notes", "files"} <= set(record)
    assert ENV_KEYS <= set(record["env"])
    assert record["env"]["diffkv_build"]["limited_api"]
    assert record["env"]["diffkv_build"]["attention_kernel"] in ("sm90", "sm80", "none")
    cfg = record["config"]
    assert {"seq_lens", "rows", "block_sizes", "heads", "kv_heads", "head_size", "dtype", "mask"} <= set(cfg)
    expected = {(s, r, b) for s in cfg["seq_lens"] for r in cfg["rows"] for b in cfg["block_sizes"]}
    assert {(p["seq_len"], p["rows"], p["block_size"]) for p in record["points"]} == expected
    for p in record["points"]:
        assert p["diffkv"]["tflops"] > 0 and p["diffkv"]["us"] > 0
        assert len(p["diffkv"]["samples_us"]) == cfg["reps"]
        assert p["check_ok"], p["checks"]
        assert p["checks"], "every quick point is checked against a reference"
        assert set(p["baselines"]) == {"flash", "cudnn", "flex"}
        for entry in p["baselines"].values():
            if quick:
                assert entry["status"] == "skipped" and entry["reason"]


def test_bench_quick_command(tmp_path):
    """The exact command the brief names: JSON, PNG, table, exit 0."""
    out = tmp_path / "bench"
    env = dict(os.environ)
    env["MPLBACKEND"] = "Agg"
    result = subprocess.run(
        [sys.executable, "-m", "diffkv", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "bench.json").read_text())
    _check_record(record)
    width, height, rows = _decode_png((out / "bench.png").read_bytes())
    assert width > 400 and height > 300
    assert len(_colors(rows)) > 4
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("seq_len"))
    assert "diffkv TFLOP/s" in lines[header] and set(lines[header + 1].replace(" ", "")) == {"-"}
    table = lines[header + 2 : header + 2 + len(record["points"])]
    assert [int(line.split()[0]) for line in table] == [p["seq_len"] for p in record["points"]]
    assert "100%" in result.stderr  # the progress bar ran to the end


def test_bench_builtin_png_not_blank(tmp_path, capsys):
    """The self-written chart: valid PNG, filter 0 rows, axes/grid/text and each series'
    colour present (diffkv block 16 red, block 128 orange)."""
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--plotter", "builtin"]
    assert cli.main(argv + ["--seq-lens", "48,96", "--reps", "1"]) == 0
    data = (tmp_path / "bench.png").read_bytes()
    (ihdr_len,) = struct.unpack(">I", data[8:12])
    assert ihdr_len == 13 and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    w2, h2, rows = _decode_png(data)
    assert (w2, h2) == (width, height)
    colors = _colors(rows)
    assert (255, 255, 255) in colors and (20, 20, 20) in colors  # background, text
    assert (214, 39, 40) in colors and (255, 127, 14) in colors  # the two diffkv lines
    assert (222, 222, 222) in colors  # gridlines
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["plotter"] == "builtin"
    assert record["config"]["seq_lens"] == [48, 96]
    out = capsys.readouterr().out
    assert "wrote" in out and "bench.png (builtin)" in out


def test_bench_causal_odd_lengths_no_plot(tmp_path, capsys):
    """Causal mask, lengths that are not block multiples, one row, no PNG."""
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]
    argv += ["--mask", "causal", "--seq-lens", "33,70", "--rows", "1", "--block-sizes", "16,32"]
    argv += ["--heads", "6", "--kv-heads", "3", "--dtype", "float32"]
    assert cli.main(argv) == 0
    assert not (tmp_path / "bench.png").exists()
    record = json.loads((tmp_path / "bench.json").read_text())
    _check_record(record)
    assert record["files"]["png"] is None
    p = record["points"][0]
    assert p["pairs"] == 33 * 34 // 2 and p["flops"] == 4 * 6 * 64 * p["pairs"]
    assert p["check_tol"] == 5e-3
    assert "baselines run on CUDA only" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--heads", "6", "--kv-heads", "4"], "--heads must be a multiple of --kv-heads, got 6 and 4"),
        (["--seq-lens", "1k,x"], "must be positive integers (1k = 1024), got 'x'"),
        (["--rows", "0"], "must be positive integers, got 0"),
        (
            ["--baselines", "flash,fa3"],
            "--baselines: unknown ['fa3']; choose from ['flash', 'cudnn', 'flex']",
        ),
        (["--device", "mps"], "--device must be cpu or cuda[:i], got 'mps'"),
    ],
)
def test_bench_bad_options(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_bench_full_needs_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "no GPU to benchmark" in err and "--quick runs a tiny sweep on the CPU" in err


def test_seq_len_parsing():
    assert _bench._int_list("1k, 2K,4096,") == [1024, 2048, 4096]


def test_progress_lines_off_terminal():
    stream = io.StringIO()
    bar = _bench.Progress(total_steps=2, total_work=4.0, stream=stream, width=10)
    bar.show("step a")
    bar.advance(1.0)
    bar.show("step b")
    bar.advance(3.0)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[..........] 0/2   0%") and lines[0].endswith("step a")
    assert lines[1].startswith("[##........] 1/2  25%") and "left" in lines[1]
    assert lines[2].startswith("[##########] 2/2 100%") and lines[2].endswith("done")


def test_encode_png_roundtrip():
    pixels = bytes(range(2 * 3 * 3))
    width, height, rows = _decode_png(_png.encode_png(3, 2, pixels))
    assert (width, height) == (3, 2) and b"".join(rows) == pixels
    with pytest.raises(ValueError, match=r"encode_png\(\): rgb must hold 18 bytes, got 17"):
        _png.encode_png(3, 2, pixels[:-1])
    with pytest.raises(ValueError, match=r"encode_png\(\): width and height must be >= 1, got 0x2"):
        _png.encode_png(0, 2, b"")


def test_line_chart_gaps_and_errors():
    series = {"a": [(1, 1.0), (2, None), (4, 3.0)], "b": [(1, 2.0), (4, 2.5)]}
    data = _png.line_chart(
        [("one", series)], title="t", x_label="x", y_label="y", x_ticks=[(1, "1"), (2, "2"), (4, "4")]
    )
    _, _, rows = _decode_png(data)
    colors = _colors(rows)
    assert _png.PALETTE[0] in colors and _png.PALETTE[1] in colors
    with pytest.raises(ValueError, match=r"line_chart\(\): x values must be > 0 \(log2 axis\)"):
        _png.line_chart([("p", {"a": [(0, 1.0)]})], title="", x_label="", y_label="", x_ticks=[])
    with pytest.raises(ValueError, match=r"line_chart\(\): panels must not be empty"):
        _png.line_chart([], title="", x_label="", y_label="", x_ticks=[])


def test_nice_ticks():
    assert _png.nice_ticks(9.3) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert _png.nice_ticks(0.0093)[-1] >= 0.0093
    assert _png.nice_ticks(0.0) == [0.0, 1.0]


@pytest.mark.gpu
def test_bench_gpu_with_baselines(tmp_path, capsys):
    """A small real sweep on the GPU: every baseline ran or says why not; diffkv matches them."""
    argv = ["bench", "--out", str(tmp_path), "--seq-lens", "512,1k", "--rows", "1,2", "--block-sizes", "16"]
    argv += ["--heads", "8", "--kv-heads", "2", "--warmup", "1", "--reps", "3", "--plotter", "builtin"]
    assert cli.main(argv) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["env"]["gpu"] and "driver" in record["env"]
    for p in record["points"]:
        assert p["diffkv"]["tflops"] > 0 and p["check_ok"]
        for entry in p["baselines"].values():
            assert entry["status"] == "ok" or entry["reason"]
            if entry["status"] == "ok":
                assert entry["tflops"] > 0 and entry["ratio"] > 0
    assert any(e["status"] == "ok" for p in record["points"] for e in p["baselines"].values())
    _decode_png((tmp_path / "bench.png").read_bytes())
    assert "vs flash" in capsys.readouterr().out
