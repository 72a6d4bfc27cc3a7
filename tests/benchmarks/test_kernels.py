"""The benchmark's own arithmetic and data (the timing itself needs a GPU)."""

import pytest
import torch

from benchmarks.kernels import bench
from benchmarks.kernels.peers import decode_bytes, gather_contiguous, make_case, prefill_flops
from kernels.reference import gather_kv


def test_case_pages_are_permuted_and_gather_matches_the_reference() -> None:
    case = make_case(batch=3, length=37, page_size=8, device=torch.device("cpu"))
    lut = case.lookup_table.view(torch.int32).long()
    num_pages = case.blocks.shape[0] - 1
    assert lut.shape == (3, 8 + 16) and (lut[:, 5:] == num_pages).all()  # 5 pages each, then the sentinel
    assert not torch.equal(lut[:, :5].flatten(), torch.arange(15))  # not in order
    assert case.blocks[num_pages].count_nonzero() == 0
    k, v = gather_contiguous(case)  # [B, Hkv, 37, D]
    for b in range(3):
        want_k, want_v = gather_kv(case.blocks, 0, lut[b], 37)  # [37, Hkv, D]
        assert torch.equal(k[b], want_k.transpose(0, 1)) and torch.equal(v[b], want_v.transpose(0, 1))


def test_bytes_and_flops() -> None:
    # batch 64 x 4096 tokens x 8 KV heads x 128 x K and V x 2 bytes, plus Q and O (64 x 32 x 128 x 2 bytes each)
    assert decode_bytes(64, 4096) == 64 * 4096 * 8 * 128 * 2 * 2 + 2 * 64 * 32 * 128 * 2
    # causal: query j of n sees j + 1 keys; with a prefix c every query also sees the c cached ones
    assert prefill_flops(1, 0, 4) == 4 * 128 * 32 * (1 + 2 + 3 + 4)
    assert prefill_flops(2, 10, 3) == 2 * 4 * 128 * 32 * (11 + 12 + 13)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert bench.main(["--interpret-smoke"]) == 0
    assert "prefill max |err|" in capsys.readouterr().out


def test_the_cpu_bench_times_both_paths_on_the_same_case(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.kernels import bench_cpu
    from kernels.batched_reference import paged_decode_batched
    from kernels.cpu_decode import paged_decode_compiled

    q, blocks, lut, positions = bench_cpu.decode_case(3, 40, 4, 2, 16)  # 3 pages each, the last one partial
    num_pages = blocks.shape[0] - 1
    assert lut.shape == (3, 3 + 16) and (lut[:, 3:] == num_pages).all()
    assert sorted(lut[:, :3].flatten().tolist()) == list(range(9)) and positions.tolist() == [39] * 3
    torch.testing.assert_close(
        paged_decode_compiled(q, blocks, 0, lut, positions), paged_decode_batched(q, blocks, 0, lut, positions)
    )
    assert bench_cpu.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-5:] == ["compiled", "us", "torch", "us", "x"]
    assert len(lines) == 1 + len(bench_cpu.QUICK_SHAPES)
    assert all(float(line.split()[-1]) > 0 for line in lines[1:])
