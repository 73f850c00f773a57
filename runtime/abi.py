"""ctypes mirror of include/kvforge/abi.h, built from the table both come from
(codegen/signature.py); the loader checks the library's ABI version."""
from __future__ import annotations

import ctypes

from kvforge.codegen import signature

_DEFINES = {d.name: d.value for d in signature.DEFINES}


def _powers_of_two_upto(most: int) -> tuple[int, ...]:
    """1, 2, 4 .. most (a power of two): the values kvf_launch takes for such a field."""
    return tuple(1 << i for i in range(most.bit_length()))


ABI_VERSION = _DEFINES["KVF_ABI_VERSION"]
LAUNCH_ABI = signature.LAUNCH_ABI  # what a tuned table names (runtime/tuning.py)
MAX_PIPELINE_DEPTH = _DEFINES["KVF_MAX_PIPELINE_DEPTH"]
DEFAULT_PIPELINE_DEPTH = _DEFINES["KVF_DEFAULT_PIPELINE_DEPTH"]
MAX_TOKENS_PER_TILE = _DEFINES["KVF_MAX_TOKENS_PER_TILE"]
TOKENS_PER_TILE = _powers_of_two_upto(MAX_TOKENS_PER_TILE)  # the tiles a library takes
DEFAULT_TOKENS_PER_TILE = _DEFINES["KVF_DEFAULT_TOKENS_PER_TILE"]
V_LOOP_DEFAULT = _DEFINES["KVF_V_LOOP_DEFAULT"]
V_LOOP_OFF = _DEFINES["KVF_V_LOOP_OFF"]
V_LOOP_ON = _DEFINES["KVF_V_LOOP_ON"]
V_LOOP_MIN_TOKENS = _DEFINES["KVF_V_LOOP_MIN_TOKENS"]
MAX_LANES_PER_THREAD = _DEFINES["KVF_MAX_LANES_PER_THREAD"]
DEFAULT_LANES_PER_THREAD = _DEFINES["KVF_DEFAULT_LANES_PER_THREAD"]
MAX_KV_GROUPS = _DEFINES["KVF_MAX_KV_GROUPS"]
KV_GROUPS = _powers_of_two_upto(MAX_KV_GROUPS)  # the group counts a library takes
DEFAULT_KV_GROUPS = _DEFINES["KVF_DEFAULT_KV_GROUPS"]

_SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def _ctype(f: signature.CField):
    """The ctypes type of a field: every pointer is a c_void_p (an address is all Python sets)."""
    if f.pointer:
        return ctypes.c_void_p
    if f.cache:
        return CacheArg
    base, _, extent = f.ctype.partition("[")
    return _SCALARS[base] * _DEFINES[extent.rstrip("]")] if extent else _SCALARS[base]


class CacheArg(ctypes.Structure):
    _fields_ = [(f.name, _ctype(f)) for f in signature.CACHE_FIELDS]


class Args(ctypes.Structure):
    _fields_ = [(f.name, _ctype(f)) for f in signature.args_fields()]


class KernelLibrary:
    """A loaded variant library: `launch(args, stream)` raises on a launch error."""

    def __init__(self, path: str, uri: str):
        self.path = path
        # The registry loads only a file that matched its build record (build.check_artifact):
        # dlopen of a truncated library can kill the process (SIGBUS) instead of raising.
        # OSError here (a foreign library, another ABI) makes build_and_load rebuild it once.
        self.lib = ctypes.CDLL(path)
        self.lib.kvf_abi_version.restype = ctypes.c_int
        self.lib.kvf_variant.restype = ctypes.c_char_p
        self.lib.kvf_error_string.restype = ctypes.c_char_p
        self.lib.kvf_error_string.argtypes = [ctypes.c_int]
        self._launch = self.lib.kvf_launch
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p]
        version = self.lib.kvf_abi_version()
        if version != ABI_VERSION:
            raise OSError(f"{path}: ABI version {version}, expected {ABI_VERSION}")
        got = self.lib.kvf_variant().decode()
        if got != uri:
            raise OSError(f"{path}: holds variant {got}, expected {uri}")
        self.uri = uri

    @property
    def launch_address(self) -> int:
        """The address of `kvf_launch(const kvf_args_t*, void* stream)`, for runtime/dispatch."""
        return ctypes.cast(self.lib.kvf_launch, ctypes.c_void_p).value

    def launch(self, args: Args, stream: int) -> None:
        self.check(self._launch(ctypes.byref(args), stream))

    def check(self, code: int) -> None:
        """Raise for a launch's nonzero return code."""
        if code != 0:
            raise RuntimeError(f"kvforge kernel {self.uri} failed to launch: "
                               f"{self.lib.kvf_error_string(code).decode()} ({code})")
