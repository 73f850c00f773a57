"""Launching a call validated before without validating it again: the signature table.

A call's signature is everything validation reads: each tensor's dtype, shape, strides,
device and data-pointer alignment, and every other argument's type and value. A call
whose signature was validated launches from that call's packed Args with only the data
pointers filled in, on the current stream, when the current device is the tensors'.

The table is C++ (`dispatch.cpp`), built once per torch and Python by torch's extension
builder (10-20 s, cached under KVFORGE_CACHE_DIR): Python needs ~1 µs per tensor argument
to read its metadata on the H200's host, most of a call's overhead. Where it cannot be
built (no host compiler or Python headers) a Python table with the same contract is
used, with a warning. KVFORGE_HOST_DISPATCH=python selects the Python table.

Neither table knows the op's arguments: runtime/api.py hands them the argument vector in
codegen/signature.py's order (CALL_NAMES) and, per data pointer, the word of Args it goes
to and the argument it comes from, both derived from that table's ABI fields. An argument
added there reaches the tables with no edit here.

Why a table of calls validated before, not one validating C entry point per library:
such an entry point would validate every call in C (a new token count, which misses the
table today and is validated in Python once, would not), but
* it cannot be plain C fed from Python: reading a tensor's metadata in Python is the
  ~1 µs per tensor this module exists to avoid, so the metadata must still be read by a
  module built against libtorch (this one), which would pass per-tensor descriptors to
  the library's check;
* linking the kernel libraries against libtorch instead would tie every library to one
  torch build (its cache key, and a rebuild of every variant per torch), add torch's
  headers to every nvcc/hipcc compile, and end the libraries' plain C ABI;
* the variant is chosen by the signature (dtypes, head dim, options, layouts), so a call
  still needs a lookup from its signature to a library: this table, less its memo;
* SPEC §7's rules would exist twice (each rule in generated C and in validate.py, which
  keeps the messages), kept equal by running both over tests/test_bad_inputs.py's rows,
  as dispatch.cpp and PythonTable are kept equal today.
What it would save per call (the table's hash of the key against a check of the same
properties) is unmeasured: no GPU host was at hand to measure either path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from .build import cache_root

SOURCE = Path(__file__).with_name("dispatch.cpp")
CAPACITY = 4096  # signatures held (shapes vary with the token count); the oldest goes first

_SCALARS = (type(None), bool, int, float, str)  # exact types; anything else is validated
# What a table calls: kvf_launch(const kvf_args_t*, void* stream) at an address.
_LAUNCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class PythonTable:
    """The table in Python: the fallback, and the C++ table's specification (the tests run
    both against the same cases). Methods as dispatch.cpp's."""

    def __init__(self) -> None:
        self._entries: dict = {}  # signature -> (template, slots, launch fn, device, on_error)
        self._get_device: Optional[Callable[[], int]] = None
        self._get_stream: Optional[Callable[[int], int]] = None
        self._capacity = 0

    def configure(self, get_device: Callable[[], int], get_stream: Callable[[int], int],
                  capacity: int) -> None:
        self._get_device, self._get_stream, self._capacity = get_device, get_stream, max(1, capacity)

    @staticmethod
    def _signature(argv: tuple) -> Optional[tuple[tuple, list]]:
        """(signature, data pointers), or None for arguments only validation judges."""
        key, ptrs = [], []
        for x in argv:
            if isinstance(x, torch.Tensor):
                try:
                    p = x.data_ptr()
                except RuntimeError:  # no data pointer (sparse, a subclass without storage)
                    return None
                key.append((x.dtype, x.shape, x.stride(), x.device, p & 15))
                ptrs.append(p)
            elif type(x) in _SCALARS:
                key.append((type(x), x))
                ptrs.append(None)
            else:
                return None
        return tuple(key), ptrs

    def bind(self, argv: tuple, template: bytes, slots: tuple, fn: int, device: int,
             on_error: Callable[[int], None]) -> bool:
        sig = self._signature(argv)
        if sig is None:
            return False
        for w, i in slots:
            if not (0 <= w < len(template) // 8 and 0 <= i < len(argv) and isinstance(argv[i], torch.Tensor)):
                raise ValueError("bind: a slot outside the template, or naming an argument that is not a tensor")
        if sig[0] not in self._entries and len(self._entries) >= self._capacity:
            self._entries.pop(next(iter(self._entries)))
        self._entries[sig[0]] = (template, tuple(slots), _LAUNCH_FN(fn), device, on_error)
        return True

    def launch(self, argv: tuple) -> bool:
        sig = self._signature(argv)
        entry = self._entries.get(sig[0]) if sig is not None else None
        if entry is None:
            return False
        template, slots, fn, device, on_error = entry
        if self._get_device() != device:
            return False
        packed = bytearray(template)
        words = memoryview(packed).cast("Q")
        for w, i in slots:
            words[w] = sig[1][i]
        code = fn(bytes(packed), self._get_stream(device))
        if code:
            on_error(code)
        return True

    def size(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def _build_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{torch.__version__}\0{torch.version.git_version}\0{sys.version}\0{sys.platform}".encode())
    return h.hexdigest()[:16]


def build_native(verbose: bool = False):
    """Build (once; a file lock guards concurrent builders) and import the C++ table."""
    from torch.utils import cpp_extension

    d = cache_root() / "host" / f"dispatch-{_build_key()}"
    d.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name="kvforge_dispatch", sources=[str(SOURCE)], build_directory=str(d),
                              extra_cflags=["-O2", "-std=c++17"], with_cuda=False, verbose=verbose)


_TABLE = None  # created by the first bind, so CPU-only use never builds it


def table():
    """The process's signature table: the C++ one unless it cannot be built or
    KVFORGE_HOST_DISPATCH=python."""
    global _TABLE
    if _TABLE is None:
        t = None
        if os.environ.get("KVFORGE_HOST_DISPATCH", "native") != "python":
            try:
                t = build_native()
            except Exception as e:  # noqa: BLE001 - any build or import failure falls back
                warnings.warn(f"kvforge: the C++ dispatch table could not be built ({type(e).__name__}: "
                              f"{str(e)[:500]}); using the Python one (~10 µs more per call). "
                              f"KVFORGE_HOST_DISPATCH=python silences this.", RuntimeWarning, stacklevel=3)
        t = t or PythonTable()
        # The current device and stream as torch's raw builtins: the bound tensors are on a
        # GPU, so CUDA is initialized and torch.cuda's per-call lazy-init checks are not needed.
        t.configure(torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream, CAPACITY)
        _TABLE = t
    return _TABLE


def launch(argv: tuple) -> bool:
    """Launch `argv` if its signature was bound; False if not (validate it, then `bind`)."""
    return _TABLE is not None and _TABLE.launch(argv)


def bind(argv: tuple, template: bytes, slots: tuple, fn: int, device: int,
         on_error: Callable[[int], None]) -> None:
    """Remember a validated call: its packed Args, where each data pointer goes (word,
    argument index), the launch function's address, its device, and what raises for
    a launch's error code."""
    table().bind(argv, template, slots, fn, device, on_error)
