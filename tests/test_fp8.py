"""The kernels' FP8 conversion against the reference's (runtime.reference.to_fp8) on every
bf16 and fp16 value, every exact rounding tie of both formats, the range's edges, NaN
and random fp32 values, both flavours, saturating and passthrough: the software routine
(the one every target without a native converter for a flavour runs: e4m3fnuz on NVIDIA,
e4m3fn on gfx942) built for the host, and on the GPU the kernels' own path. And the
per-token division (kvf::Divisor) built for the host against correctly rounded division."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvforge.codegen.model import Fp8
from kvforge.codegen.paths import INCLUDE
from kvforge.runtime import toolchain
from kvforge.runtime.reference import div, to_fp8

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
NATIVE = Path(__file__).parent / "native" / "fp8_codes.cu"


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
                               float("inf"), float("-inf"), float("nan"), -1000.0, -465.0, -464.0]))
    return torch.cat(parts).contiguous()


def _codes(cmd: list[str], mode: str, values: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """Build the harness with `cmd` (its output path last but one), run it in `mode`."""
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    # the raw floats, without numpy (the CPU torch wheel does not bring it)
    (tmp_path / "in.bin").write_bytes(ctypes.string_at(values.data_ptr(), values.numel() * 4))
    subprocess.run([cmd[cmd.index("-o") + 1], mode, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                   check=True)
    return torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.uint8)


def _compare(codes: torch.Tensor, values: torch.Tensor) -> None:
    """The harness's four blocks (e4m3fn then e4m3fnuz, each saturating then passthrough)."""
    n = values.numel()
    for i, (fmt, saturate) in enumerate([(f, s) for f in (Fp8.E4M3FN, Fp8.E4M3FNUZ) for s in (True, False)]):
        got = codes[i * n:(i + 1) * n]
        want = to_fp8(values, fmt, saturate).view(torch.uint8)
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, (f"{fmt.value} saturate={saturate}: {bad.numel()} of {n} differ, first at "
                                  f"{values[bad[0]].item()!r}: got {got[bad[0]]:#x}, want {want[bad[0]]:#x}")


def test_software_fp8_matches_the_reference(tmp_path):
    values = _inputs()
    cmd = ["nvcc", "-x", "cu", "-std=c++17", "-O2", f"-I{INCLUDE}", "-o", str(tmp_path / "fp8_codes"), str(NATIVE)]
    _compare(_codes(cmd, "host", values, tmp_path), values)


@pytest.mark.gpu
def test_the_kernels_fp8_path_on_the_gpu_matches_the_reference(tmp_path):
    """Built with the kernels' own flags for this GPU (its converter, where it has one)."""
    tc = toolchain.default()
    if tc.kind != "nvcc":
        pytest.skip("the harness is CUDA host code")
    values = _inputs()
    cmd = [c for c in tc.command(str(NATIVE), str(tmp_path / "fp8_codes")) if c != "-shared"]
    _compare(_codes(cmd, "device", values, tmp_path), values)


DIVIDE = Path(__file__).parent / "native" / "divide.cu"


def _division_records() -> torch.Tensor:
    """(amax, x) pairs: heads of every magnitude (scales under 2^-90, which the kernel
    scales by 2^64 first, down to 0, and up to FLT_MAX / 448), values anywhere up to the
    amax, quotients next to fp32 rounding ties, and the specials (0, inf, NaN)."""
    gen = torch.Generator().manual_seed(1)
    n = 100_000
    amax = torch.randn(n, generator=gen).abs() * torch.exp2(torch.randint(-150, 128, (n,), generator=gen).float())
    amax = amax[amax.isfinite() & (amax > 0)]
    u = torch.rand(amax.numel(), generator=gen) * 2 - 1
    u[::7] = 1.0
    x = amax * u
    # quotients at a tie of two fp32 values, scaled back by the scale the kernel makes
    s = div(amax, 448.0)
    q = torch.rand(amax.numel(), generator=gen) * 448 * torch.exp2(-torch.randint(0, 24, (amax.numel(),),
                                                                                generator=gen).float())
    tie = (q.double() + (q.nextafter(torch.tensor(float("inf"))).double() - q.double()) / 2) * s.double()
    ties = [tie.float(), tie.float().nextafter(torch.tensor(0.0)), tie.float().nextafter(torch.tensor(1e38))]
    edge = torch.tensor([2.0 ** -100, 448 * 2.0 ** -90, 240 * 2.0 ** -90, 1e-45, 3.4028234663852886e38])
    edge = torch.cat([edge, edge.nextafter(torch.tensor(0.0)), edge.nextafter(torch.tensor(float("inf")))])
    # an fp16 K rounded to +-inf (from 65520) beside its head's finite fp32 amax
    inf = float("inf")
    special_a = torch.tensor([0.0, inf, inf, float("nan"), 1.0, 1.0, 65520.0, 65536.0, 1e6, 3e38, 3e38, 0.0])
    special_x = torch.tensor([0.0, 1.0, inf, 1.0, float("nan"), -0.0, inf, -inf, inf, -inf, 1.0, -0.0])
    a = torch.cat([amax, amax, amax, amax, edge, edge, special_a])
    b = torch.cat([x, *ties, edge, -edge / 3, special_x])
    return torch.stack([a, b], dim=1).contiguous()


def test_the_per_token_division_is_the_ieee_division(tmp_path):
    """AITER's per-token FP8 divides each value by RN(amax / max); the kernel's Divisor
    does it as a multiply and two fmas (Markstein's correction), its scale likewise: the
    scale equals the correctly rounded quotient always, a value's quotient wherever it is
    2^-13 or more, and its FP8 code everywhere (smaller quotients are 0 in FP8 either way)."""
    records = _division_records()
    exe = tmp_path / "divide"
    subprocess.run(["nvcc", "-x", "cu", "-std=c++17", "-O2", "-Xcompiler", "-ffp-contract=off", f"-I{INCLUDE}",
                    "-o", str(exe), str(DIVIDE)], check=True, capture_output=True, text=True)
    (tmp_path / "in.bin").write_bytes(ctypes.string_at(records.data_ptr(), records.numel() * 4))
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(-1, 2, 2)
    amax, x = records[:, 0], records[:, 1]
    for i, (fmt, kmax) in enumerate([(Fp8.E4M3FN, 448.0), (Fp8.E4M3FNUZ, 240.0)]):
        scale, q = out[:, i, 0], out[:, i, 1]
        want_scale = torch.where(amax > 0, div(amax, kmax), torch.ones_like(amax))
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32)), fmt
        want = div(x, want_scale)
        exact = ~(want.abs() < 2.0 ** -13)  # NaN included
        same = (q.view(torch.int32) == want.view(torch.int32)) | (q.isnan() & want.isnan())
        bad = (exact & ~same).nonzero().flatten()
        assert bad.numel() == 0, (f"{fmt.value}: {bad.numel()} quotients differ, first x={x[bad[0]].item()!r} "
                                  f"amax={amax[bad[0]].item()!r}: got {q[bad[0]].item()!r}, want {want[bad[0]].item()!r}")
        for saturate in (True, False):
            assert torch.equal(to_fp8(q, fmt, saturate).view(torch.uint8), to_fp8(want, fmt, saturate).view(torch.uint8))
