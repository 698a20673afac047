"""The main job: `python -m diffkv demo` runs, checks itself and prints its table."""

import subprocess
import sys

import pytest

import diffkv.__main__ as cli


def _table(out):
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "phase"])
    assert "max err" in lines[header] and "KV blocks" in lines[header]
    return lines, header


def test_demo_small_cpu(capsys):
    assert cli.main(["demo", "--device", "cpu", "--layers", "2", "--steps", "2"]) == 0
    lines, header = _table(capsys.readouterr().out)
    phases = [line.split()[1] for line in lines[header + 1 : header + 4]]
    assert phases == ["prefill", "denoise", "denoise"]
    assert "KV cache:" in lines[header - 1] and "bfloat16" in lines[header - 1]
    assert "(ok:" in lines[-1]


def test_demo_fp8_kv_cache_takes_half_the_bytes(capsys):
    argv = ["demo", "--device", "cpu", "--layers", "2", "--steps", "1", "--kv-cache-dtype", "fp8"]
    assert cli.main(argv) == 0
    lines, header = _table(capsys.readouterr().out)
    kv = lines[header - 1].split()  # KV cache: X MiB of float8_e4m3fn (bfloat16 would take Y MiB)
    assert kv[:2] == ["KV", "cache:"] and kv[5] == "float8_e4m3fn" and kv[6] == "(bfloat16"
    assert abs(float(kv[9]) - 2 * float(kv[2])) <= 0.1  # MiB printed to 0.1
    assert "(ok:" in lines[-1] and "on the unquantized K/V" in lines[-1]


@pytest.mark.gpu
def test_demo_fp8_on_cuda(capsys):
    """On the H200 the fp8 demo runs the e4m3 kernel within its tolerance and takes half the
    bytes; so does the mma.sync kernels' fp8 form (the kernel choice sm80, what an A100 runs)."""
    argv = ["demo", "--device", "cuda", "--layers", "2", "--steps", "1", "--kv-cache-dtype", "fp8"]
    for choice in ("auto", "sm80"):
        cli._C.set_attention_kernel(choice)
        try:
            assert cli.main(argv) == 0
        finally:
            cli._C.set_attention_kernel("auto")
        lines, header = _table(capsys.readouterr().out)
        kv = lines[header - 1].split()
        assert kv[5] == "float8_e4m3fn" and abs(float(kv[9]) - 2 * float(kv[2])) <= 0.1
        assert "(ok:" in lines[-1], choice


def test_info_runs():
    result = subprocess.run(
        [sys.executable, "-m", "diffkv", "info"], capture_output=True, text=True, check=True
    )
    assert "diffkv" in result.stdout and "tensor bridge" in result.stdout
    if cli._C.cuda_compiled():  # the build's CUDA and the driver's, side by side
        assert "built with CUDA 1" in result.stdout and "NVIDIA driver: " in result.stdout


@pytest.mark.parametrize(
    ("driver", "runtime", "message"),
    [
        (13000, 13000, None),
        (13020, 13000, None),  # a newer minor driver: CUDA's minor-version compatibility
        (12080, 12040, None),
        (13000, 12080, None),  # a newer major driver runs older builds
        (
            12080,
            13000,
            "diffkv was built with CUDA 13.0 and needs an NVIDIA driver for CUDA 13 (580.65.06 or newer), "
            "but this driver supports CUDA 12.8: install the diffkv wheel for CUDA 12 (the +cu12 variant: "
            "README, Install) or update the driver",
        ),
        (
            12000,
            13000,
            "diffkv was built with CUDA 13.0 and needs an NVIDIA driver for CUDA 13 (580.65.06 or newer), "
            "but this driver supports CUDA 12.0: install the diffkv wheel for CUDA 12 (the +cu12 variant: "
            "README, Install) or update the driver",
        ),
        (12000, 12040, None),  # the +cu12 wheel (CUDA 12.4) on the oldest CUDA 12 driver
        (
            11080,
            12040,
            "diffkv was built with CUDA 12.4 and needs an NVIDIA driver for CUDA 12 (525.60.13 or newer), "
            "but this driver supports CUDA 11.8: update the driver (diffkv's oldest wheel, +cu12, needs "
            "525.60.13 or newer)",
        ),
        (
            11080,
            13000,
            "diffkv was built with CUDA 13.0 and needs an NVIDIA driver for CUDA 13 (580.65.06 or newer), "
            "but this driver supports CUDA 11.8: update the driver (diffkv's oldest wheel, +cu12, needs "
            "525.60.13 or newer)",
        ),
        (
            0,
            12040,
            "diffkv was built with CUDA 12.4 and needs an NVIDIA driver for CUDA 12 (525.60.13 or newer), "
            "but no driver was found",
        ),
        (12080, 0, None),  # a CPU-only build needs no driver
    ],
)
def test_driver_check(driver, runtime, message):
    """The check every CUDA call makes once (dk_cuda_device_enter): a driver too old for the
    build's CUDA is refused with both versions and what to do: the wheel variant (+cu12, +cu13)
    that driver runs, or a driver update when no variant runs on it."""
    assert cli._C.driver_check(driver, runtime) == message
