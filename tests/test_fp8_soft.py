"""The kernels' software FP8 routine — the one every target without a native converter
for a flavour runs (e4m3fnuz on NVIDIA, e4m3fn on gfx942) — built for the host and
checked against the reference's conversion on every bf16 and fp16 value, every exact
rounding tie of both formats and random fp32 values."""
import ctypes
import shutil
import subprocess

import pytest
import torch

from codegen.model import Fp8
from codegen.paths import INCLUDE, ROOT
from runtime.reference import to_fp8

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def _inputs() -> torch.Tensor:
    every16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    parts = [every16.view(torch.bfloat16).float(), every16.view(torch.float16).float()]
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[grid.isfinite()].unique()
        mid = (grid[1:] + grid[:-1]) / 2  # exact ties: round to even
        parts += [grid, mid, mid.nextafter(torch.tensor(float("inf"))),
                  mid.nextafter(torch.tensor(float("-inf")))]
    gen = torch.Generator().manual_seed(0)
    parts.append(torch.randn(200_000, generator=gen) * torch.exp2(torch.randint(-14, 12, (200_000,),
                                                                                generator=gen).float()))
    parts.append(torch.tensor([0.0, -0.0, 448.0, 464.0, 465.0, 240.0, 247.9, 248.0, 1e30,
                               float("inf"), float("-inf")]))
    return torch.cat(parts).contiguous()


def test_software_fp8_matches_the_reference(tmp_path):
    exe = tmp_path / "fp8_soft"
    subprocess.run(["nvcc", "-x", "cu", "-std=c++17", "-O2", f"-I{INCLUDE}", "-o", str(exe),
                    str(ROOT / "tests" / "native" / "fp8_soft.cu")], check=True, capture_output=True)
    values = _inputs()
    # the raw floats, without numpy (the CPU torch wheel does not bring it)
    (tmp_path / "in.bin").write_bytes(ctypes.string_at(values.data_ptr(), values.numel() * 4))
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    codes = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.uint8)
    n = values.numel()
    for i, fmt in enumerate((Fp8.E4M3FN, Fp8.E4M3FNUZ)):
        want = to_fp8(values, fmt, saturate=False).view(torch.uint8)
        got = codes[i * n:(i + 1) * n]
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, (f"{fmt.value}: {bad.numel()} of {n} differ, first at "
                                  f"{values[bad[0]].item()!r}: got {got[bad[0]]:#x}, want {want[bad[0]]:#x}")
