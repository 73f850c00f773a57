"""Build kernel sources into shared libraries, once, and never load a damaged one.

One library per variant, keyed like Triton's cache: hash of the source text and
every header it includes (those of the toolchain's include directory: this package's, or
another checkout's for a toolchain `on_tree`), compiler version, arch and flags. The key
names the directory, so a changed input can never load a stale binary.

Every library is installed by one function, which the JIT path (`build`) and the
ahead-of-time `python -m kvforge.codegen compile` (`build_many`: one thread per library,
`parallel` at a time; no ninja) share: take the library's file lock, re-check, run the
compiler with a timeout (KVFORGE_BUILD_TIMEOUT, default 900 s) to a temporary name of its
own, check what it wrote (not empty; a shared library's ELF headers and loaded segments lie
inside the file), rename it into place, and only then write its record `<library>.json`
(the entry it is for, size and sha256; written atomically). So N processes building one
variant run the compiler once, and no reader ever sees half a library.

A library is trusted only when its record matches it: `check_artifact` is run before a
library is returned, counted as built, or loaded (dlopen of a truncated library can kill
the process with SIGBUS, so a successful dlopen proves nothing). A library that is
truncated, corrupt, zero-filled, without a record, or whose record was written for another
entry (copied from another key's directory: another ABI, compiler or source) is rebuilt,
with a `CorruptArtifactWarning` naming the file; one that passes its check but still fails
to load (its ABI check, in runtime/abi.py) is rebuilt once by `build_and_load`.

A build that fails leaves nothing a later run trusts (no library, no record, no temporary
file) and raises a `BuildError` naming the command, the source, the compiler's last lines
and what to do (an arch the compiler lacks: KVFORGE_ARCH / --target; an unwritable or full
cache: KVFORGE_CACHE_DIR). A waiter for another process's build gives up after the timeout
and a minute. A cache that is read-only but holds verified libraries still loads.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import struct
import subprocess
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

from filelock import FileLock, Timeout

from .toolchain import Toolchain


class BuildError(RuntimeError):
    """A library could not be built: the message names the command, the file, the
    compiler's last lines and what to do."""


class CorruptArtifactWarning(UserWarning):
    """A library in the cache did not match its record (or had none) and is rebuilt."""


# Seconds one compiler run may take (KVFORGE_BUILD_TIMEOUT); a waiter for another
# process's build of the same library waits that long and a minute more.
DEFAULT_BUILD_TIMEOUT = 900.0
LOCK_MARGIN = 60.0


def cache_root() -> Path:
    env = os.environ.get("KVFORGE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvforge"


def headers(include: Path) -> dict[str, bytes]:
    """Every file under an include directory, by name relative to its parent ("include/...")."""
    return {f"include/{p.relative_to(include).as_posix()}": p.read_bytes()
            for p in sorted(include.rglob("*")) if p.is_file()}


def cache_key(source: str, tc: Toolchain) -> str:
    h = hashlib.sha256()
    h.update(source.encode())
    for name, data in sorted(headers(tc.include).items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    h.update("\0".join((tc.kind, tc.version, tc.arch, *tc.flags)).encode())
    return h.hexdigest()[:20]


@dataclass(frozen=True)
class Job:
    """One variant to build: its procedural name and its source text."""

    uri: str
    source: str

    def directory(self, tc: Toolchain, root: Path) -> Path:
        return root / tc.arch / f"{self.uri}-{cache_key(self.source, tc)}"

    def library(self, tc: Toolchain, root: Path) -> Path:
        return self.directory(tc, root) / f"{self.uri}{tc.output_suffix}"


def write_if_different(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step (a reader never sees half a file), unless equal."""
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    # A name of this thread's own: two processes, or two threads of one, may write one path.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:
        _unlink(tmp)  # a full disk leaves no partial file behind
        raise


def record_path(lib: Path) -> Path:
    """The record written beside an installed library: its size and sha256, and the entry
    (key directory and name) it was written for."""
    return lib.with_name(lib.name + ".json")


def _entry(lib: Path) -> str:
    return f"{lib.parent.name}/{lib.name}"


def _record_text(lib: Path, digest: str, size: int) -> str:
    return json.dumps({"entry": _entry(lib), "size": size, "sha256": digest}) + "\n"


def _sha256(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _record(lib: Path) -> Optional[dict]:
    try:
        data = json.loads(record_path(lib).read_text())
        return {"entry": str(data["entry"]), "size": int(data["size"]), "sha256": str(data["sha256"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_artifact(lib: Path) -> Optional[str]:
    """None if `lib` is whole (its size and sha256 are those its record, written for this
    very entry, holds), else what is wrong with it. Reads the file; never loads it."""
    try:
        size = lib.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not record_path(lib).exists():
        return f"it has no record ({record_path(lib).name})"
    want = _record(lib)
    if want is None:
        return f"its record {record_path(lib).name} is unreadable"
    if want["entry"] != _entry(lib):  # copied from another key's directory (another ABI...)
        return f"its record was written for {want['entry']}"
    if size != want["size"]:
        return f"{size} bytes where its record says {want['size']}"
    try:
        digest, _ = _sha256(lib)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if digest != want["sha256"]:
        return "its sha256 differs from its record's"
    return None


def build_timeout() -> float:
    env = os.environ.get("KVFORGE_BUILD_TIMEOUT")
    try:
        return float(env) if env else DEFAULT_BUILD_TIMEOUT
    except ValueError:
        raise BuildError(f"KVFORGE_BUILD_TIMEOUT={env!r} is not a number of seconds") from None


def _cache_error(root: Path, path: Path, e: OSError) -> BuildError:
    return BuildError(
        f"kvforge: cannot write the kernel cache at {path}: {e.strerror or e}. The cache is "
        f"KVFORGE_CACHE_DIR ({root}): set KVFORGE_CACHE_DIR to a writable directory with free "
        f"space (a read-only cache works only once every library in it is built and verified).")


def _kill(proc: subprocess.Popen) -> None:
    """The compiler and everything it started (its own session: see _run_compiler)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Compilers:
    """The compilers one build_many call runs: `stop()` kills them and starts no more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._stopped = False

    def start(self, cmd: list[str]) -> subprocess.Popen:
        with self._lock:
            if self._stopped:
                raise BuildError("kvforge: the build was interrupted")
            proc = _popen(cmd)
            self._procs.add(proc)
            return proc

    def finished(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for proc in self._procs:
                _kill(proc)


def _popen(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)


def _run_compiler(cmd: list[str], timeout: float, running: Optional[_Compilers] = None) -> tuple[int, str]:
    """(exit status, stdout and stderr together). The compiler runs in a session of its own
    so that it and everything it started are killed at `timeout` (a terminal's Ctrl-C does
    not reach it: an interrupted caller kills it, and build_many all of `running`)."""
    try:
        proc = running.start(cmd) if running is not None else _popen(cmd)
    except OSError as e:
        raise BuildError(f"kvforge: cannot run the compiler {cmd[0]}: {e.strerror or e}. Install it, or "
                         f"put it on PATH (nvcc: or under CUDA_HOME; hipcc: ROCM_PATH; the AMD check's "
                         f"clang: KVFORGE_HIP_CLANG).\n  command: {shlex.join(cmd)}") from None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something outside its group holds the pipe
            out = ""
        raise BuildError(f"kvforge: the compiler did not finish within {timeout:g} s and was killed "
                         f"(KVFORGE_BUILD_TIMEOUT raises the limit).\n  command: {shlex.join(cmd)}\n"
                         f"{_last_lines(out or '')}") from None
    except BaseException:  # interrupted: the compiler must not go on writing into the cache
        _kill(proc)
        proc.wait()
        raise
    finally:
        if running is not None:
            running.finished(proc)
    return proc.returncode, out


def _last_lines(out: str, n: int = 25) -> str:
    lines = out.rstrip().splitlines()[-n:]
    if not lines:
        return "  the compiler printed nothing"
    return f"  compiler output (last {len(lines)} lines):\n" + "\n".join("    " + line for line in lines)


_ARCH_ERROR = re.compile(r"unsupported (hip |cuda )?gpu arch|invalid (offload )?arch|invalid target id|"
                         r"unknown target|not a recognized processor", re.I)


def _hint(out: str, tc: Toolchain, root: Path) -> str:
    if _ARCH_ERROR.search(out):
        return (f"  {tc.kind} {tc.version} does not build for {tc.arch}: set KVFORGE_ARCH (or "
                f"`codegen compile --target`) to an arch it supports (e.g. "
                f"{'sm_90' if tc.kind == 'nvcc' else 'gfx942'}).")
    if re.search(r"no space left|disk quota", out, re.I):
        return (f"  the disk is full: free space, or set KVFORGE_CACHE_DIR (now {root}) to a "
                f"directory on another disk.")
    return (f"  check the compiler ({tc.compiler}), the arch ({tc.arch}: KVFORGE_ARCH or --target) "
            f"and the cache (KVFORGE_CACHE_DIR: {root}).")


def _elf_problem(path: Path) -> Optional[str]:
    """What makes `path` no whole ELF file (headers or loaded segments past its end: a
    truncated library that dlopen would map and die on), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return "no ELF header"
        if len(head) < 64 or head[4] != 2 or head[5] != 1:
            return None if len(head) == 64 else "a truncated ELF header"  # only ELF64 LE is read on
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
            return "ELF headers past the end of the file"
        f.seek(phoff)
        table = f.read(phnum * phentsize)
    for i in range(phnum):
        p_type, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1 and offset + filesz > size:  # PT_LOAD
            return "a loaded segment past the end of the file"
    return None


def _output_problem(tmp: Path, tc: Toolchain) -> Optional[str]:
    try:
        size = tmp.stat().st_size
    except FileNotFoundError:
        return "it exited 0 but wrote no output"
    if size == 0:
        return "it exited 0 but wrote an empty file"
    if tc.output_suffix == ".so":
        problem = _elf_problem(tmp)
        if problem:
            return f"it exited 0 but wrote a damaged library ({problem}, {size} bytes)"
    return None


def _unlink(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _install(job: Job, tc: Toolchain, root: Path, distrust: Optional[str] = None,
             running: Optional[_Compilers] = None) -> Path:
    """Under the library's lock: re-check it, and unless it is whole (and its sha256 is not
    `distrust`, a library that failed to load), compile, check, rename into place, record."""
    d, lib = job.directory(tc, root), job.library(tc, root)
    record = record_path(lib)
    timeout = build_timeout()
    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(d / "build.lock"))
        lock.acquire(timeout=timeout + LOCK_MARGIN)
    except Timeout:
        raise BuildError(f"kvforge: waited {timeout + LOCK_MARGIN:g} s for another process's build of {lib} "
                         f"(its lock {d / 'build.lock'}); if none is running, delete the lock file") from None
    except OSError as e:
        raise _cache_error(root, Path(e.filename or d), e) from None
    try:
        problem = check_artifact(lib)
        if problem is None:
            if distrust is None or (_record(lib) or {}).get("sha256") != distrust:
                return lib  # whole (another process may have built it while we waited)
            problem = "it did not load"
        if problem != "missing":
            warnings.warn(f"kvforge: cached kernel library {lib}: {problem}; rebuilding it",
                          CorruptArtifactWarning, stacklevel=3)
        tmp = d / f"{lib.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            # Nothing stale is trusted, nor left if the build fails; temporary files here are
            # written only under this lock, so any found now are a killed build's.
            _unlink(record, lib, *d.glob("*.tmp"))
            src = d / f"{job.uri}.hip"
            write_if_different(src, job.source)
        except OSError as e:
            raise _cache_error(root, Path(e.filename or d), e) from None
        cmd = tc.command(str(src), str(tmp))
        try:
            code, out = _run_compiler(cmd, timeout, running)
            problem = f"{tc.kind} exited with status {code}" if code else _output_problem(tmp, tc)
            if problem:
                raise BuildError(f"kvforge: building {job.uri} for {tc.arch} failed: {problem}.\n"
                                 f"  command: {shlex.join(cmd)}\n  source: {src}\n"
                                 f"{_last_lines(out)}\n{_hint(out, tc, root)}")
            digest, size = _sha256(tmp)
            os.replace(tmp, lib)
            # The record last, and atomically: a library without one is never trusted.
            write_if_different(record, _record_text(lib, digest, size))
        except BaseException as e:
            _unlink(tmp, record, lib)
            if isinstance(e, OSError):
                raise _cache_error(root, Path(e.filename or lib), e) from None
            raise
        return lib
    finally:
        lock.release()


def build(job: Job, tc: Toolchain, root: Path | None = None, force: bool = False) -> Path:
    """The library for `job`, verified against its record, built if absent or damaged (or
    if `force`, e.g. after a failed load: unless another process rebuilt it meanwhile)."""
    root = root or cache_root()
    lib = job.library(tc, root)
    if not force and check_artifact(lib) is None:
        return lib
    return _install(job, tc, root, distrust=(_record(lib) or {}).get("sha256", "") if force else None)


Loaded = TypeVar("Loaded")


def build_and_load(job: Job, tc: Toolchain, load: Callable[[str], Loaded]) -> Loaded:
    """`load` (e.g. ctypes.CDLL) of the job's library, built if absent, rebuilt if it does
    not match its record: only a verified file is ever loaded. A verified file that does not
    load (foreign, another ABI) is rebuilt once, then trusted."""
    root = cache_root()
    lib = build(job, tc, root)
    seen = (_record(lib) or {}).get("sha256", "")
    try:
        return load(str(lib))
    except OSError as e:
        warnings.warn(f"kvforge: cached kernel library {lib} did not load ({e}); rebuilding it",
                      CorruptArtifactWarning, stacklevel=2)
        _install(job, tc, root, distrust=seen)
        # Another spelling of the path: the dynamic loader answers a name it has loaded
        # (a foreign library that loaded but failed its checks) with that old handle.
        return load(os.path.join(str(lib.parent), ".", lib.name))


def build_many(jobs: list[Job], tc: Toolchain, root: Path | None = None,
               parallel: int | None = None,
               progress: Callable[[int, str], None] | None = None) -> list[Path]:
    """Ahead-of-time: every job whose library is not in the cache whole, `parallel` at a time,
    each installed as `build` does (its lock, so one compiler run however many processes
    build it); the libraries of all, every one verified. `progress(built, line)` follows
    the missing ones as they finish. Raises BuildError naming every failure, after trying all."""
    root = root or cache_root()
    libs = [job.library(tc, root) for job in jobs]
    missing = list({job: None for job, lib in zip(jobs, libs) if check_artifact(lib) is not None})
    failures = []
    if missing:
        running = _Compilers()  # killed if this call is interrupted
        pool = ThreadPoolExecutor(max_workers=max(1, parallel or os.cpu_count() or 1))
        try:
            futures = {pool.submit(_install, job, tc, root, None, running): job for job in missing}
            built = 0
            for future in as_completed(futures):
                try:
                    future.result()
                except BuildError as e:
                    failures.append(str(e))
                    continue
                built += 1
                if progress:
                    progress(built, f"{tc.kind} {tc.arch} {futures[future].uri}")
        except BaseException:  # Ctrl-C: start no more, stop those running (each cleans up)
            pool.shutdown(wait=False, cancel_futures=True)
            running.stop()
            raise
        finally:
            pool.shutdown(wait=True)
    if failures:
        raise BuildError(f"{len(failures)} of {len(missing)} kernel builds failed:\n\n" + "\n\n".join(failures))
    return libs
