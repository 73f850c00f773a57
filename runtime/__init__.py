"""kvforge runtime: toolchain, JIT build + cache, registry, dispatch and the Python API."""
from .aiter_compat import fused_qknorm_idxrqknorm, minimax_m3_qknorm_rope_cache_shuffle_insert
from .api import fused_qknorm_rope_cache
from .registry import UnlistedVariantWarning, add_variants
from .vllm_compat import fused_minimax_m3_qknorm_rope_kv_insert

__all__ = ["fused_qknorm_rope_cache", "minimax_m3_qknorm_rope_cache_shuffle_insert", "fused_qknorm_idxrqknorm",
           "fused_minimax_m3_qknorm_rope_kv_insert", "UnlistedVariantWarning", "add_variants"]
