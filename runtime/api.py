"""The Python API engines call: `fused_qknorm_rope_cache`.

Argument names follow the engines' ops (SPEC §9). Cache dtypes, scale granularity
and the FP8 flavour are read from the tensors. CUDA/ROCm tensors run the generated
kernel for the derived signature; CPU tensors run the torch reference.

The op is registered as `torch.ops.kvforge.fused_qknorm_rope_cache` (with a fake
implementation) so `torch.compile(fullgraph=True)` traces through it. Eager calls
skip the dispatcher and launch directly on torch's current stream, which is also
what CUDA-graph capture records.
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import sys
import warnings
from typing import Callable, Optional

import torch

from kvforge.codegen import signature

from . import dispatch, reference, tuning
from .abi import Args, CacheArg
from .registry import REGISTRY
from .toolchain import Toolchain
from .validate import check, check_ranges

Tensor = torch.Tensor


class _Plan:
    """What one variant's launch on one device needs besides the tensors, looked up once."""

    def __init__(self, variant, device_index: int) -> None:
        from kvforge.codegen.layout import access

        self.lib = REGISTRY.get(variant)
        self.access = {role: access(variant, role) for _, role in _CACHES if getattr(variant.contract, role)}
        self.variant, self.device_index = variant, device_index

    @functools.cached_property
    def launches(self) -> tuning.Ranges:
        """Tuned, by token range. Read at the first call that needs them, so that
        launch_with (the tuner) works where no valid table is stored."""
        table = tuning.table_for(torch.cuda.get_device_name(self.device_index))
        return table.ranges_for(self.variant) if table else ()


_PLANS: dict = {}  # (variant, device index) -> _Plan

# The op's arguments but its flags, in order: what validation reads and the signature table
# keys on (codegen/signature.py).
_ARG_NAMES = signature.CALL_NAMES
# The fields of Args an argument fills: data pointers, caches (with the contract's cache each
# is), scalars; each named as the argument (and the Tensors attribute) it comes from.
_POINTERS = tuple((a.field.name, a.name) for a in signature.KERNEL_ARGS if a.field.pointer)
_CACHES = tuple((a.name, a.role) for a in signature.KERNEL_ARGS if a.field.cache)
_SCALARS = tuple(a.name for a in signature.KERNEL_ARGS if not a.field.pointer and not a.field.cache)
# The fields no argument fills (signature.DERIVED and LAUNCH), from the validated tensors and the launch.
_COMPUTED = {
    "qkv_row_stride": lambda t, launch: t.qkv.stride(0),
    **{f"{name}_row_stride": (lambda t, launch, name=name: getattr(t, name).stride(0) if getattr(t, name) is not None
                              else 0)
       for name in ("q_out", "q_fp8_out", "k_out", "index_q_out", "index_k_out")},
    "max_pos": lambda t, launch: t.cos_sin_cache.shape[0],
    "num_slots": lambda t, launch: t.slot_mapping.numel(),
    "num_index_slots": lambda t, launch: t.index_slot_mapping.numel() if t.index_slot_mapping is not None else 0,
    "num_tokens": lambda t, launch: t.qkv.shape[0],
    "pipeline_depth": lambda t, launch: launch.depth,
    "tokens_per_tile": lambda t, launch: launch.tile,
    "v_loop": lambda t, launch: launch.v_loop,
    "lanes_per_thread": lambda t, launch: launch.lanes,
    "kv_groups": lambda t, launch: launch.groups,
}


def _current_stream(device_index: int) -> int:
    # The raw handle without building a torch Stream object (a few µs per call).
    return torch._C._cuda_getCurrentRawStream(device_index)


def _cache_arg(dst, cache: Optional[Tensor], acc) -> None:
    if cache is None:
        return
    dst.data = cache.data_ptr()
    dst.capacity = acc.capacity(cache.shape)
    for i, s in enumerate(cache.stride()):
        dst.strides[i] = s


def _args(plan: _Plan, t: reference.Tensors, launch: tuning.Launch) -> Args:
    ptr = lambda x: x.data_ptr() if x is not None else None  # noqa: E731
    a = Args(**{name: getattr(t, name) for name in _SCALARS},
             **{field: compute(t, launch) for field, compute in _COMPUTED.items()})
    for field, name in _POINTERS:
        setattr(a, field, ptr(getattr(t, name)))
    for name, role in _CACHES:
        _cache_arg(getattr(a, name), getattr(t, name), plan.access.get(role))
    return a


def _launch(launch: Callable, args, device_index: int) -> None:
    """launch(args, stream) on torch's current stream of that device."""
    # The tensors are on that device, so CUDA is initialized: read the current device
    # without torch.cuda.current_device()'s lazy-init check, paid on every call.
    if device_index != torch._C._cuda_getDevice():
        with torch.cuda.device(device_index):
            launch(args, _current_stream(device_index))
    else:
        launch(args, _current_stream(device_index))


def _bind(plan: _Plan, a: Args, t: reference.Tensors, argv: tuple) -> None:
    """Remember a validated call in the signature table, unless some tensor the kernel
    gets is not one of the arguments as passed (then it is validated every time)."""
    slots = []  # (word of Args, index of the argument holding that tensor)
    for name, offset, own in _POINTER_OFFSETS:
        obj = getattr(t, name)
        if obj is not None:
            # Its own parameter first: with aliased arguments (v_scale=k_scale) the first
            # identical one would be another parameter, wrong for a later unaliased call.
            # Then any (a tensor validation derived: kv_cache's K and V, shared slots).
            i = own if argv[own] is obj else next((i for i, x in enumerate(argv) if x is obj), None)
            if i is None:
                return
            slots.append((offset // 8, i))
    dispatch.bind(argv, bytes(a), tuple(slots), plan.lib.launch_address, t.qkv.device.index,
                  plan.lib.check)


# Each data pointer: the Tensors attribute it comes from, its byte offset in Args, and
# the position of the parameter of that name.
_POINTER_OFFSETS = tuple(
    (name, getattr(Args, field).offset, _ARG_NAMES.index(name)) for field, name in _POINTERS) + tuple(
    (name, getattr(Args, name).offset + CacheArg.data.offset, _ARG_NAMES.index(name)) for name, _ in _CACHES)
assert ctypes.sizeof(Args) % 8 == 0 and all(off % 8 == 0 for _, off, _ in _POINTER_OFFSETS)


def _prepared(variant, t: reference.Tensors,
              launch: Optional[tuning.Launch] = None) -> tuple[_Plan, Args, int]:
    """The plan and Args of a call, launched as `launch` says (default: as tuned)."""
    device_index = t.qkv.device.index
    plan = _PLANS.get((variant, device_index))
    if plan is None:
        plan = _PLANS[(variant, device_index)] = _Plan(variant, device_index)
    if launch is None:
        launch = tuning.pick(plan.launches, t.qkv.shape[0])
    return plan, _args(plan, t, launch), device_index


def launch_with(launch: tuning.Launch, toolchain: Optional[Toolchain] = None, **kwargs) -> Callable[[], None]:
    """For the tuner and the tests: validate a GPU call once and return a function that
    launches it as `launch` says (pipeline depth 1..KVF_MAX_PIPELINE_DEPTH, tokens per
    tile a power of two up to KVF_MAX_TOKENS_PER_TILE, KVF_V_LOOP_*, head lanes per thread
    up to the variant's max_lanes_per_thread; 0: the default), on the current stream, with
    the variant's library as `toolchain` builds it (default: the runtime's)."""
    bad = launch.problems()
    if bad:
        raise ValueError(f"launch_with: {'; '.join(bad)}")
    if kwargs.get("q_out") is None and kwargs.get("q_fp8_out") is None:
        raise ValueError("q_out: launch_with needs the outputs allocated")
    missing = [a.name for a in signature.CALL_ARGS if a.default is signature.REQUIRED and a.name not in kwargs]
    if missing:
        raise TypeError(f"launch_with: missing {', '.join(missing)}")
    variant, t = check(**{a.name: kwargs.get(a.name, a.default) for a in signature.CALL_ARGS})
    bad = tuning.lanes_problem(variant, launch.lanes)
    if bad:
        raise ValueError(f"launch_with: {bad}")
    plan, a, device_index = _prepared(variant, t, launch)
    lib = REGISTRY.get(variant, toolchain) if toolchain else plan.lib
    return functools.partial(_launch, lib.launch, a, device_index)


def _impl(*args) -> None:
    """The op: its arguments in codegen/signature.py's order (the argument vector, then
    `checked`), as its schema (below) names them."""
    _run(args[:-1], args[-1], False)


# The schema torch.library reads: the table's arguments, typed as the op takes them.
_impl.__signature__ = inspect.Signature(
    [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a.annotation(Tensor))
     for a in signature.ARGS], return_annotation=None)


def _run(argv: tuple, checked: bool, force_reference: bool) -> None:
    # The common case: a signature validated before (no range checks asked) launches
    # without validating again (runtime/dispatch); anything new takes the full path below.
    fast = not checked and not force_reference
    if fast and dispatch.launch(argv):
        return
    variant, t = check(**dict(zip(_ARG_NAMES, argv)))
    if checked:
        check_ranges(variant, t)
    if t.qkv.shape[0] == 0:  # no token: a legal call that computes and writes nothing
        return
    if force_reference or t.qkv.device.type == "cpu":
        reference.run(variant, t)
        return
    plan, a, device_index = _prepared(variant, t)
    _launch(plan.lib.launch, a, device_index)
    if fast:
        _bind(plan, a, t, argv)


_OP = "kvforge::fused_qknorm_rope_cache"
_op = torch.library.custom_op(_OP, mutates_args=signature.MUTABLE)(_impl)


_INDUCTOR_LOWERS_STORAGE_OFFSETS = False


def _lower_storage_offsets() -> None:
    """Inductor has no lowering for aten.sym_storage_offset (pytorch/pytorch#198068, open;
    the fix is #198069): its fallback reads the offset of a tensor rebuilt without one, 0.
    When a mutated argument is a view at a symbolic offset (K and V as views of one
    [pages, 2, ...] buffer under dynamic shapes), auto-functionalization regenerates it as
    as_strided(base, ..., sym_storage_offset(view)) and the kernel writes V over K. This
    registers the lowering that fix adds (the offset read from the node's metadata), once,
    where Inductor is loaded and lacks one. Trace time only: the fake implementation calls it."""
    global _INDUCTOR_LOWERS_STORAGE_OFFSETS
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None:  # not compiling with Inductor (yet): AOT tracing runs this again
        return
    _INDUCTOR_LOWERS_STORAGE_OFFSETS = True
    try:
        if torch.ops.aten.sym_storage_offset.default in lowering.lowerings:
            return

        @lowering.register_lowering(torch.ops.aten.sym_storage_offset)
        def _sym_storage_offset(a):
            val = lowering.V.graph.current_node.meta["val"]
            return val.node.expr if isinstance(val, torch.SymInt) else int(val)
    except Exception as e:  # noqa: BLE001 - another torch's internals: warn, never break tracing
        warnings.warn(f"kvforge: could not register Inductor's lowering of aten.sym_storage_offset "
                      f"({type(e).__name__}: {e}); a cache passed as a view at a symbolic offset may be "
                      f"written at the wrong place under dynamic shapes", RuntimeWarning, stacklevel=2)


@_op.register_fake
def _fake(*args, **kwargs) -> None:
    # Nothing to compute: the op returns nothing and writes only the tensors its schema
    # marks mutable (Tensor(a!)), which auto-functionalization accounts for.
    if not _INDUCTOR_LOWERS_STORAGE_OFFSETS:
        _lower_storage_offsets()
    return None


def _reject(argv: tuple) -> None:
    """Where the outputs could not be allocated from the arguments, raise validation's error
    for the argument at fault (nothing was written). Returns if the inputs are valid (the
    allocation itself failed, e.g. out of memory: the caller re-raises that)."""
    try:
        check(**dict(zip(_ARG_NAMES, argv)), outputs=False)
    except (ValueError, TypeError) as e:
        raise e from None


def fused_qknorm_rope_cache(
    qkv: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    slot_mapping: Tensor,
    k_cache: Optional[Tensor] = None,
    v_cache: Optional[Tensor] = None,
    *,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    contract: str,
    eps: float = 1e-6,
    kv_cache: Optional[Tensor] = None,
    num_index_heads: int = 0,
    index_q_norm_weight: Optional[Tensor] = None,
    index_k_norm_weight: Optional[Tensor] = None,
    index_cache: Optional[Tensor] = None,
    index_slot_mapping: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    k_scale_cache: Optional[Tensor] = None,
    v_scale_cache: Optional[Tensor] = None,
    q_out: Optional[Tensor] = None,
    q_fp8_out: Optional[Tensor] = None,
    q_fp8_scale: Optional[Tensor] = None,
    k_out: Optional[Tensor] = None,
    index_q_out: Optional[Tensor] = None,
    index_k_out: Optional[Tensor] = None,
    index_mode: str = "full",
    norm: str = "gemma",
    rope: str = "neox",
    checked: bool = False,
    _reference: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """QK RMSNorm + partial RoPE + KV-cache and index-cache insert, in one launch.

    Returns (q_out, index_q_out); index_q_out is None unless index_mode is 'full'.
    Outputs not passed in are allocated (index_q_out in the index cache's dtype), but for
    q_out where q_fp8_out is given: then q is written as FP8 only, and q_out is None.
    Per-token FP8 scales (kv_scale per_token_head) are selected by passing the contract's
    scale caches, k_scale_cache and v_scale_cache, which the kernel writes. k_out and
    index_k_out (optional) receive the rotated K and index_k in the model dtype; any output
    may be a view whose rows are strided (a view of qkv's columns writes in place).
    `checked=True` also validates every slot and position on the host (a sync).
    """
    # No validation on this path (a call validated before launches from the signature table):
    # the outputs are allocated from the arguments as given, and where that fails, validation
    # says which argument is at fault. Either way no tensor of the caller's is written.
    try:
        if q_out is None and q_fp8_out is None:
            q_out = qkv.new_empty((qkv.shape[0], num_heads, q_norm_weight.numel()))
        if index_q_out is None and index_mode == "full" and index_cache is not None:
            index_q_out = torch.empty((qkv.shape[0], num_index_heads, q_norm_weight.numel()),
                                      dtype=index_cache.dtype, device=qkv.device)
    except Exception:  # noqa: BLE001 - whatever the malformed argument raised
        given = locals()  # the parameters are named as the op's arguments (_ARG_NAMES)
        _reject(tuple(given[name] for name in _ARG_NAMES))
        raise
    if type(eps) is not float and isinstance(eps, (int, float)) and not isinstance(eps, bool):
        eps = float(eps)  # the op's schema takes a float (validation rejects other types)
    # The op's arguments in codegen/signature.py's order (tests/test_signature.py checks it).
    args = (qkv, positions, cos_sin_cache, slot_mapping, index_slot_mapping, k_cache, v_cache, kv_cache,
            q_norm_weight, k_norm_weight, index_q_norm_weight, index_k_norm_weight, index_cache, k_scale,
            v_scale, k_scale_cache, v_scale_cache, q_out, q_fp8_out, q_fp8_scale, k_out, index_q_out, index_k_out,
            num_heads, num_kv_heads, num_index_heads, rotary_dim, eps, contract, index_mode, norm, rope, checked)
    if _reference:
        _run(args[:-1], checked, True)
    elif torch.compiler.is_compiling():
        _op(*args)
    else:
        _run(args[:-1], checked, False)
    return q_out, (index_q_out if index_mode == "full" else None)


def reference_qknorm_rope_cache(*args, **kwargs) -> tuple[Tensor, Optional[Tensor]]:
    """`fused_qknorm_rope_cache` computed by the torch reference on any device."""
    return fused_qknorm_rope_cache(*args, _reference=True, **kwargs)
