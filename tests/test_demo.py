"""The main job: `python -m diffkv demo` runs, checks itself and prints its table."""

import subprocess
import sys

import diffkv.__main__ as cli


def test_demo_small_cpu(capsys):
    assert cli.main(["demo", "--device", "cpu", "--layers", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "step" in lines[1] and "max err" in lines[1] and "KV blocks" in lines[1]
    phases = [line.split()[1] for line in lines[2:5]]
    assert phases == ["prefill", "denoise", "denoise"]
    assert "(ok:" in lines[-1]


def test_info_runs():
    result = subprocess.run(
        [sys.executable, "-m", "diffkv", "info"], capture_output=True, text=True, check=True
    )
    assert "diffkv" in result.stdout and "tensor bridge" in result.stdout
