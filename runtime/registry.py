"""Signature (a `Variant`) → loaded kernel library, built on first use.

The variants known here are the shipped variants.yaml's plus those of the user's
variants files (KVFORGE_VARIANTS, or `add_variants`). Shipped variants use their
checked-in source from generated/; any other valid signature is rendered on the fly
(same template, same checks) and built; one no file lists also warns how to list it.
A toolchain on another checkout (`toolchain.on_tree`) builds that tree's checked-in source
of the variant instead (`source_of`), and a variant the tree lacks is refused.
A library is loaded only after its file matches the record written when it was built
(runtime/build.py: a damaged one is rebuilt with a CorruptArtifactWarning, never dlopened).
"""
from __future__ import annotations

import functools
import threading
import warnings

from pathlib import Path

from kvforge.codegen.load import lay_over, load_spec
from kvforge.codegen.model import Spec, Variant
from kvforge.codegen.paths import VARIANTS_YAML, user_variant_files
from kvforge.codegen import render

from . import build as _build
from . import toolchain as _toolchain
from .abi import KernelLibrary


class UnlistedVariantWarning(UserWarning):
    pass


class MissingSourceError(LookupError):
    """A toolchain's tree (another checkout) has no source of the variant asked for."""


def source_of(v: Variant, tc: _toolchain.Toolchain | None = None) -> str:
    """The source `tc` builds for `v`: this package's (checked in, or rendered for a variant
    generated/ lacks) or, for a toolchain on another tree, that tree's generated/<uri>.hip
    (never rendered: this package's template need not fit that tree's headers)."""
    if tc is None or not tc.tree:
        return render.source_of(v)
    path = Path(tc.tree, "generated", f"{v.uri}.hip")
    try:
        return path.read_text()
    except FileNotFoundError:
        raise MissingSourceError(f"{v.uri}: the tree {tc.tree} has no generated/{v.uri}.hip (a variant "
                                 f"that tree lacks: new since it, or not listed there)") from None


_ADDED: list[Path] = []  # add_variants() files, after KVFORGE_VARIANTS's


@functools.lru_cache(maxsize=1)
def spec() -> Spec:
    """The shipped variants.yaml with the user's variants files laid over it."""
    return load_spec(VARIANTS_YAML, *user_variant_files(), *_ADDED)


@functools.lru_cache(maxsize=1)
def listed() -> frozenset[Variant]:
    return frozenset(spec().variants)


def add_variants(path: str | Path) -> None:
    """Lay a variants file (contracts and families, as in variants.yaml) over the ones known,
    as KVFORGE_VARIANTS does at start-up. Raises SpecError, naming its lines, and then
    changes nothing."""
    lay_over(spec(), path)  # parses only the new file
    _ADDED.append(Path(path))
    spec.cache_clear()
    listed.cache_clear()


def add_hint(v: Variant) -> str:
    axes = v.axes()
    contract = axes.pop("contract")
    lines = "\n".join(f"      {k}: {val}" for k, val in axes.items())
    return (f"kvforge: variant {v.uri} is in no variants file; it was rendered and built on first "
            f"use. To list it, add a family to your variants file (KVFORGE_VARIANTS or "
            f"kvforge.add_variants) or, in a checkout, to variants.yaml (then run "
            f"`python -m kvforge.codegen`):\n"
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
        job = _build.Job(v.uri, source_of(v, tc))
        return _build.build_and_load(job, tc, lambda path: KernelLibrary(path, v.uri))


REGISTRY = Registry()
