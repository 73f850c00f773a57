"""Variants files → a checked Spec: parsed first (model), then every variant of a file's
new contracts proven against its layouts (layout). The one way in for the CLI, the
registry and the tests; model never imports layout."""
from __future__ import annotations

from pathlib import Path

from .layout import check_variant
from .model import Spec, SpecError, parse_unchecked

__all__ = ["lay_over", "load_spec", "parse_spec"]


def parse_spec(text: str, filename: str = "variants.yaml", base: Spec | None = None) -> Spec:
    """Parse one variants file (with `base`, as an overlay over it) and prove the layouts of
    the contracts it defines at the sizes of every variant that uses them."""
    spec = parse_unchecked(text, filename, base)
    new = set(spec.contracts) - set(base.contracts if base else ())
    errors: list[str] = []
    for v in spec.variants:
        if v.contract.name not in new:
            continue  # the base file's contracts were proven with its own variants
        for role, message in check_variant(v):
            line = f"{filename}:{v.contract.line}: contracts.{v.contract.name}.caches.{role}: {message}"
            if not any(e.startswith(line) for e in errors):
                errors.append(f"{line} (in variant {v.uri})")
    if errors:
        raise SpecError(errors)
    return spec


def load_spec(path: str | Path, *overlays: str | Path) -> Spec:
    """The shipped variants file (`path`), then each overlay laid over it in order. Errors
    name the shipped file by its base name and an overlay by the path as given."""
    path = Path(path)
    return lay_over(parse_spec(path.read_text(encoding="utf-8"), path.name), *overlays)


def lay_over(spec: Spec, *overlays: str | Path) -> Spec:
    """`spec` with each overlay file laid over it in order (only the overlays are parsed)."""
    for overlay in overlays:
        try:
            text = Path(overlay).read_text(encoding="utf-8")
        except OSError as e:
            raise SpecError([f"{overlay}: cannot read the variants file ({e.strerror})"]) from None
        spec = parse_spec(text, str(overlay), base=spec)
    return spec
