"""ctypes mirror of include/kvforge/abi.h (checked against the library at load)."""
from __future__ import annotations

import ctypes
import re

from kvforge.codegen.paths import INCLUDE

MAX_DIMS = 8


def _header_define(name: str) -> int:
    text = (INCLUDE / "kvforge" / "abi.h").read_text()
    return int(re.search(rf"#define {name} (\d+)", text).group(1))


ABI_VERSION = _header_define("KVF_ABI_VERSION")
MAX_PIPELINE_DEPTH = _header_define("KVF_MAX_PIPELINE_DEPTH")
DEFAULT_PIPELINE_DEPTH = _header_define("KVF_DEFAULT_PIPELINE_DEPTH")
MAX_TOKENS_PER_TILE = _header_define("KVF_MAX_TOKENS_PER_TILE")
TOKENS_PER_TILE = tuple(1 << i for i in range(MAX_TOKENS_PER_TILE.bit_length()))  # the tiles a library takes
DEFAULT_TOKENS_PER_TILE = _header_define("KVF_DEFAULT_TOKENS_PER_TILE")
V_LOOP_DEFAULT = _header_define("KVF_V_LOOP_DEFAULT")
V_LOOP_OFF = _header_define("KVF_V_LOOP_OFF")
V_LOOP_ON = _header_define("KVF_V_LOOP_ON")
V_LOOP_MIN_TOKENS = _header_define("KVF_V_LOOP_MIN_TOKENS")
MAX_LANES_PER_THREAD = _header_define("KVF_MAX_LANES_PER_THREAD")
DEFAULT_LANES_PER_THREAD = _header_define("KVF_DEFAULT_LANES_PER_THREAD")


class CacheArg(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("strides", ctypes.c_int64 * MAX_DIMS)]


class Args(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("index_slot_mapping", ctypes.c_void_p),
        ("q_norm_weight", ctypes.c_void_p),
        ("k_norm_weight", ctypes.c_void_p),
        ("index_q_norm_weight", ctypes.c_void_p),
        ("index_k_norm_weight", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
        ("q_out", ctypes.c_void_p),
        ("index_q_out", ctypes.c_void_p),
        ("k_cache", CacheArg),
        ("v_cache", CacheArg),
        ("index_cache", CacheArg),
        ("qkv_row_stride", ctypes.c_int64),
        ("max_pos", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("num_index_slots", ctypes.c_int64),
        ("num_tokens", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_index_heads", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("pipeline_depth", ctypes.c_int32),
        ("tokens_per_tile", ctypes.c_int32),
        ("v_loop", ctypes.c_int32),
        ("lanes_per_thread", ctypes.c_int32),
    ]


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
