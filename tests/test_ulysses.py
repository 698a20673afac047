"""diffkv.ulysses: strict Ulysses all-to-alls on torch.distributed, 2 gloo processes (CPU).

One spawn of 2 ranks runs ``examples/ulysses_gloo.py``'s comparison (shard Q/K/V of two CFG rows
with different prefixes, scatter heads, diffkv over rank-local caches with rank-local heads,
piecewise spans, prefill then denoise steps, gather back) in float32 and bfloat16 against the
single-process result, checks the exact element mapping of both all-to-alls on labelled
tensors, and collects the error messages that need a 2-rank group.  Errors caught before any
collective are tested in-process.  The same run with NCCL on 2 GPUs is the ``gpu`` test.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _helpers import free_port
from diffkv import ulysses

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ulysses_gloo.py"
WORLD = 2


def _load_example():
    spec = importlib.util.spec_from_file_location("ulysses_gloo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _labelled(batch: int, seq: int, heads: int, head_size: int) -> torch.Tensor:
    """x[b, s, h, d] = 1000 b + 100 s + 10 h + d (exact in float32)."""
    b, s, h, d = torch.meshgrid(
        torch.arange(batch), torch.arange(seq), torch.arange(heads), torch.arange(head_size), indexing="ij"
    )
    return (1000 * b + 100 * s + 10 * h + d).float()


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _worker(rank: int, port: int, backend: str, out_dir: str, dtypes: tuple[str, ...]) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        example = _load_example()
        report: dict = {"runs": {}}
        for name in dtypes:
            report["runs"][name] = example.run_rank(rank, WORLD, device, example.DTYPES[name], steps=2)

        # Element mapping on labelled tensors: full [B, S=7, H=4, D=3], padded to 8 (1 pad token).
        full = _labelled(2, 7, 4, 3).to(device)
        shard = ulysses.shard_sequence(full, rank=rank, degree=WORLD)
        gathered = ulysses.scatter_heads(shard, padding=1)
        back = ulysses.gather_heads(gathered, padding=1)
        report["scatter_ok"] = torch.equal(gathered, full[:, :, 2 * rank : 2 * rank + 2])
        report["gather_ok"] = torch.equal(back, shard)
        report["shapes"] = [list(shard.shape), list(gathered.shape), list(back.shape)]

        x = torch.zeros(1, 4, 3, 2, device=device)
        report["errors"] = {
            "heads": _error(lambda: ulysses.scatter_heads(x)),
            "padding_exceeds": _error(lambda: ulysses.scatter_heads(torch.zeros(1, 2, 2, 2), padding=5)),
            "sequence": _error(
                lambda: ulysses.gather_heads(torch.zeros(1, 5, 1, 2, device=device), padding=2)
            ),
        }
        (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _spawn(backend: str, tmp_path: pathlib.Path, dtypes: tuple[str, ...]) -> list[dict]:
    mp.spawn(_worker, args=(free_port(), backend, str(tmp_path), dtypes), nprocs=WORLD)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _check_reports(reports: list[dict], dtypes: tuple[str, ...]) -> None:
    for report in reports:
        for name in dtypes:
            run = report["runs"][name]
            # 2 layers x (1 prefill + 2 denoise steps), every one bit-exact.
            assert run == {"max_abs_diff": 0.0, "bit_exact": True, "checked": 6}, name
        assert report["scatter_ok"] and report["gather_ok"]
        assert report["shapes"] == [[2, 4, 4, 3], [2, 7, 2, 3], [2, 4, 4, 3]]
        assert report["errors"] == {
            "heads": "ValueError: scatter_heads(): x.shape[2] (heads) must be divisible by the group size 2, "
            "got 3",
            "padding_exceeds": "ValueError: Paged Ulysses padding exceeds the post-all-to-all sequence: "
            "padding=5, sequence=4",
            "sequence": "ValueError: gather_heads(): x.shape[1] + padding (sequence) must be divisible "
            "by the group size 2, got 5 + 2 = 7",
        }


def test_two_ranks_gloo_match_single_process(tmp_path):
    dtypes = ("float32", "bfloat16")
    _check_reports(_spawn("gloo", tmp_path, dtypes), dtypes)


@pytest.mark.gpu
def test_two_ranks_nccl_match_single_process(tmp_path):
    if torch.cuda.device_count() < WORLD or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and NCCL")
    dtypes = ("float32", "bfloat16", "float16")
    _check_reports(_spawn("nccl", tmp_path, dtypes), dtypes)


def test_sp_padding_size():
    assert [ulysses.sp_padding_size(n, 4) for n in (0, 1, 4, 5, 7, 8)] == [0, 3, 0, 3, 1, 0]
    assert ulysses.sp_padding_size(7, 1) == 0


def test_shard_sequence_pads_the_end_with_zeros():
    x = _labelled(2, 5, 2, 2)
    shards = [ulysses.shard_sequence(x, rank=r, degree=2) for r in range(2)]
    assert [tuple(s.shape) for s in shards] == [(2, 3, 2, 2), (2, 3, 2, 2)]
    assert torch.equal(torch.cat(shards, dim=1)[:, :5], x)
    assert torch.equal(shards[1][:, 2], torch.zeros(2, 2, 2))
    # A shard entirely in the padding (S=1 over 4 ranks) is all zeros.
    assert torch.equal(ulysses.shard_sequence(x[:, :1], rank=3, degree=4), torch.zeros(2, 1, 2, 2))


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (
            lambda: ulysses.sp_padding_size(-1, 2),
            ValueError,
            "sp_padding_size(): seq_len must be a non-negative int, got -1",
        ),
        (
            lambda: ulysses.sp_padding_size(4, 0),
            ValueError,
            "sp_padding_size(): degree must be a positive int, got 0",
        ),
        (
            lambda: ulysses.sp_padding_size(4, True),
            ValueError,
            "sp_padding_size(): degree must be a positive int, got True",
        ),
        (
            lambda: ulysses.shard_sequence([1, 2], rank=0, degree=2),
            TypeError,
            "shard_sequence(): x must be a torch.Tensor, got list",
        ),
        (
            lambda: ulysses.shard_sequence(torch.zeros(3), rank=0, degree=2),
            ValueError,
            "shard_sequence(): x must be at least 2-D [B, S, ...], got shape (3,)",
        ),
        (
            lambda: ulysses.shard_sequence(torch.zeros(1, 3), rank=0, degree=2.0),
            ValueError,
            "shard_sequence(): degree must be a positive int, got 2.0",
        ),
        (
            lambda: ulysses.shard_sequence(torch.zeros(1, 3), rank=2, degree=2),
            ValueError,
            "shard_sequence(): rank must be an int in [0, 2), got 2",
        ),
        (lambda: ulysses.scatter_heads("q"), TypeError, "scatter_heads(): x must be a torch.Tensor, got str"),
        (
            lambda: ulysses.scatter_heads(torch.zeros(2, 4, 8)),
            ValueError,
            "scatter_heads(): x must be 4-D [B, S/u, H, D], got shape (2, 4, 8)",
        ),
        (
            lambda: ulysses.scatter_heads(torch.zeros(1, 2, 2, 2), padding=-1),
            ValueError,
            "scatter_heads(): padding must be a non-negative int, got -1",
        ),
        (
            lambda: ulysses.gather_heads(None),
            TypeError,
            "gather_heads(): x must be a torch.Tensor, got NoneType",
        ),
        (
            lambda: ulysses.gather_heads(torch.zeros(1, 2, 2, 2, 1)),
            ValueError,
            "gather_heads(): x must be 4-D [B, S, H/u, D], got shape (1, 2, 2, 2, 1)",
        ),
        (
            lambda: ulysses.gather_heads(torch.zeros(1, 2, 2, 2), padding=False),
            ValueError,
            "gather_heads(): padding must be a non-negative int, got False",
        ),
    ],
)
def test_errors_before_any_collective(call, exc, message):
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        call()
