"""`python -m diffkv bench`: the sweep runs, writes its JSON record and prints the table; with
matplotlib it also draws bench.png, without it it says how to plot later; `--plot bench.json`
draws the plot of a record and runs nothing; options are checked."""

import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import diffkv.__main__ as cli
from diffkv import _C, _bench_cli

ENV_KEYS = {"time_utc", "device", "python", "torch", "torch_cuda", "diffkv", "diffkv_build", "diffkv_commit"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG file's header: the signature, then the IHDR chunk first."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    (length,) = struct.unpack(">I", data[8:12])
    assert length == 13 and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _expected_size(panels: int) -> tuple[int, int]:
    width, height = _bench_cli.PANEL_INCHES
    return round(width * panels * _bench_cli.PLOT_DPI), round(height * _bench_cli.PLOT_DPI)


def _check_plot(path, panels: int, block_sizes: int) -> None:
    """path is a real PNG of the expected size that matplotlib reads back, with white ground
    and the colour of each diffkv block size's line on it."""
    import matplotlib.colors
    import matplotlib.image

    assert _png_size(path) == _expected_size(panels)
    pixels = matplotlib.image.imread(str(path))
    width, height = _expected_size(panels)
    assert pixels.shape[:2] == (height, width)
    rgb = {tuple(int(round(c * 255)) for c in px[:3]) for px in pixels.reshape(-1, pixels.shape[2])}
    assert (255, 255, 255) in rgb
    for color in _bench_cli.DIFFKV_COLORS[:block_sizes]:
        assert tuple(int(round(c * 255)) for c in matplotlib.colors.to_rgb(color)) in rgb, color


def _hide_matplotlib(monkeypatch) -> None:
    """`import matplotlib` raises ImportError for the rest of the test, as on a machine
    without it (a None entry in sys.modules makes the import fail)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


needs_matplotlib = pytest.mark.skipif(
    not _has_matplotlib(), reason="matplotlib is not installed (pip install 'diffkv[bench]')"
)


def _check_record(record, *, quick=True):
    assert {"benchmark", "schema", "config", "env", "points", "notes", "files"} <= set(record)
    assert ENV_KEYS <= set(record["env"])
    assert record["env"]["diffkv_build"]["limited_api"]
    assert record["env"]["diffkv_build"]["attention_kernel"] in ("sm90-tma", "sm90", "sm80", "none")
    assert record["schema"] == _bench_cli.SCHEMA
    cfg = record["config"]
    assert {"seq_lens", "rows", "block_sizes", "heads", "kv_heads", "head_sizes", "dtype", "mask"} <= set(cfg)
    expected = {
        (s, r, d, b)
        for s in cfg["seq_lens"]
        for r in cfg["rows"]
        for d in cfg["head_sizes"]
        for b in cfg["block_sizes"]
    }
    assert {(p["seq_len"], p["rows"], p["head_size"], p["block_size"]) for p in record["points"]} == expected
    for p in record["points"]:
        assert p["diffkv"]["tflops"] > 0 and p["diffkv"]["us"] > 0
        assert len(p["diffkv"]["samples_us"]) == cfg["reps"]
        assert p["check_ok"], p["checks"]
        assert p["checks"], "every quick point is checked against a reference"
        assert set(p["baselines"]) == {"flash", "cudnn", "flex"}
        for entry in p["baselines"].values():
            if quick:
                assert entry["status"] == "skipped" and entry["reason"]


def test_bench_quick_command_without_matplotlib(tmp_path):
    """The exact command, on a Python where matplotlib cannot be imported: the JSON, the table,
    exit 0, no PNG, and how to draw the plot later."""
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    out = tmp_path / "bench"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hide), env.get("PYTHONPATH")) if p)
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
    assert record["files"]["png"] is None
    assert not (out / "bench.png").exists()
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("seq_len"))
    assert "diffkv TFLOP/s" in lines[header] and set(lines[header + 1].replace(" ", "")) == {"-"}
    table = lines[header + 2 : header + 2 + len(record["points"])]
    assert [int(line.split()[0]) for line in table] == [p["seq_len"] for p in record["points"]]
    json_path = out / "bench.json"
    assert f"wrote {json_path}" in lines
    assert (
        "no plot: matplotlib is not installed; to draw it: pip install 'diffkv[bench]' (matplotlib), "
        f"then: python -m diffkv bench --plot {json_path}"
    ) in lines
    assert "100%" in result.stderr  # the progress bar ran to the end


def test_bench_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    """--plot on a machine without matplotlib: exit 1 and how to install it; nothing written."""
    assert cli.main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]) == 0
    _hide_matplotlib(monkeypatch)
    capsys.readouterr()
    json_path = tmp_path / "bench.json"
    assert cli.main(["bench", "--plot", str(json_path)]) == 1
    assert capsys.readouterr().err == (
        "--plot needs matplotlib, which is not installed: pip install 'diffkv[bench]' (matplotlib), "
        f"then: python -m diffkv bench --plot {json_path}\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["bench.json"]


def test_bench_sweep_without_matplotlib_in_process(tmp_path, monkeypatch, capsys):
    """The JSON path of the sweep when the import of matplotlib fails in this process."""
    _hide_matplotlib(monkeypatch)
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--seq-lens", "48", "--reps", "1"]
    assert cli.main(argv) == 0
    assert sorted(os.listdir(tmp_path)) == ["bench.json"]
    _check_record(json.loads((tmp_path / "bench.json").read_text()))
    assert "python -m diffkv bench --plot" in capsys.readouterr().out


@needs_matplotlib
def test_bench_draws_the_plot_then_again_from_the_json(tmp_path, monkeypatch, capsys):
    """With matplotlib the sweep writes bench.png (TFLOP/s against sequence length, one panel
    per rows value, a line per block size); `--plot bench.json --out other.png` draws the same
    plot from the record without running anything, and leaves the record as it was."""
    out = tmp_path / "run"
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(out), "--seq-lens", "48,96", "--reps", "1"]
    assert cli.main(argv) == 0
    record = json.loads((out / "bench.json").read_text())
    assert record["files"]["png"] == str(out / "bench.png")
    _check_plot(out / "bench.png", panels=2, block_sizes=2)
    assert f"wrote {out / 'bench.json'} and {out / 'bench.png'}" in capsys.readouterr().out

    def no_sweep(*args, **kwargs):
        raise AssertionError("--plot ran the sweep")

    monkeypatch.setattr(_bench_cli, "_sweep", no_sweep)
    monkeypatch.setattr(_bench_cli, "_group", no_sweep)
    before = (out / "bench.json").read_bytes()
    again = tmp_path / "later" / "again.png"
    again.parent.mkdir()
    assert cli.main(["bench", "--plot", str(out / "bench.json"), "--out", str(again)]) == 0
    assert capsys.readouterr().out == f"wrote {again}\n"
    _check_plot(again, panels=2, block_sizes=2)
    assert (out / "bench.json").read_bytes() == before


@needs_matplotlib
def test_bench_plot_default_path_and_one_panel(tmp_path, capsys):
    """--plot without --out writes next to the record, the .json swapped for .png; one rows
    value gives one panel."""
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot", "--rows", "1"]
    assert cli.main(argv + ["--block-sizes", "16", "--seq-lens", "32,64", "--reps", "1"]) == 0
    assert not (tmp_path / "bench.png").exists()
    os.rename(tmp_path / "bench.json", tmp_path / "mine.json")
    assert cli.main(["bench", "--plot", str(tmp_path / "mine.json")]) == 0
    _check_plot(tmp_path / "mine.png", panels=1, block_sizes=1)


def test_bench_plot_refuses_sweep_options_and_other_files(tmp_path, capsys):
    json_path = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--plot", str(json_path), "--quick", "--rows", "1"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: --plot draws a record written earlier and runs nothing: it takes only --out, "
        "got --quick, --rows\n"
    )
    with pytest.raises(SystemExit):
        cli.main(["bench", "--plot", str(json_path)])
    assert f"error: --plot: cannot read {json_path}: [Errno 2]" in capsys.readouterr().err
    json_path.write_text(json.dumps({"benchmark": "host_overhead"}))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--plot", str(json_path)])
    assert capsys.readouterr().err.endswith(
        f"error: --plot: {json_path} is not the record of a `python -m diffkv bench` run\n"
    )
    json_path.write_text(json.dumps({"benchmark": "diffkv bench", "schema": 0}))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--plot", str(json_path)])
    assert capsys.readouterr().err.endswith(
        f"error: --plot: {json_path} has schema 0; this diffkv reads schemas 1 and {_bench_cli.SCHEMA}\n"
    )


def test_bench_head_size_sweep(tmp_path, capsys):
    """--head-sizes sweeps head sizes: every point has one, the table a head column, the plot a
    panel per (head size, rows); 'all' is every size the CUDA kernels take (the CPU reference
    takes them too); a size the device does not take is refused by name."""
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--rows", "1"]
    argv += ["--block-sizes", "16", "--seq-lens", "40", "--reps", "1", "--head-sizes", "72,96"]
    assert cli.main(argv + (["--no-plot"] if not _has_matplotlib() else [])) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    _check_record(record)
    assert record["config"]["head_sizes"] == [72, 96]
    assert [p["head_size"] for p in record["points"]] == [72, 96]
    assert [p["flops"] for p in record["points"]] == [4 * 4 * d * 40 * 40 for d in (72, 96)]
    out = capsys.readouterr().out
    assert "x 72,96 bfloat16" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("seq_len"))
    assert lines[header].split()[:4] == ["seq_len", "rows", "head", "block"]
    assert [line.split()[2] for line in lines[header + 2 : header + 4]] == ["72", "96"]
    if _has_matplotlib():
        _check_plot(tmp_path / "bench.png", panels=2, block_sizes=1)
    if _C.cuda_compiled():
        argv[-1] = "all"
        assert cli.main(argv + ["--no-plot", "--seq-lens", "16"]) == 0
        record = json.loads((tmp_path / "bench.json").read_text())
        assert record["config"]["head_sizes"] == list(_C.supported_head_sizes("cuda", "bfloat16", "auto"))
    with pytest.raises(SystemExit):
        cli.main(argv[:-1] + ["1100"])
    assert capsys.readouterr().err.endswith(
        "error: --head-sizes: [1100] not among the bfloat16 kernels' head sizes on cpu (1 to 1024)\n"
    )


def test_bench_plot_reads_a_schema_1_record(tmp_path, capsys):
    """A record of the one-head-size form (schema 1: config head_size, points without one)."""
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot", "--rows", "1"]
    assert cli.main(argv + ["--block-sizes", "16", "--seq-lens", "32", "--reps", "1"]) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    record["schema"] = 1
    record["config"]["head_size"] = record["config"].pop("head_sizes")[0]
    for p in record["points"]:
        del p["head_size"]
    (tmp_path / "old.json").write_text(json.dumps(record))
    upgraded = _bench_cli._read_record(str(tmp_path / "old.json"))
    assert upgraded["config"]["head_sizes"] == [64] and all(p["head_size"] == 64 for p in upgraded["points"])
    if _has_matplotlib():
        assert cli.main(["bench", "--plot", str(tmp_path / "old.json")]) == 0
        _check_plot(tmp_path / "old.png", panels=1, block_sizes=1)


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


def test_bench_denoise_span(tmp_path, capsys):
    """--mask span: image queries over a prompt + image row, the plan's mask (every key
    visible: run unmasked), checked against the float32 reference of that attention."""
    argv = ["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]
    argv += ["--mask", "span", "--prompt-len", "40", "--seq-lens", "33,70", "--rows", "1,2"]
    argv += ["--block-sizes", "16", "--heads", "6", "--kv-heads", "3", "--dtype", "float32"]
    assert cli.main(argv) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    _check_record(record)
    assert record["config"]["mask"] == "span" and record["config"]["prompt_len"] == 40
    p = record["points"][0]
    assert (p["seq_len"], p["rows"]) == (33, 1)
    assert p["pairs"] == 33 * (40 + 33) and p["flops"] == 4 * 6 * 64 * p["pairs"]
    assert all(q["diffkv"]["mask_run"] == "none" and q["check_ok"] for q in record["points"])
    assert all(q["checks"]["fp32_reference"] < q["check_tol"] for q in record["points"])
    assert "mask span" in capsys.readouterr().out
    assert "denoise span over a 40-token prompt" in _bench_cli._title(record)


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
        (["--prompt-len", "40"], "--prompt-len goes with --mask span"),
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
    assert _bench_cli._int_list("1k, 2K,4096,") == [1024, 2048, 4096]


def test_progress_lines_off_terminal():
    stream = io.StringIO()
    bar = _bench_cli.Progress(total_steps=2, total_work=4.0, stream=stream, width=10)
    bar.show("step a")
    bar.advance(1.0)
    bar.show("step b")
    bar.advance(3.0)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[..........] 0/2   0%") and lines[0].endswith("step a")
    assert lines[1].startswith("[##........] 1/2  25%") and "left" in lines[1]
    assert lines[2].startswith("[##########] 2/2 100%") and lines[2].endswith("done")


@pytest.mark.gpu
def test_bench_gpu_with_baselines(tmp_path, capsys):
    """A small real sweep on the GPU: every baseline ran or says why not; diffkv matches them."""
    argv = ["bench", "--out", str(tmp_path), "--seq-lens", "512,1k", "--rows", "1,2", "--block-sizes", "16"]
    argv += ["--heads", "8", "--kv-heads", "2", "--warmup", "1", "--reps", "3"]
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
    if _has_matplotlib():
        _check_plot(tmp_path / "bench.png", panels=2, block_sizes=1)
    assert "vs flash" in capsys.readouterr().out
