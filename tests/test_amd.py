"""The AMD side, proven by compiling: every variant's device code for gfx942 and gfx950
(clang's HIP mode against the Debian HIP headers), and what the assembly must show."""
import re
import subprocess

import pytest

from benchmarks.bench import COPY_SOURCE
from kvforge.codegen.lanes import lane_map_of
from kvforge.runtime import build, toolchain
from kvforge.runtime.abi import MAX_PIPELINE_DEPTH
from kvforge.runtime.registry import source_of, spec
from kvforge.runtime.testing import sample_variants

ALL = spec().variants
# The bf16 seed without an index branch: the 16-byte store check reads its assembly.
SEED = next(v for v in ALL if v.axes() == {
    "contract": "vllm_shuffle16", "dtype": "bf16", "head_dim": "128", "rotary_dim": "64",
    "num_kv_heads": "4", "cos_sin": "bf16", "norm": "gemma", "rope": "neox", "index_mode": "none",
    "kv_scale": "none"})
SAMPLE = sample_variants(ALL, must=(SEED,))
TARGETS = ("gfx942", "gfx950")
NATIVE_FP8 = {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}


def _toolchain(arch):
    try:
        return toolchain.amd_check(arch)
    except toolchain.ToolchainError as e:
        pytest.skip(f"AMD compile check unavailable: {e}")


@pytest.fixture(scope="module", params=[
    *(pytest.param((arch, SAMPLE), id=f"{arch}-sample") for arch in TARGETS),
    *(pytest.param((arch, ALL), id=f"{arch}-all", marks=pytest.mark.slow) for arch in TARGETS)])
def assembly(request):
    """(arch, variants, {uri: assembly text}) for a sample of the variants (the fast tier)
    or all of them (slow: CI's compile step has built them by then), built once, cached."""
    arch, variants = request.param
    tc = _toolchain(arch)
    paths = build.build_many([build.Job(v.uri, source_of(v)) for v in variants], tc)
    return arch, variants, {v.uri: p.read_text() for v, p in zip(variants, paths)}


@pytest.mark.parametrize("arch", TARGETS)
def test_the_host_side_compiles_for_hip(arch, tmp_path):
    """The launcher (launch_kernel, the depth dispatch) as hipcc would build it on the host,
    for one variant of each contract."""
    tc = _toolchain(arch)
    for contract in sorted({v.contract.name for v in ALL}):
        v = next(v for v in SAMPLE if v.contract.name == contract)
        src = tmp_path / f"{v.uri}.hip"
        src.write_text(source_of(v))
        r = subprocess.run(tc.host_check_command(str(src)), capture_output=True, text=True)
        assert r.returncode == 0, f"{v.uri}:\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("arch", TARGETS)
def test_the_benchmarks_copy_compiles_for_hip(arch, tmp_path):
    """benchmarks/copy.hip (bench.py's same-bytes copy) is written against the same
    portability header: its device code and its host side build for AMD too."""
    tc = _toolchain(arch)
    src = str(COPY_SOURCE)
    for cmd in (tc.command(src, str(tmp_path / "copy.s")), tc.host_check_command(src)):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]


def kernel_metadata(asm: str, key: str) -> list[str]:
    return re.findall(rf"^\s*\.{key}:\s*(\S+)", asm, flags=re.M)


def test_every_variant_compiles(assembly):
    arch, variants, asm = assembly
    assert len(asm) == len(variants)
    for uri, text in asm.items():
        assert f".amdgcn_target \"amdgcn-amd-amdhsa--{arch}" in text, uri


def test_waves_are_64_lanes_and_nothing_spills_to_scratch(assembly):
    _, variants, asm = assembly
    by_uri = {v.uri: v for v in variants}
    for uri, text in asm.items():
        # one kernel per pipeline depth and lane count the library holds (on AMD one set,
        # with the k_out/index_k_out stores: kvf::launch)
        kernels = MAX_PIPELINE_DEPTH * lane_map_of(by_uri[uri]).max_sub
        assert kernel_metadata(text, "wavefront_size") == ["64"] * kernels, uri
        # No scratch traffic. (A small private segment alone can be the slot LLVM reserves
        # for its register scavenger once SGPRs spill into VGPR lanes; it is never touched.)
        assert not re.search(r"^\s*(scratch_|buffer_)(load|store)", text, flags=re.M), f"{uri} uses scratch"
        assert all(int(n) <= 32 for n in kernel_metadata(text, "private_segment_fixed_size")), uri


def test_q_out_and_k_cache_stores_are_16_bytes(assembly):
    """q_out and the SHUFFLE K cache take whole 16-byte vectors (global_store_dwordx4);
    the bf16 seed variant has no other 16-byte writer but the transposed V runs."""
    _, _, asm = assembly
    stores = re.findall(r"^\s*(global_store_\w+)", asm[SEED.uri], flags=re.M)
    # main loop: q_out (1) + K (1) + the 16-byte index cache is absent (index_mode none);
    # V loop: one per dim of the run (8, unrolled).
    assert stores.count("global_store_dwordx4") >= 2 + 8
    assert "global_store_dwordx2" not in stores  # nothing of the model dtype is split


def test_fp8_uses_the_hardware_converter_for_the_native_flavour(assembly):
    arch, variants, asm = assembly
    checked = 0
    for v in variants:
        if v.fp8 is None:
            assert "v_cvt_pk_fp8_f32" not in asm[v.uri], v.uri
            continue
        native = v.fp8.value == NATIVE_FP8[arch]
        assert ("v_cvt_pk_fp8_f32" in asm[v.uri]) == native, v.uri
        checked += native
    assert checked > 0


def test_amd_check_toolchain_with_fakes(tmp_path):
    (tmp_path / "include" / "hip").mkdir(parents=True)
    (tmp_path / "include" / "hip" / "hip_runtime.h").write_text("")
    tc = toolchain.amd_check("gfx942", which=lambda n: "/usr/bin/clang++-22" if n == "clang++-22" else None,
                             run=lambda cmd: "Debian clang version 22.1.8 (1~deb12u1)\n",
                             env={"ROCM_PATH": str(tmp_path)})
    assert (tc.kind, tc.version, tc.rocm_path, tc.output_suffix) == ("clang-hip", "22.1.8", str(tmp_path), ".s")
    assert "--offload-arch=gfx942" in tc.flags and "--offload-device-only" in tc.flags
    with pytest.raises(toolchain.ToolchainError, match="install libamdhip64-dev or set ROCM_PATH"):
        toolchain.amd_check("gfx950", which=lambda n: "/c", run=lambda c: "clang version 22",
                            env={"ROCM_PATH": str(tmp_path / "nowhere")})
