"""Signature (a `Variant`) → loaded kernel library, built on first use.

Variants listed in variants.yaml use their checked-in source from generated/; any
other valid signature is rendered on the fly (same template, same checks), built,
and a warning says how to list it.
"""
from __future__ import annotations

import functools
import threading
import warnings

from kvforge.codegen.model import Spec, Variant, load_spec
from kvforge.codegen.paths import GENERATED, VARIANTS_YAML
from kvforge.codegen.render import render_variant

from . import build as _build
from . import toolchain as _toolchain
from .abi import KernelLibrary


class UnlistedVariantWarning(UserWarning):
    pass


@functools.lru_cache(maxsize=1)
def spec() -> Spec:
    return load_spec(VARIANTS_YAML)


@functools.lru_cache(maxsize=1)
def listed() -> frozenset[Variant]:
    return frozenset(spec().variants)


def source_of(v: Variant) -> str:
    """The checked-in source of a listed variant, else a fresh rendering."""
    if v in listed():
        path = GENERATED / f"{v.uri}.hip"
        if path.exists():
            return path.read_text()
    return render_variant(v)


def add_hint(v: Variant) -> str:
    axes = v.axes()
    contract = axes.pop("contract")
    lines = "\n".join(f"      {k}: {val}" for k, val in axes.items())
    return (f"kvforge: variant {v.uri} is not in variants.yaml; it was rendered and built on "
            f"first use. To ship it, add a family to variants.yaml and run `python -m kvforge.codegen`:\n"
            f"  - name: <family>\n    axes:\n      contract: {contract}\n{lines}")


class Registry:
    def __init__(self) -> None:
        self._libs: dict[tuple[str, _toolchain.Toolchain], KernelLibrary] = {}
        self._lock = threading.Lock()

    def get(self, v: Variant, tc: _toolchain.Toolchain | None = None) -> KernelLibrary:
        tc = tc or _toolchain.default()
        key = (v.uri, tc)
        lib = self._libs.get(key)
        if lib is not None:
            return lib
        with self._lock:
            lib = self._libs.get(key)
            if lib is None:
                lib = self._load(v, tc)
                self._libs[key] = lib
        return lib

    @staticmethod
    def _load(v: Variant, tc: _toolchain.Toolchain) -> KernelLibrary:
        if v not in listed():
            warnings.warn(add_hint(v), UnlistedVariantWarning, stacklevel=4)
        return _build.build_and_load(_build.Job(v.uri, source_of(v)), tc, lambda path: KernelLibrary(path, v.uri))


REGISTRY = Registry()
