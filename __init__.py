"""kvforge: generated fused QK-norm + RoPE + KV-cache insert kernels (SPEC: shared/SPEC.md).

The checkout's root is the package (pyproject maps `kvforge` onto it): `kvforge.codegen`
(variants.yaml → generated sources, no torch) and `kvforge.runtime` (build, load, dispatch,
the Python API). The API's names are re-exported here on first use, so importing the code
generator alone never imports torch.
"""
from __future__ import annotations

from typing import Any

_API = ("fused_qknorm_rope_cache", "minimax_m3_qknorm_rope_cache_shuffle_insert", "fused_qknorm_idxrqknorm",
        "fused_minimax_m3_qknorm_rope_kv_insert", "UnlistedVariantWarning", "add_variants")
__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
