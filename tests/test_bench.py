"""The benchmark's same-bytes copy (benchmarks/copy.hip): bench.py times it as what moving
a case's bytes costs at that size, so it must move exactly them, launched as the op is."""
import ctypes
import shutil
import subprocess

import pytest
import torch

from benchmarks.bench import COPY_SOURCE, copy_same_bytes
from codegen.paths import INCLUDE
from runtime import build, toolchain

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@needs_nvcc
def test_it_builds_as_a_variant_does_and_is_a_dependent_launch(tmp_path):
    tc = toolchain.detect(is_rocm=False, arch="sm_90")
    lib = ctypes.CDLL(str(build.build(build.Job("bench_copy16", COPY_SOURCE.read_text()), tc, root=tmp_path)))
    assert lib.kvf_bench_copy16
    # The op waits for the previous kernel and lets the next one start; a copy that did
    # neither would pay a launch the op does not (torch's add: 4-5% slower at 46-84 MB).
    ptx = tmp_path / "copy.ptx"
    subprocess.run([tc.compiler, "-x", "cu", "-std=c++17", "-ptx", "-arch=sm_90", f"-I{INCLUDE}",
                    str(COPY_SOURCE), "-o", str(ptx)], check=True, capture_output=True)
    text = ptx.read_text()
    assert "griddepcontrol.launch_dependents;" in text and "griddepcontrol.wait;" in text


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
