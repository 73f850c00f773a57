"""kvforge runtime: toolchain, JIT build + cache, registry, dispatch and the Python API."""
from .aiter_compat import minimax_m3_qknorm_rope_cache_shuffle_insert
from .api import fused_qknorm_rope_cache
from .registry import UnlistedVariantWarning, add_variants

__all__ = ["fused_qknorm_rope_cache", "minimax_m3_qknorm_rope_cache_shuffle_insert",
           "UnlistedVariantWarning", "add_variants"]
