"""Toolchain detection, the build cache and the registry (nvcc needed, no GPU)."""
import ctypes
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvforge.codegen.model import make_variant
from benchmarks.bench import COPY_SOURCE
from kvforge.codegen.paths import INCLUDE
from kvforge.runtime import build, toolchain
from kvforge.runtime.abi import KernelLibrary
from kvforge.runtime.registry import Registry, UnlistedVariantWarning, listed, source_of, spec
from kvforge.runtime.testing import sample_variants

REPO = Path(__file__).resolve().parents[1]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
NVCC_OUT = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
HIPCC_OUT = "HIP version: 6.2.41134-65d174c3e\nAMD clang version 18.0.0git\n"


def fake_which(found):
    return lambda name: found.get(name)


def test_detect_nvcc_with_fakes():
    tc = toolchain.detect(is_rocm=False, which=fake_which({"nvcc": "/x/nvcc"}),
                          run=lambda cmd: NVCC_OUT, arch="sm_90", env={})
    assert (tc.kind, tc.compiler, tc.version, tc.arch) == ("nvcc", "/x/nvcc", "13.0.88", "sm_90")
    assert "-gencode=arch=compute_90,code=sm_90" in tc.flags and "--fmad=false" in tc.flags


def test_detect_hipcc_with_fakes():
    tc = toolchain.detect(is_rocm=True, which=fake_which({"hipcc": "/opt/rocm/bin/hipcc"}),
                          run=lambda cmd: HIPCC_OUT, env={"KVFORGE_ARCH": "gfx942"})
    assert (tc.kind, tc.version, tc.arch) == ("hipcc", "6.2.41134-65d174c3e", "gfx942")
    assert "--offload-arch=gfx942" in tc.flags and "-ffp-contract=off" in tc.flags
    assert tc.command("a.hip", "a.so")[0] == "/opt/rocm/bin/hipcc"


def test_detect_errors_are_actionable():
    with pytest.raises(toolchain.ToolchainError, match=r"hipcc not found on PATH or under ROCM_PATH \(/r\)"):
        toolchain.detect(is_rocm=True, which=fake_which({}), run=lambda c: "", arch="gfx942",
                         env={"ROCM_PATH": "/r"})
    with pytest.raises(toolchain.ToolchainError, match="hipcc builds for gfx targets, got arch 'sm_90'"):
        toolchain.detect(is_rocm=True, which=fake_which({"hipcc": "h"}), run=lambda c: HIPCC_OUT,
                         arch="sm_90", env={})


def test_cache_key_covers_source_compiler_arch_and_flags():
    tc = toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90")
    keys = {build.cache_key("src", tc), build.cache_key("src2", tc),
            build.cache_key("src", toolchain.Toolchain("nvcc", "nvcc", "13.0.89", "sm_90")),
            build.cache_key("src", toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_100")),
            build.cache_key("src", toolchain.Toolchain("hipcc", "nvcc", "13.0.88", "sm_90")),
            build.cache_key("src", toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90",
                                                       defines=("KVF_ASYNC_COPY=0",)))}
    assert len(keys) == 6


def test_defines_reach_every_compile_command():
    for tc in (toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90", defines=("A=1", "B")),
               toolchain.Toolchain("hipcc", "hipcc", "6.2", "gfx942", defines=("A=1", "B")),
               toolchain.Toolchain("clang-hip", "clang", "22", "gfx942", "/r", defines=("A=1", "B"))):
        assert tc.command("a.hip", "a.so")[-6:-4] == ["-DA=1", "-DB"], tc.kind
    assert "-DA=1" in tc.host_check_command("a.hip")


UNLISTED = make_variant(spec().contracts, {
    "contract": "vllm_shuffle16", "dtype": "fp16", "head_dim": 64, "rotary_dim": 32,
    "num_kv_heads": 2, "cos_sin": "fp32", "norm": "plain", "index_mode": "full",
    "index_dtype": "fp8", "kv_scale": "per_tensor", "fp8": "e4m3fnuz"})


@pytest.fixture(scope="module")
def nvcc_sm90():
    return toolchain.detect(is_rocm=False, arch="sm_90")


@needs_nvcc
def test_unlisted_signature_is_rendered_built_and_explained(nvcc_sm90, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    assert UNLISTED not in listed()
    with pytest.warns(UnlistedVariantWarning) as record:
        lib = Registry().get(UNLISTED, nvcc_sm90)
    assert lib.uri == UNLISTED.uri
    hint = str(record[0].message)
    assert "is in no variants file" in hint and "contract: vllm_shuffle16" in hint
    assert "head_dim: 64" in hint and "python -m kvforge.codegen" in hint


@needs_nvcc
def test_corrupt_library_is_rebuilt(nvcc_sm90, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    v = spec().variants[0]
    job = build.Job(v.uri, source_of(v))
    path = build.build(job, nvcc_sm90)
    path.write_bytes(b"\x7fELF truncated")
    with pytest.raises(OSError):
        KernelLibrary(str(path), v.uri)
    lib = Registry().get(v, nvcc_sm90)  # rebuilds instead of crashing
    assert lib.uri == v.uri and path.stat().st_size > 1000


def test_build_many_builds_only_what_the_cache_lacks(tmp_path, monkeypatch):
    """A second run of the same jobs compiles nothing (CI's compile step, then the tests'
    compile checks, share one cache); a new job alone is built."""
    tc = toolchain.Toolchain("nvcc", "/bin/false", "13.0.88", "sm_90")
    jobs = [build.Job(v.uri, source_of(v)) for v in spec().variants[:3]]
    built = []

    def fake_ninja(ninja_file, jobs=None, targets=(), progress=None):
        outs = [line.split()[1].rstrip(":") for line in ninja_file.read_text().splitlines()
                if line.startswith("build ")]
        built.append(sorted(outs))
        for out in outs:
            Path(out).write_bytes(b"lib")

    monkeypatch.setattr(build, "run_ninja", fake_ninja)
    paths = build.build_many(jobs[:2], tc, root=tmp_path)
    assert built == [sorted(map(str, paths))] and len(paths) == 2
    assert build.build_many(jobs[:2], tc, root=tmp_path) == paths and len(built) == 1
    assert build.build_many(jobs, tc, root=tmp_path)[:2] == paths
    assert built[1] == [str(jobs[2].library(tc, tmp_path))]


def test_two_builds_of_one_missing_library_each_install_a_whole_one(tmp_path):
    """build_many takes no lock: two runs of it (here two threads) that both miss a
    library write its source and compile it side by side, each to temporary names of
    its own, so neither writes into the other's file and both install a whole one (a
    shared temporary name interleaved them, or made the second rename fail)."""
    compiler = tmp_path / "fakecc"
    compiler.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
                        'echo "$$ begins" > "$out"; sleep 0.5; echo "$$ ends" >> "$out"\n')
    compiler.chmod(0o755)
    tc = toolchain.Toolchain("nvcc", str(compiler), "13.0.88", "sm_90")
    v = spec().variants[0]
    job = build.Job(v.uri, source_of(v))
    results, errors = [], []

    def run():
        try:
            results.append(build.build_many([job], tc, root=tmp_path / "cache"))
        except build.BuildError as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    pid_begins, pid_ends = (line.split() for line in results[0][0].read_text().splitlines())
    assert pid_begins[0] == pid_ends[0] and (pid_begins[1], pid_ends[1]) == ("begins", "ends")
    assert not list(results[0][0].parent.glob("*.tmp"))


@needs_nvcc
def test_concurrent_builds_build_once(nvcc_sm90, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    v = spec().variants[1]
    job = build.Job(v.uri, source_of(v))
    calls, real = [], build.run_ninja

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(build, "run_ninja", counting)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(build.build(job, nvcc_sm90))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and len(calls) == 1
    assert not list(paths[0].parent.glob("*.tmp"))


@needs_nvcc
def test_the_library_refuses_a_tile_that_is_not_a_power_of_two(nvcc_sm90, tmp_path, monkeypatch):
    """kvf_launch checks the tile itself, for callers of the C ABI that skip
    runtime/tuning.py. The refusal comes before any GPU call, so this runs without one;
    a tile it let through (3) would go on to the device query or a launch."""
    from kvforge.runtime.abi import Args

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    v = spec().variants[0]
    lib = KernelLibrary(str(build.build(build.Job(v.uri, source_of(v)), nvcc_sm90)), v.uri)

    def code(tile, v_loop=0):
        args = Args(num_tokens=1, tokens_per_tile=tile, v_loop=v_loop)
        return lib._launch(ctypes.byref(args), None)

    invalid = code(1, v_loop=99)  # the library's invalid-value code, from another argument
    assert invalid != 0 and "invalid" in lib.lib.kvf_error_string(invalid).decode().lower()
    assert [code(tile) for tile in (-1, 3, 5, 6, 7, 8)] == [invalid] * 6


@needs_nvcc
@pytest.mark.parametrize("tier", ["sample", pytest.param("all", marks=pytest.mark.slow)])
def test_variants_compile_for_sm90(tier):
    """The compile check, by the command the README documents: a sample meeting every
    contract and FP8 flavour (fast tier), or every variant (slow tier, sharing the session's
    build cache, so after CI's compile step this only re-checks)."""
    variants = sample_variants(spec().variants) if tier == "sample" else spec().variants
    filters = [arg for v in variants for arg in ("--filter", v.uri)] if tier == "sample" else []
    proc = subprocess.run([sys.executable, "-m", "kvforge.codegen", "compile", "--target", "sm_90",
                           *filters], cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = len(variants)
    assert f"sm_90: {n}/{n} variants compiled" in proc.stderr


def test_cache_key_covers_every_header():
    """A kernel-body edit must never load a binary built from the old body."""
    from kvforge.codegen.paths import INCLUDE
    from kvforge.codegen.render import kernel_sources

    headers = {p.relative_to(INCLUDE.parent).as_posix() for p in INCLUDE.rglob("*") if p.is_file()}
    assert headers and headers <= set(kernel_sources())
    assert "include/kvforge/fused_qknorm_rope_cache.cuh" in headers


def test_rocm_arch_comes_from_the_device(monkeypatch):
    """On ROCm the offload arch is the device's gcnArchName, features stripped."""
    import torch

    class Props:
        gcnArchName = "gfx942:sramecc+:xnack-"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    tc = toolchain.detect(is_rocm=True, which=fake_which({"hipcc": "/opt/rocm/bin/hipcc"}),
                          run=lambda cmd: HIPCC_OUT, env={})
    assert tc.arch == "gfx942" and "--offload-arch=gfx942" in tc.flags


def test_the_ctypes_mirror_matches_the_c_abi(tmp_path):
    """runtime/abi.py lays out kvf_args_t as the C compiler does (the loader checks only
    the version): the header's fields in order, then every offset and the size as the host
    C compiler prints them."""
    import re

    from kvforge.runtime.abi import Args, CacheArg

    header = re.sub(r"//[^\n]*", "", (INCLUDE / "kvforge" / "abi.h").read_text())
    for struct in (CacheArg, Args):
        name = "kvf_cache_t" if struct is CacheArg else "kvf_args_t"
        body = re.search(r"typedef struct \{([^{}]*)\} " + name + ";", header)[1]
        declared = re.findall(r"(\w+)(?:\[\w+\])?;", body)
        assert [f for f, _ in struct._fields_] == declared, name
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler")
    fields = [("kvf_cache_t", name) for name, _ in CacheArg._fields_] + \
             [("kvf_args_t", name) for name, _ in Args._fields_]
    prints = "".join(f'  printf("%zu\\n", offsetof({t}, {f}));\n' for t, f in fields)
    src = tmp_path / "abi.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "kvforge/abi.h"\nint main(void) {\n'
                   f'{prints}  printf("%zu\\n%zu\\n", sizeof(kvf_cache_t), sizeof(kvf_args_t));\n  return 0;\n}}\n')
    exe = tmp_path / "abi"
    subprocess.run([cc, "-I", str(INCLUDE), str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    want = [getattr(CacheArg if t == "kvf_cache_t" else Args, f).offset for t, f in fields] + \
           [ctypes.sizeof(CacheArg), ctypes.sizeof(Args)]
    assert got == want, [(f, g, w) for (_, f), g, w in zip(fields + [("", "sizeof")] * 2, got, want) if g != w]


@needs_nvcc
def test_the_benchmarks_copy_builds_as_a_variant_does_and_is_a_dependent_launch(nvcc_sm90, tmp_path):
    """benchmarks/copy.hip, bench.py's same-bytes copy (its GPU test: tests/test_bench.py)."""
    tc = nvcc_sm90
    lib = ctypes.CDLL(str(build.build(build.Job("bench_copy16", COPY_SOURCE.read_text()), tc, root=tmp_path)))
    assert lib.kvf_bench_copy16
    # The op waits for the previous kernel and lets the next one start; a copy that did
    # neither would pay a launch the op does not (torch's add: 4-5% slower at 46-84 MB).
    ptx = tmp_path / "copy.ptx"
    subprocess.run([tc.compiler, "-x", "cu", "-std=c++17", "-ptx", "-arch=sm_90", f"-I{INCLUDE}",
                    str(COPY_SOURCE), "-o", str(ptx)], check=True, capture_output=True)
    text = ptx.read_text()
    assert "griddepcontrol.launch_dependents;" in text and "griddepcontrol.wait;" in text
