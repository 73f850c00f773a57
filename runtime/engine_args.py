"""What the drop-ins share (runtime/aiter_compat.py, runtime/vllm_compat.py): the engines'
arguments mapped onto the native call's rules (FP8 caches given as raw uint8, index vectors
longer than the call, a missing FP8 scale, an index cache addressed flat), qkv's head
columns as outputs written in place, and the scratch caches a call without a KV cache runs
on."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .registry import spec
from .validate import _dt, _given

Tensor = torch.Tensor
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def platform_fp8(device: torch.device) -> torch.dtype:
    if torch.version.hip is not None and device.type == "cuda":
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if arch.startswith("gfx94"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def as_fp8(name: str, t: Optional[Tensor], kv_cache_dtype: str) -> Optional[Tensor]:
    if not isinstance(t, Tensor) or not kv_cache_dtype.startswith("fp8"):
        return t  # None and non-tensors: the native call names them
    if t.dtype == torch.uint8:
        return t.view(platform_fp8(t.device))
    if t.dtype not in FP8:
        raise TypeError(f"{name}: expected dtype float8_e4m3fn, float8_e4m3fnuz or uint8 (kv_cache_dtype="
                        f"{kv_cache_dtype!r}), got {_dt(t.dtype)}")
    return t


def one_of(name: str, value, choices: tuple[str, ...]) -> str:
    """A string argument that must be one of an engine's names (kv_cache_dtype)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {', '.join(map(repr, choices))} (a str), got {_given(value)}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def first_n(t, n: Optional[int]):
    """The engines read the first num_tokens entries of a longer index vector."""
    if n is not None and isinstance(t, Tensor) and t.dim() == 1 and t.shape[0] > n:
        return t[:n]
    return t


@functools.cache
def _identity(device: torch.device) -> Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)  # fp32 [1]: the identity scale


def scale_or_identity(t, kv_cache_dtype: str, cache):
    """No scale with kv_cache_dtype 'auto'; a missing or empty one is the identity (AITER's
    rule; vLLM's op passes none, at its unit scale)."""
    if kv_cache_dtype == "auto":
        return None
    if (t is None or (isinstance(t, Tensor) and t.numel() == 0)) and isinstance(cache, Tensor):
        return _identity(cache.device)
    return t


def index_cache_at(t, contract: str):
    """The index cache at a page size the contract allows: as given where its size(1) is one,
    else (contiguous: the engines address it flat, row `slot` of [-1, D]) viewed as
    [-1, P, D], P the contract's default page size or else the largest it allows that
    divides the rows. Anything else goes as given, for the native call to name."""
    cache = spec().contracts[contract].index
    if not isinstance(t, Tensor) or t.dim() < 2 or (t.dim() == 3 and t.shape[1] in cache.page_sizes):
        return t
    if not t.is_contiguous() or t.numel() == 0:
        return t
    rows = t.numel() // t.shape[-1]
    fits = [p for p in cache.page_sizes if rows % p == 0]
    if not fits:
        return t
    p = cache.page_size if cache.page_size in fits else max(fits)
    return t.view(rows // p, p, t.shape[-1])


# Calls without a KV cache (AITER's non-insert mode, vLLM's op without kv_cache) and AITER's
# second launch (a model-dtype index_q_out beside an FP8 index cache) run the native op on
# SHUFFLE caches that no slot addresses: the seed contract, whose variants are prebuilt.
SCRATCH = "vllm_shuffle16"


def is_fp8(t) -> bool:
    return isinstance(t, Tensor) and t.dtype in FP8


@functools.cache
def _scratch_kv(device: torch.device, dtype: torch.dtype, nkv: int, D: int) -> tuple[Tensor, Tensor]:
    x = 16 // dtype.itemsize
    return (torch.zeros(1, nkv, D // x, 16, x, dtype=dtype, device=device),
            torch.zeros(1, nkv, 16 // x, D, x, dtype=dtype, device=device))


@functools.cache
def _scratch_index(device: torch.device, dtype: torch.dtype, D: int) -> Tensor:
    return torch.zeros(1, spec().contracts[SCRATCH].index.page_size, D, dtype=dtype, device=device)


@functools.cache
def _no_slots(device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def scratch_caches(device: torch.device, dtype: torch.dtype, index_dtype: torch.dtype, nkv: int, D: int):
    """One page of K and V (model dtype) and of the index cache (index_dtype) in SCRATCH's
    layout, and an empty slot mapping: a call with them writes no cache (each made once per
    device and shape)."""
    k, v = _scratch_kv(device, dtype, nkv, D)
    return k, v, _scratch_index(device, index_dtype, D), _no_slots(device)


def head_columns(qkv, start: int, count: int, D: int):
    """qkv's columns of `count` heads from head `start` (a strided view: written in place)."""
    if not isinstance(qkv, Tensor) or qkv.dim() != 2:
        return None  # the native call names qkv
    return qkv[:, start * D:(start + count) * D]
