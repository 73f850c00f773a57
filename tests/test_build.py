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
    "num_kv_heads": 2, "cos_sin": "fp32", "norm": "plain", "rope": "neox", "index_mode": "full",
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


# A stand-in for the AMD check's compiler (its outputs, assembly, are text: checked by
# their record alone): logs each run, then writes `asm <its pid>` to -o, `sleep`ing between.
FAKE_CC = ('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
           'echo "run $$" >> "$0.log"; echo "asm $$ begins" > "$out"; sleep {sleep}; echo "asm $$ ends" >> "$out"\n')


def fake_amd_check(tmp_path, sleep=0):
    compiler = tmp_path / "fakecc"
    compiler.write_text(FAKE_CC.format(sleep=sleep))
    compiler.chmod(0o755)
    log = tmp_path / "fakecc.log"

    def runs() -> int:
        return log.read_text().count("run ") if log.exists() else 0

    return toolchain.Toolchain("clang-hip", str(compiler), "22", "gfx942", "/r"), runs


def test_build_many_builds_only_what_the_cache_lacks(tmp_path):
    """A second run of the same jobs compiles nothing (CI's compile step, then the tests'
    compile checks, share one cache); a new job alone is built; one whose record is gone
    is rebuilt, with a warning naming it. Every library returned matches its record."""
    tc, runs = fake_amd_check(tmp_path)
    jobs = [build.Job(v.uri, source_of(v)) for v in spec().variants[:3]]
    root = tmp_path / "cache"
    paths = build.build_many(jobs[:2], tc, root=root)
    assert runs() == 2 and paths == [job.library(tc, root) for job in jobs[:2]]
    assert all(build.check_artifact(p) is None for p in paths)
    assert build.build_many(jobs[:2], tc, root=root) == paths and runs() == 2
    assert build.build_many(jobs, tc, root=root)[:2] == paths and runs() == 3
    build.record_path(paths[1]).unlink()
    with pytest.warns(build.CorruptArtifactWarning, match=f"{paths[1]}: it has no record"):
        assert build.build_many(jobs, tc, root=root)[1] == paths[1]
    assert runs() == 4 and build.check_artifact(paths[1]) is None


def test_jit_builds_and_build_many_of_one_library_run_the_compiler_once(tmp_path):
    """The JIT `build` and the ahead-of-time `build_many` install through one function under
    the library's lock: three threads of each kind building one missing library run the
    compiler once; all get the same whole library (one run's output, not two interleaved),
    verified, and no temporary file is left."""
    tc, runs = fake_amd_check(tmp_path, sleep=0.5)
    v = spec().variants[0]
    job = build.Job(v.uri, source_of(v))
    root = tmp_path / "cache"
    results, errors = [], []

    def run(fn):
        try:
            results.append(fn())
        except build.BuildError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in
               [lambda: build.build(job, tc, root), lambda: build.build_many([job], tc, root=root)[0]] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 6 and len(set(results)) == 1 and runs() == 1
    lib = results[0]
    pid_begins, pid_ends = (line.split() for line in lib.read_text().splitlines())
    assert pid_begins[1] == pid_ends[1] and (pid_begins[2], pid_ends[2]) == ("begins", "ends")
    assert build.check_artifact(lib) is None and not list(lib.parent.glob("*.tmp"))


@needs_nvcc
def test_the_library_refuses_a_tile_or_k_v_groups_that_are_not_a_power_of_two(nvcc_sm90, tmp_path, monkeypatch):
    """kvf_launch checks the tile and the K/V groups itself, for callers of the C ABI that
    skip runtime/tuning.py (every variant: a library without per-token scales ignores a
    valid count). The refusal comes before any GPU call, so this runs without one; a tile
    it let through (3) would go on to the device query or a launch."""
    from kvforge.runtime.abi import Args

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    v = spec().variants[0]
    lib = KernelLibrary(str(build.build(build.Job(v.uri, source_of(v)), nvcc_sm90)), v.uri)

    def code(tile, v_loop=0, groups=0):
        args = Args(num_tokens=1, tokens_per_tile=tile, v_loop=v_loop, kv_groups=groups)
        return lib._launch(ctypes.byref(args), None)

    invalid = code(1, v_loop=99)  # the library's invalid-value code, from another argument
    assert invalid != 0 and "invalid" in lib.lib.kvf_error_string(invalid).decode().lower()
    assert [code(tile) for tile in (-1, 3, 5, 6, 7, 8)] == [invalid] * 6
    assert [code(1, groups=g) for g in (-1, 3, 5, 6, 7, 8)] == [invalid] * 6


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
    headers = {p.relative_to(INCLUDE.parent).as_posix() for p in INCLUDE.rglob("*") if p.is_file()}
    assert headers and headers == set(build.headers(INCLUDE))
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


# ---- another checkout's kernel (toolchain.on_tree; benchmarks/ab.py's `name=@DIR`) -------
def make_tree(root: Path, header_note: str = "") -> Path:
    """A stand-in for `git archive COMMIT | tar -x -C root`: this checkout's include/ and
    generated/, the main header with `header_note` appended (an older body, say)."""
    shutil.copytree(INCLUDE, root / "include")
    shutil.copytree(REPO / "generated", root / "generated")
    if header_note:
        with open(root / "include" / "kvforge" / "fused_qknorm_rope_cache.cuh", "a") as f:
            f.write(header_note)
    return root


def test_a_toolchain_on_another_tree_compiles_against_its_headers(tmp_path):
    tc = toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90")
    old = toolchain.on_tree(tc, make_tree(tmp_path / "old"))
    assert old.tree == str((tmp_path / "old").resolve()) and old.include == Path(old.tree, "include")
    assert tc.include == INCLUDE and f"-I{INCLUDE}" in tc.command("a.hip", "a.so")
    assert f"-I{old.include}" in old.command("a.hip", "a.so") and f"-I{INCLUDE}" not in old.command("a.hip", "a.so")
    amd = toolchain.Toolchain("clang-hip", "clang", "22", "gfx942", "/r")
    assert f"-I{old.include}" in toolchain.on_tree(amd, old.tree).host_check_command("a.hip")
    assert old != tc and len({old, tc}) == 2  # two toolchains to the registry


def test_on_tree_refuses_what_is_no_checkout(tmp_path):
    (tmp_path / "generated").mkdir()
    with pytest.raises(toolchain.ToolchainError, match=r"is no kvforge checkout: it has no include/kvforge/ "
                                                       r"\(make one with `git archive COMMIT"):
        toolchain.on_tree(toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90"), tmp_path)


def test_the_cache_key_hashes_the_headers_of_the_toolchains_tree(tmp_path):
    """An old tree's build and this checkout's of one source never share an entry; an edit
    to a header of that tree makes a new one. The key is of contents: a tree whose headers
    are this checkout's builds the same binary, and shares its entry."""
    tc = toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90")
    same = toolchain.on_tree(tc, make_tree(tmp_path / "same"))
    old = toolchain.on_tree(tc, make_tree(tmp_path / "old", "\n// an older body\n"))
    key = build.cache_key("src", old)
    assert key != build.cache_key("src", tc) and build.cache_key("src", same) == build.cache_key("src", tc)
    (Path(old.include) / "kvforge" / "abi.h").write_text("// another ABI\n")
    assert build.cache_key("src", old) not in (key, build.cache_key("src", tc))
    (Path(old.include) / "kvforge" / "new.cuh").write_text("// a new header\n")
    assert len({key, build.cache_key("src", old), build.cache_key("src", tc)}) == 3
    job = build.Job("v", "src")
    assert job.directory(old, tmp_path) != job.directory(tc, tmp_path)


def test_the_registry_builds_the_trees_source_for_a_toolchain_on_it(tmp_path, monkeypatch):
    """source_of and Registry.get with a toolchain on another tree take that tree's
    generated/<uri>.hip, and keep its library apart from this checkout's; a variant the tree
    lacks is refused, naming it and the tree."""
    from kvforge.runtime.registry import MissingSourceError

    tc = toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90")
    old = toolchain.on_tree(tc, make_tree(tmp_path / "old"))
    v, gone = spec().variants[:2]
    (Path(old.tree) / "generated" / f"{v.uri}.hip").write_text("// the old tree's source\n")
    (Path(old.tree) / "generated" / f"{gone.uri}.hip").unlink()
    assert source_of(v, old) == "// the old tree's source\n" and source_of(v, tc) == source_of(v)
    built = []
    monkeypatch.setattr(build, "build_and_load", lambda job, t, load: built.append((job, t)) or len(built))
    registry = Registry()
    assert (registry.get(v, old), registry.get(v, tc), registry.get(v, old)) == (1, 2, 1)
    assert built == [(build.Job(v.uri, "// the old tree's source\n"), old), (build.Job(v.uri, source_of(v)), tc)]
    with pytest.raises(MissingSourceError, match=f"^{gone.uri}: the tree {old.tree} has no generated/{gone.uri}.hip"):
        registry.get(gone, old)


@needs_nvcc
def test_a_build_on_another_tree_compiles_that_trees_headers(nvcc_sm90, tmp_path):
    """Through the JIT path: the tree's header is the one the compiler reads (an #error in
    it stops the build, naming it), and this checkout's build of that variant is untouched."""
    old = toolchain.on_tree(nvcc_sm90, make_tree(tmp_path / "old", "\n#error this is the old tree's header\n"))
    v = spec().variants[0]
    with pytest.raises(build.BuildError, match="this is the old tree's header"):
        build.build(build.Job(v.uri, source_of(v, old)), old, tmp_path / "cache")
