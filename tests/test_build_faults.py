"""Nothing a broken disk or a broken compiler does crashes the process (issue 35, items 1
and 6): cached libraries are checked against the record written at install before they are
loaded, counted or returned, and every fault around a build raises an error that says what
to do, leaving nothing in the cache that a later run trusts. CPU only: one small variant is
compiled once by the real nvcc; the rebuilds after that are done by a fake compiler that
logs its run and copies that library (the recovery does not depend on who compiles)."""
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvforge.codegen.__main__ import _compile
from kvforge.runtime import build, toolchain
from kvforge.runtime.registry import source_of, spec

REPO = Path(__file__).resolve().parents[1]
# One small listed variant (head_dim 64, no KV scale): the only real compile of this module.
SMALL = next(v for v in spec().variants
             if v.axes()["head_dim"] == "64" and v.axes()["kv_scale"] == "none")
JOB = build.Job(SMALL.uri, source_of(SMALL))
REAL_NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(REAL_NVCC is None, reason="nvcc not installed")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_runs(log: Path, tag: str = "compile") -> int:
    return log.read_text().split().count(tag) if log.exists() else 0


def script(path: Path, body: str) -> Path:
    """A compiler stand-in: `$out` is what follows -o (empty for a probe such as --version)."""
    path.write_text("#!/bin/sh\nout=\"\"; prev=\"\"\n"
                    "for a in \"$@\"; do [ \"$prev\" = \"-o\" ] && out=\"$a\"; prev=\"$a\"; done\n"
                    + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def nvcc_shim(bindir: Path, log: Path, pristine: Path, gate: Path | None = None) -> Path:
    """`nvcc` for PATH: a probe (no -o) logs "probe" and runs the real nvcc; a compile logs
    "compile <case>", waits for `gate` if given, and copies the pristine library to -o."""
    bindir.mkdir(parents=True, exist_ok=True)
    wait = (f'i=0; while [ ! -e "{gate}" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done\n'
            if gate else "")
    return script(bindir / "nvcc", f"""\
        if [ -z "$out" ]; then echo "probe $$" >> "{log}"; exec "{REAL_NVCC}" "$@"; fi
        echo "compile ${{KVF_TEST_CASE:-}}" >> "{log}"
        {wait}exec cp "{pristine}" "$out"
        """)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The small variant built once by the real nvcc, verified, and a copy of its bytes."""
    if REAL_NVCC is None:
        pytest.skip("nvcc not installed")
    tc = toolchain.detect(is_rocm=False, arch="sm_90")
    root = tmp_path_factory.mktemp("pristine-cache")
    lib = build.build(JOB, tc, root)
    assert build.check_artifact(lib) is None
    copy = tmp_path_factory.mktemp("pristine") / lib.name
    shutil.copyfile(lib, copy)
    return SimpleNamespace(tc=tc, root=root, lib=lib, so=copy, sha=sha256(copy), size=copy.stat().st_size)


def cache_copy(p, root: Path) -> Path:
    """A cache at `root` holding the pristine, verified library (source, library, record)."""
    shutil.copytree(p.lib.parent, JOB.directory(p.tc, root), ignore=shutil.ignore_patterns("*.lock"))
    lib = JOB.library(p.tc, root)
    assert build.check_artifact(lib) is None
    return lib


def damage(lib: Path, case: str) -> None:
    """In place, as a broken disk would (the file keeps its inode)."""
    size = lib.stat().st_size
    if case.startswith("truncate-"):
        n = case.removeprefix("truncate-")
        with open(lib, "r+b") as f:
            f.truncate(size - 4096 if n == "short" else int(n))
    elif case == "flip":
        with open(lib, "r+b") as f:
            f.seek(size // 2)
            chunk = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
    elif case == "zero-fill":
        with open(lib, "r+b") as f:
            f.write(bytes(size))
    elif case == "no-record":
        build.record_path(lib).unlink()
    elif case == "record-zeroed":
        rec = build.record_path(lib)
        rec.write_bytes(bytes(rec.stat().st_size))
    elif case == "from-another-key":  # a whole library and its record, moved in from another key
        rec = build.record_path(lib)
        rec.write_text(rec.read_text().replace(lib.parent.name, f"{SMALL.uri}-0123456789abcdef0123"))
    else:
        raise AssertionError(case)


DAMAGE = ["truncate-0", "truncate-1000", "truncate-600000", "truncate-short", "flip", "zero-fill",
          "no-record", "record-zeroed", "from-another-key"]

# The loads, in a process of their own: a dlopen that dies of SIGBUS must not take pytest.
LOADER = r"""
import json, os, sys, warnings
from pathlib import Path
from kvforge.runtime import build, toolchain
from kvforge.runtime.registry import Registry, spec
args = json.loads(sys.argv[1])
v = next(v for v in spec().variants if v.uri == args["uri"])
tc = toolchain.Toolchain("nvcc", args["compiler"], args["version"], "sm_90")
for case, root in args["cases"]:
    print("case", case, flush=True)
    os.environ["KVFORGE_CACHE_DIR"] = root
    os.environ["KVF_TEST_CASE"] = case
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = Registry().get(v, tc)
    print(json.dumps({"case": case, "uri": lib.uri, "loaded": lib.path,
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}), flush=True)
"""


@needs_nvcc
def test_damaged_libraries_are_rebuilt_before_they_are_loaded(pristine, tmp_path):
    """Each damage a disk can do to a cached library (truncated to 0, 1000, 600000 bytes and
    by 4 KB, bytes flipped in the middle, zero-filled, its record gone or zeroed), a library
    and record moved in from another key's directory, and a foreign library with a valid
    record of its own entry (another ABI version, caught by the loader): the registry's load in a
    subprocess exits 0, warns naming the file, compiles it exactly once and loads the
    rebuilt library (the foreign one: after failing its ABI check, once), which then
    matches its record and the pristine bytes. A bare dlopen of the 600000-byte truncation
    kills its process with SIGBUS: what the check before dlopen prevents."""
    log = tmp_path / "compiler.log"
    shim = nvcc_shim(tmp_path / "bin", log, pristine.so)
    cases, libs = [], {}
    for case in DAMAGE:
        lib = cache_copy(pristine, tmp_path / case)
        damage(lib, case)
        assert build.check_artifact(lib) is not None, case
        cases.append((case, str(tmp_path / case)))
        libs[case] = lib
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:  # a library that loads, with a valid record, but is not this variant's ABI
        foreign_src = tmp_path / "foreign.c"
        foreign_src.write_text('int kvf_abi_version(void) { return 9999; }\n'
                               'const char* kvf_variant(void) { return "foreign"; }\n'
                               'const char* kvf_error_string(int c) { return ""; }\n'
                               'int kvf_launch(void* a, void* s) { return 0; }\n')
        lib = cache_copy(pristine, tmp_path / "foreign")
        subprocess.run([cc, "-shared", "-fPIC", str(foreign_src), "-o", str(lib)], check=True, timeout=60)
        build.record_path(lib).write_text(build._record_text(lib, sha256(lib), lib.stat().st_size))
        assert build.check_artifact(lib) is None
        cases.append(("foreign", str(tmp_path / "foreign")))
        libs["foreign"] = lib

    bare = tmp_path / "bare.so"
    shutil.copyfile(pristine.so, bare)
    damage(bare, "truncate-600000")
    raw = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(bare)],
                         capture_output=True, timeout=60)
    assert raw.returncode in (-signal.SIGBUS, -signal.SIGSEGV), raw

    arg = json.dumps({"uri": SMALL.uri, "compiler": str(shim), "version": pristine.tc.version, "cases": cases})
    proc = subprocess.run([sys.executable, "-c", LOADER, arg], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["case"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines()
                                                      if line.startswith("{")))}
    assert sorted(results) == sorted(libs)
    compiles = log.read_text().split("\n")
    for case, lib in libs.items():
        r = results[case]
        assert r["uri"] == SMALL.uri, r
        assert compiles.count(f"compile {case}") == 1, (case, compiles)
        assert any("CorruptArtifactWarning" in w and str(lib) in w for w in r["warnings"]), r
        assert build.check_artifact(lib) is None and sha256(lib) == pristine.sha, case
        assert not list(lib.parent.glob("*.tmp")), case


@needs_nvcc
@pytest.mark.parametrize("case", ["truncate-0", "truncate-short"])
def test_codegen_compile_rebuilds_a_damaged_library_and_counts_it_only_verified(pristine, tmp_path, monkeypatch,
                                                                             capsys, case):
    """`codegen compile` over a cache whose library is 0 bytes (it used to report "1/1
    variants compiled" and leave it so) or 4 KB short (it used to be trusted): it warns,
    compiles once, and reports 1/1 with the library matching its record."""
    log = tmp_path / "compiler.log"
    nvcc_shim(tmp_path / "bin", log, pristine.so)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    lib = cache_copy(pristine, tmp_path / "cache")
    damage(lib, case)
    with pytest.warns(build.CorruptArtifactWarning, match=str(lib)):
        assert _compile([SMALL], ["sm_90"], 2) == 0
    assert "sm_90: 1/1 variants compiled" in capsys.readouterr().err
    assert compile_runs(log) == 1
    assert build.check_artifact(lib) is None and sha256(lib) == pristine.sha
    assert _compile([SMALL], ["sm_90"], 2) == 0 and compile_runs(log) == 1  # now it is trusted


def test_codegen_compile_never_counts_a_library_it_did_not_verify(tmp_path, monkeypatch, capsys):
    """A build that hands back a library its record does not vouch for is a failure."""
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(toolchain, "detect", lambda **k: toolchain.Toolchain("nvcc", "nvcc", "13.0.88", "sm_90"))

    def unverified(jobs, tc, root, **k):
        lib = jobs[0].library(tc, root)
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"\x7fELF not recorded")
        return [lib]

    monkeypatch.setattr(build, "build_many", unverified)
    assert _compile([SMALL], ["sm_90"], 1) == 1
    err = capsys.readouterr().err
    assert "sm_90: FAILED: built but not verified" in err and "variants compiled" not in err


@needs_nvcc
def test_concurrent_codegen_compiles_run_the_compiler_once(pristine, tmp_path):
    """4 processes `python -m kvforge.codegen compile --filter <one variant>` over an empty
    cache: every one finds the library missing (each prints its [1/1] progress line: the
    fake compiler's run is held until all four have probed the compiler, so all are past
    their cache check), the compiler runs once, and all four report it compiled; it matches
    its record."""
    log, gate = tmp_path / "compiler.log", tmp_path / "gate"
    nvcc_shim(tmp_path / "bin", log, pristine.so, gate=gate)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "KVFORGE_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "kvforge.codegen", "compile", "--target", "sm_90", "--filter", SMALL.uri]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        deadline = time.monotonic() + 120
        while compile_runs(log, "probe") < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # each is past its cache check, in the build's lock, within milliseconds
        gate.touch()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert f"sm_90: [1/1] nvcc sm_90 {SMALL.uri}" in err, err[-3000:]
        assert "sm_90: 1/1 variants compiled" in err, err[-3000:]
    assert compile_runs(log) == 1, log.read_text()
    lib = JOB.library(pristine.tc, tmp_path / "cache")
    assert build.check_artifact(lib) is None and sha256(lib) == pristine.sha


# ---- Faults around the build (item 6) --------------------------------------------------

def nothing_trusted(tc, root: Path) -> None:
    """No library, no record, no temporary file: nothing a later run could trust."""
    lib = JOB.library(tc, root)
    left = sorted(p.name for p in lib.parent.iterdir()) if lib.parent.exists() else []
    assert not lib.exists() and not build.record_path(lib).exists(), left
    assert not [n for n in left if n.endswith(".tmp")], left


def test_a_missing_compiler_says_what_to_install_or_set(tmp_path, monkeypatch, capsys):
    """No nvcc on PATH or under CUDA_HOME: detection (and so `codegen compile`) says to
    install it or set PATH / CUDA_HOME; a compiler that vanished after detection fails the
    build naming it; a compiler whose --version fails or hangs fails detection naming the
    command. Nothing is installed."""
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    assert _compile([SMALL], ["sm_90"], 1) == 1
    err = capsys.readouterr().err
    assert "sm_90: FAILED: nvcc not found on PATH or under CUDA_HOME" in err and "set CUDA_HOME" in err

    gone = toolchain.Toolchain("nvcc", str(tmp_path / "gone" / "nvcc"), "13.0.88", "sm_90")
    with pytest.raises(build.BuildError, match=r"cannot run the compiler .*/gone/nvcc.*PATH"):
        build.build(JOB, gone, tmp_path / "cache")
    nothing_trusted(gone, tmp_path / "cache")

    monkeypatch.setenv("PATH", path)  # the stand-ins below run sleep
    failing = script(tmp_path / "failing", "echo 'nvcc: broken install' >&2; exit 3\n")
    with pytest.raises(toolchain.ToolchainError, match=r"--version exited with status 3.*\n.*broken install"):
        toolchain.detect(is_rocm=False, arch="sm_90", which=lambda name: str(failing), env={})
    hanging = script(tmp_path / "hanging", "sleep 30\n")
    monkeypatch.setattr(toolchain, "PROBE_TIMEOUT", 1)
    start = time.monotonic()
    with pytest.raises(toolchain.ToolchainError, match="did not finish within 1 s"):
        toolchain.detect(is_rocm=False, arch="sm_90", which=lambda name: str(hanging), env={})
    assert time.monotonic() - start < 20


def exits_soon(pid: int, within: float = 5.0) -> bool:
    """Whether `pid` is gone or a zombie within `within` s. The build returns when the pipe
    closes, and a killed process closes its files before it turns zombie: for that moment
    it still reads as running, so one look would race its exit."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + within
    while True:
        try:
            if stat.read_text().split(")")[-1].split()[0] in "ZX":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


FAILING = {
    # name: (compiler body, what the error must say)
    "exit-status": ("echo 'kernel.hip(7): error: something broke'; echo 'one more line' >&2; exit 2\n",
                    r"exited with status 2.*something broke.*one more line"),
    "writes-nothing": ("exit 0\n", "exited 0 but wrote no output"),
    "writes-empty": (': > "$out"\n', "exited 0 but wrote an empty file"),
    "writes-truncated": ('head -c 600000 "$PRISTINE" > "$out"\n',
                         r"exited 0 but wrote a damaged library \((ELF headers|a loaded segment) past the end"),
    "disk-full": ('head -c 1000 "$PRISTINE" > "$out"; echo "$out: No space left on device" >&2; exit 1\n',
                  r"exited with status 1.*No space left on device.*the disk is full.*KVFORGE_CACHE_DIR"),
    "hangs": ('sleep 60 & echo $! > "$PIDFILE"; wait\n', r"did not finish within 1 s.*KVFORGE_BUILD_TIMEOUT"),
}


@needs_nvcc
@pytest.mark.parametrize("fault", list(FAILING))
def test_a_failing_compiler_raises_with_its_command_and_output_and_installs_nothing(pristine, fault, tmp_path,
                                                                                monkeypatch):
    """A compiler that exits nonzero, writes nothing or an empty or truncated library with
    exit 0, fills the disk, or hangs: BuildError naming the command, the source and the
    compiler's last lines (and, for a full disk, KVFORGE_CACHE_DIR), within the timeout for
    the hang; no library, record or temporary file is left; the next build (a working
    compiler) installs and verifies it."""
    body, message = FAILING[fault]
    monkeypatch.setenv("PRISTINE", str(pristine.so))
    monkeypatch.setenv("PIDFILE", str(tmp_path / "pid"))
    monkeypatch.setenv("KVFORGE_BUILD_TIMEOUT", "1")
    fake = script(tmp_path / "nvcc", body)
    tc = toolchain.Toolchain("nvcc", str(fake), pristine.tc.version, "sm_90")
    root = tmp_path / "cache"
    start = time.monotonic()
    with pytest.raises(build.BuildError) as e:
        build.build(JOB, tc, root)
    assert time.monotonic() - start < 20
    text = str(e.value)
    assert re.search(message, text, flags=re.S), text
    src = JOB.directory(tc, root) / f"{JOB.uri}.hip"
    assert str(fake) in text and str(src) in text, text  # the command, with the source
    nothing_trusted(tc, root)
    if fault == "hangs":  # the compiler's own children were killed with it
        assert exits_soon(int((tmp_path / "pid").read_text())), "the compiler's child outlived it"
    ok = script(tmp_path / "ok", 'cp "$PRISTINE" "$out"\n')
    lib = build.build(JOB, toolchain.Toolchain("nvcc", str(ok), pristine.tc.version, "sm_90"), root)
    assert build.check_artifact(lib) is None and sha256(lib) == pristine.sha


def test_build_many_reports_every_failure_after_trying_all(tmp_path):
    """One job failing does not stop the others (as ninja -k 0 did): the rest are installed
    and verified, then one BuildError names each failure."""
    fake = script(tmp_path / "cc", 'case "$out" in *idxnone*) echo "no luck" >&2; exit 1;; esac\n'
                                   'echo "asm" > "$out"\n')
    tc = toolchain.Toolchain("clang-hip", str(fake), "22", "gfx942", "/r")
    variants = spec().variants
    jobs = [build.Job(v.uri, source_of(v)) for v in ([v for v in variants if "idxnone" in v.uri][:2]
                                                     + [v for v in variants if "idxnone" not in v.uri][:3])]
    bad = [j for j in jobs if "idxnone" in j.uri]
    assert len(bad) == 2
    with pytest.raises(build.BuildError, match=f"{len(bad)} of {len(jobs)} kernel builds failed") as e:
        build.build_many(jobs, tc, root=tmp_path / "cache", parallel=3)
    for job in jobs:
        lib = job.library(tc, tmp_path / "cache")
        if job in bad:
            assert job.uri in str(e.value) and not lib.exists()
        else:
            assert build.check_artifact(lib) is None


@pytest.mark.parametrize("how", ["under-a-file", "chmod-555"])
def test_an_unwritable_cache_names_KVFORGE_CACHE_DIR(how, tmp_path, monkeypatch, capsys):
    """A cache directory that cannot be written (under a regular file, so mkdir fails even
    as root; or chmod 555, which root ignores, so skipped as root): BuildError naming
    KVFORGE_CACHE_DIR, from `build` and from `codegen compile`."""
    if how == "under-a-file":
        (tmp_path / "file").write_text("")
        root = tmp_path / "file" / "cache"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a chmod 555 directory: the under-a-file case covers it")
        root = tmp_path / "ro"
        root.mkdir()
        root.chmod(0o555)
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(root))
    tc = toolchain.Toolchain("clang-hip", "/bin/false", "22", "gfx942", "/r")
    with pytest.raises(build.BuildError, match=f"cannot write the kernel cache .*KVFORGE_CACHE_DIR \\({root}\\)"):
        build.build(JOB, tc)
    monkeypatch.setattr(toolchain, "detect", lambda **k: toolchain.Toolchain("nvcc", "/bin/false", "13", "sm_90"))
    assert _compile([SMALL], ["sm_90"], 1) == 1
    assert "KVFORGE_CACHE_DIR" in capsys.readouterr().err


class _ReadOnlyLock:
    """FileLock on a read-only file system (simulated: root writes through chmod)."""

    def __init__(self, path, *a, **k):
        self.path = path

    def acquire(self, *a, **k):
        raise PermissionError(errno.EROFS, "Read-only file system", self.path)


def test_a_read_only_cache_serves_verified_libraries_and_names_KVFORGE_CACHE_DIR_for_the_rest(tmp_path,
                                                                                           monkeypatch):
    """A prebuilt cache mounted read-only: a verified library is returned without a lock or
    a write; a damaged one cannot be rebuilt there, and the error says so."""
    fake = script(tmp_path / "cc", 'echo "asm" > "$out"\n')
    tc = toolchain.Toolchain("clang-hip", str(fake), "22", "gfx942", "/r")
    lib = build.build(JOB, tc, tmp_path)
    monkeypatch.setattr(build, "FileLock", _ReadOnlyLock)
    assert build.build(JOB, tc, tmp_path) == lib
    assert build.build_many([JOB], tc, tmp_path) == [lib]
    lib.write_text("asm, damaged\n")
    with pytest.raises(build.BuildError, match="Read-only file system.*KVFORGE_CACHE_DIR"):
        build.build(JOB, tc, tmp_path)


@pytest.mark.parametrize("which", ["source", "record"])
def test_a_full_disk_while_installing_leaves_nothing_trusted(which, tmp_path, monkeypatch):
    """ENOSPC (simulated in Python: there is no tiny tmpfs here) writing the source or the
    record, after the library was renamed into place: BuildError naming the disk-full error
    and KVFORGE_CACHE_DIR, no library or record left; the next build with space succeeds."""
    fake = script(tmp_path / "cc", 'echo "asm" > "$out"\n')
    tc = toolchain.Toolchain("clang-hip", str(fake), "22", "gfx942", "/r")
    real = build.write_if_different

    def full(path, text):
        if path.name.endswith(".hip" if which == "source" else ".json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(build, "write_if_different", full)
    with pytest.raises(build.BuildError, match="No space left on device.*KVFORGE_CACHE_DIR"):
        build.build(JOB, tc, tmp_path)
    nothing_trusted(tc, tmp_path)
    monkeypatch.setattr(build, "write_if_different", real)
    assert build.check_artifact(build.build(JOB, tc, tmp_path)) is None


@needs_nvcc
def test_an_arch_nvcc_lacks_names_KVFORGE_ARCH(tmp_path, monkeypatch):
    """KVFORGE_ARCH=sm_1: nvcc's own refusal, the command, and KVFORGE_ARCH to fix it."""
    monkeypatch.setenv("KVFORGE_ARCH", "sm_1")
    tc = toolchain.detect(is_rocm=False)
    with pytest.raises(build.BuildError) as e:
        build.build(JOB, tc, tmp_path)
    text = str(e.value)
    assert "Unsupported gpu architecture 'compute_1'" in text and "set KVFORGE_ARCH" in text, text
    assert "code=sm_1" in text
    nothing_trusted(tc, tmp_path)


def test_an_arch_clang_lacks_names_KVFORGE_ARCH(tmp_path):
    """The AMD check for gfx000: clang's refusal and KVFORGE_ARCH / --target to fix it."""
    try:
        tc = toolchain.amd_check("gfx000")
    except toolchain.ToolchainError as e:
        pytest.skip(f"AMD compile check unavailable: {e}")
    with pytest.raises(build.BuildError) as e:
        build.build(JOB, tc, tmp_path)
    text = str(e.value)
    assert "gfx000" in text and "set KVFORGE_ARCH" in text and "--offload-arch=gfx000" in text, text
    nothing_trusted(tc, tmp_path)


def test_a_waiter_gives_up_on_a_stuck_build_with_an_error(tmp_path, monkeypatch):
    """Another process holding the library's lock past the build timeout: a BuildError
    naming the lock, not a hang."""
    from filelock import FileLock

    tc = toolchain.Toolchain("clang-hip", "/bin/false", "22", "gfx942", "/r")
    d = JOB.directory(tc, tmp_path)
    d.mkdir(parents=True)
    monkeypatch.setenv("KVFORGE_BUILD_TIMEOUT", "0.5")
    monkeypatch.setattr(build, "LOCK_MARGIN", 0)
    held = threading.Event()
    done = threading.Event()

    def holder():
        with FileLock(str(d / "build.lock")):
            held.set()
            done.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        held.wait(10)
        with pytest.raises(build.BuildError, match="waited 0.5 s for another process's build.*build.lock"):
            build.build(JOB, tc, tmp_path)
    finally:
        done.set()
        t.join()


def test_an_interrupted_build_many_stops_its_compilers_and_leaves_nothing_trusted(tmp_path):
    """The caller interrupted while compilers run (here its progress callback raises; Ctrl-C
    alike): the exception comes at once, not after the slow compilers finish (they run in
    sessions of their own, which a terminal's Ctrl-C would not reach), pending jobs never
    start, and the libraries they were writing are not left behind."""
    variants = spec().variants[:4]
    quick = variants[0].uri
    fake = script(tmp_path / "cc", f'case "$out" in */{quick}.*) echo asm > "$out"; exit 0;; esac\n'
                                   'echo "run" >> "$0.log"; sleep 30; echo asm > "$out"\n')
    tc = toolchain.Toolchain("clang-hip", str(fake), "22", "gfx942", "/r")
    jobs = [build.Job(v.uri, source_of(v)) for v in variants]

    def interrupt(built, line):
        raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        build.build_many(jobs, tc, root=tmp_path / "cache", parallel=2, progress=interrupt)
    assert time.monotonic() - start < 15
    assert build.check_artifact(jobs[0].library(tc, tmp_path / "cache")) is None
    for job in jobs[1:]:
        lib = job.library(tc, tmp_path / "cache")
        assert not lib.exists() and not list(lib.parent.glob("*.tmp"))
    log = tmp_path / "cc.log"  # absent where the slow compilers were killed before they logged
    assert (log.read_text().count("run") if log.exists() else 0) <= 2  # the 4th never started
