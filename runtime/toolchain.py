"""Which compiler builds the kernels here, its version, the GPU arch and the flags.

nvcc on NVIDIA, hipcc on ROCm. Everything that changes the binary (compiler
version, arch, flags) is part of `Toolchain` and so of the build cache key.
A toolchain may build another checkout's kernel (`on_tree`: its headers and its checked-in
sources) with this runtime, for A/B runs against an older kernel (benchmarks/ab.py).
Detection takes its probes as arguments so the ROCm path is testable without ROCm.
A compiler that is missing, fails its `--version` probe or hangs in it (60 s) raises a
`ToolchainError` naming the command and what to set (PATH, CUDA_HOME, ROCM_PATH).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from kvforge.codegen.paths import INCLUDE

# Contraction off so the kernel rounds like the unfused torch path (mul, then add).
NVCC_FLAGS = ("-x", "cu", "-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC", "-shared",
              "-Werror", "all-warnings")
HIPCC_FLAGS = ("-x", "hip", "-std=c++17", "-O3", "-ffp-contract=off", "-fPIC", "-shared",
               "-Werror")
# The AMD compile check without ROCm: clang's HIP mode, device code only, to assembly
# (so tests can read the instructions), against whatever HIP headers are installed.
CLANG_HIP_FLAGS = ("-x", "hip", "--offload-device-only", "-nogpulib", "-D__AMDGCN_WAVEFRONT_SIZE=64",
                   "-std=c++17", "-O3", "-ffp-contract=off", "-S", "-Werror")
# Its host half (the launcher): checked for syntax and types only.
CLANG_HIP_HOST_FLAGS = ("-x", "hip", "--offload-host-only", "-nogpulib", "-D__AMDGCN_WAVEFRONT_SIZE=64",
                        "-std=c++17", "-fsyntax-only", "-Werror")


class ToolchainError(RuntimeError):
    pass


@dataclass(frozen=True)
class Toolchain:
    kind: str          # "nvcc" | "hipcc" | "clang-hip" (device assembly only: the AMD check)
    compiler: str      # path
    version: str       # e.g. "13.0.88"
    arch: str          # e.g. "sm_90", "gfx942"
    rocm_path: str = ""  # clang-hip: the prefix whose include/hip holds the HIP headers
    # Preprocessor definitions ("NAME=VALUE") for every kernel, e.g. KVF_ASYNC_COPY=0 to
    # run AMD's register pipeline on NVIDIA in the tests. Part of the flags, so of the key.
    defines: tuple[str, ...] = ()
    # The root of another checkout of kvforge whose kernel is built instead of this
    # package's: its include/ headers and its generated/<uri>.hip sources (registry.source_of);
    # "" = this package's. Made by `on_tree`; in the key through those headers and sources.
    tree: str = ""

    @property
    def include(self) -> Path:
        """The include directory the kernels are compiled against."""
        return Path(self.tree, "include") if self.tree else INCLUDE

    @property
    def flags(self) -> tuple[str, ...]:
        if self.kind == "nvcc":
            num = self.arch.removeprefix("sm_")
            base = NVCC_FLAGS + (f"-gencode=arch=compute_{num},code=sm_{num}",)
        elif self.kind == "clang-hip":
            base = CLANG_HIP_FLAGS + (f"--offload-arch={self.arch}", f"--rocm-path={self.rocm_path}")
        else:
            base = HIPCC_FLAGS + (f"--offload-arch={self.arch}",)
        return base + self._define_flags

    @property
    def _define_flags(self) -> tuple[str, ...]:
        return tuple(f"-D{d}" for d in self.defines)

    @property
    def output_suffix(self) -> str:
        return ".s" if self.kind == "clang-hip" else ".so"

    def command(self, source: str, output: str) -> list[str]:
        return [self.compiler, *self.flags, f"-I{self.include}", "-o", output, source]

    def host_check_command(self, source: str) -> list[str]:
        """clang-hip only: compile the host side of a source (the launcher) without output."""
        if self.kind != "clang-hip":
            raise ToolchainError(f"host_check_command is for the clang-hip check, not {self.kind}")
        return [self.compiler, *CLANG_HIP_HOST_FLAGS, f"--offload-arch={self.arch}",
                f"--rocm-path={self.rocm_path}", *self._define_flags, f"-I{self.include}", source]


PROBE_TIMEOUT = 60  # seconds a compiler's `--version` may take


def _run(cmd: list[str]) -> str:
    """A probe's stdout; a ToolchainError naming the command if it cannot run, fails or hangs."""
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, errors="replace",
                              timeout=PROBE_TIMEOUT).stdout
    except OSError as e:
        raise ToolchainError(f"cannot run {cmd[0]}: {e.strerror or e} (command: {' '.join(cmd)}); "
                             "install the compiler or fix PATH / CUDA_HOME / ROCM_PATH") from None
    except subprocess.CalledProcessError as e:
        tail = "\n".join(((e.stdout or "") + (e.stderr or "")).strip().splitlines()[-10:])
        raise ToolchainError(f"{' '.join(cmd)} exited with status {e.returncode}; is {cmd[0]} a "
                             f"working compiler?\n{tail}") from None
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"{' '.join(cmd)} did not finish within {PROBE_TIMEOUT} s; is {cmd[0]} "
                             "a working compiler?") from None


def _nvcc_version(out: str) -> str:
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    if not m:
        raise ToolchainError(f"cannot read the nvcc version from: {out.strip()[-200:]}")
    return m.group(1)


def _hipcc_version(out: str) -> str:
    m = re.search(r"HIP version: ([\w.\-]+)", out)
    if not m:
        raise ToolchainError(f"cannot read the hipcc version from: {out.strip()[-200:]}")
    return m.group(1)


def _device_arch(is_rocm: bool) -> str:
    import torch

    if not torch.cuda.is_available():
        raise ToolchainError("no GPU is visible to torch; set KVFORGE_ARCH (e.g. sm_90, gfx942) "
                             "to build without one")
    if is_rocm:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def detect(*, is_rocm: Optional[bool] = None, which: Callable[[str], Optional[str]] = shutil.which,
           run: Callable[[list[str]], str] = _run, arch: Optional[str] = None,
           env: Optional[dict] = None) -> Toolchain:
    """Find the compiler for this platform. `KVFORGE_ARCH` overrides the device's arch."""
    env = os.environ if env is None else env
    if is_rocm is None:
        import torch
        is_rocm = torch.version.hip is not None
    arch = arch or env.get("KVFORGE_ARCH") or _device_arch(is_rocm)
    if is_rocm:
        home = env.get("ROCM_PATH") or env.get("HIP_PATH") or "/opt/rocm"
        compiler = which("hipcc") or _existing(Path(home) / "bin" / "hipcc")
        if not compiler:
            raise ToolchainError(f"hipcc not found on PATH or under ROCM_PATH ({home}): install ROCm, "
                                 "or put hipcc on PATH or set ROCM_PATH")
        if not arch.startswith("gfx"):
            raise ToolchainError(f"hipcc builds for gfx targets, got arch {arch!r}")
        return Toolchain("hipcc", compiler, _hipcc_version(run([compiler, "--version"])), arch)
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH") or "/usr/local/cuda"
    compiler = which("nvcc") or _existing(Path(home) / "bin" / "nvcc")
    if not compiler:
        raise ToolchainError(f"nvcc not found on PATH or under CUDA_HOME ({home}): install the CUDA "
                             "toolkit, or put nvcc on PATH or set CUDA_HOME")
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ToolchainError(f"nvcc builds for sm_XX targets, got arch {arch!r}")
    return Toolchain("nvcc", compiler, _nvcc_version(run([compiler, "--version"])), arch)


def amd_check(arch: str, *, which: Callable[[str], Optional[str]] = shutil.which,
              run: Callable[[list[str]], str] = _run, env: Optional[dict] = None) -> Toolchain:
    """clang in HIP mode for the compile-only AMD check (no ROCm, no GPU needed).
    KVFORGE_HIP_CLANG and ROCM_PATH override the compiler and the header prefix."""
    env = os.environ if env is None else env
    if not arch.startswith("gfx"):
        raise ToolchainError(f"the AMD check builds for gfx targets, got {arch!r}")
    compiler = env.get("KVFORGE_HIP_CLANG") or which("clang++-22") or which("clang++")
    if not compiler:
        raise ToolchainError("no clang++ for the AMD check: install clang-22 (apt-get install clang-22 "
                             "libamdhip64-dev) or set KVFORGE_HIP_CLANG")
    prefixes = [env["ROCM_PATH"]] if env.get("ROCM_PATH") else ["/opt/rocm", "/usr"]
    rocm = next((p for p in prefixes if Path(p, "include", "hip", "hip_runtime.h").exists()), None)
    if rocm is None:
        raise ToolchainError(f"no HIP headers under {' or '.join(prefixes)}: install libamdhip64-dev "
                             "or set ROCM_PATH")
    m = re.search(r"clang version ([\w.\-~+]+)", run([compiler, "--version"]))
    if not m:
        raise ToolchainError(f"cannot read the version of {compiler}")
    return Toolchain("clang-hip", compiler, m.group(1), arch, rocm)


def on_tree(tc: Toolchain, root: str | Path) -> Toolchain:
    """`tc` building the kernel of another checkout of kvforge at `root` (e.g. one made by
    `git archive COMMIT | tar -x -C ROOT`): its include/ and generated/ instead of this
    package's. The runtime (argument checks, launch, ABI) stays this one's: a library of
    another ABI fails its load check (runtime/abi.py)."""
    root = Path(root).resolve()
    missing = [d for d in ("include/kvforge", "generated") if not (root / d).is_dir()]
    if missing:
        raise ToolchainError(f"{root} is no kvforge checkout: it has no "
                             f"{' or '.join(d + '/' for d in missing)} (make one with "
                             "`git archive COMMIT | tar -x -C DIR`)")
    return replace(tc, tree=str(root))


def _existing(p: Path) -> Optional[str]:
    return str(p) if p.exists() else None


@functools.lru_cache(maxsize=None)
def default(arch: Optional[str] = None) -> Toolchain:
    return detect(arch=arch)
