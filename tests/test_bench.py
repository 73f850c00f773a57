"""The benchmark's same-bytes copy (benchmarks/copy.hip): bench.py times it as what moving
a case's bytes costs at that size, so it must move exactly them (its build, as a dependent
launch: tests/test_build.py; for AMD: tests/test_amd.py)."""
import pytest
import torch

from benchmarks.bench import copy_same_bytes


@pytest.mark.parametrize("src,dst", [
    (torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),            # sizes differ
    (torch.zeros(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)),            # 24 bytes
    (torch.zeros(9, dtype=torch.int32)[1:], torch.zeros(8, dtype=torch.int32)),        # 4-byte aligned
    (torch.zeros(8, 2, dtype=torch.int32).t(), torch.zeros(2, 8, dtype=torch.int32)),  # not contiguous
])
def test_it_refuses_what_it_cannot_copy_whole(src, dst):
    with pytest.raises(ValueError, match="contiguous, 16-byte aligned tensors of the same size"):
        copy_same_bytes(src, dst)


@pytest.mark.gpu
def test_it_moves_every_byte_and_nothing_more():
    """Over a grid whose last block is partial; a guard vector past the end stays."""
    n = 1000 * 4  # 1000 vectors of 16 bytes: 3 full blocks of 256 and a partial one
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (n + 4,), dtype=torch.int32, device="cuda")
    dst = torch.full((n + 4,), 7, dtype=torch.int32, device="cuda")
    copy_same_bytes(src[:n], dst[:n])
    torch.cuda.synchronize()
    assert torch.equal(dst[:n], src[:n])
    assert (dst[n:] == 7).all()
