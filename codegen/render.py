"""Spec objects → HIP sources in generated/, deterministically.

Each variant renders to `generated/<uri>.hip`; `generated/manifest.json` lists them.
Files are written only when their bytes change, and sources no variant produces any
more are removed (only `*.hip` files, never the directory). The banner carries the
generator version and a hash of exactly the inputs of that file (template, kernel
headers, the variant and its contract), so unrelated YAML edits leave it untouched.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2

from . import __version__
from . import lanes
from .layout import access
from .model import DType, Fp8, IndexMode, KvScale, Norm, QFp8, Rope, Saturation, Spec, Variant
from .paths import GENERATED, INCLUDE, TEMPLATES

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
_TEMPLATE = "variant.hip.j2"
_DTYPE = {DType.BF16: "BF16", DType.FP16: "FP16", DType.FP32: "F32"}
_INDEX_MODE = {IndexMode.FULL: "Full", IndexMode.SKIP: "Skip", IndexMode.NONE: "None"}
_SCALE = {KvScale.UNIT: "Unit", KvScale.PER_TENSOR: "PerTensor", KvScale.PER_HEAD: "PerHead",
          KvScale.PER_TOKEN_HEAD: "PerTokenHead"}
_STRUCT = {"k": "K", "v": "V", "index": "Index", "k_scale": "KScale", "v_scale": "VScale"}
_FP8 = {Fp8.E4M3FN: "E4M3FN", Fp8.E4M3FNUZ: "E4M3FNUZ"}
_ROPE = {Rope.NEOX: "NeoxRope", Rope.GPTJ: "GptjRope"}
_PARAMS = (("c", "const kvf_cache_t& c"), ("page", "int64_t page"), ("off", "uint32_t off"),
           ("h", "uint32_t h"), ("d", "uint32_t d"))


def _quant(v: Variant, fp8: bool, scale: KvScale, saturate: bool) -> str:
    """The Quant policy of a store: the model dtype, or FP8 at the scale."""
    model = f"kvf::{_DTYPE[v.dtype]}"
    if not fp8:
        return f"kvf::AsModel<{model}>"
    sat = "true" if saturate else "false"
    return f"kvf::AsFp8<{model}, kvf::Fp8::{_FP8[v.fp8]}, kvf::Scale::{_SCALE[scale]}, {sat}>"


def kernel_sources() -> dict[str, bytes]:
    """The template and headers every generated file depends on, by relative name."""
    files = {f"templates/{_TEMPLATE}": (TEMPLATES / _TEMPLATE).read_bytes()}
    for p in sorted(INCLUDE.rglob("*")):
        if p.is_file():
            files[p.relative_to(INCLUDE.parent).as_posix()] = p.read_bytes()
    return files


def _describe(v: Variant) -> str:
    """Canonical text of everything the variant's source depends on in the YAML."""
    c = v.contract
    caches = {cc.role: {"tensor": cc.tensor, "page_size": v.page_size(cc.role),
                        "shape": [str(e) for e in cc.shape], "index": [str(e) for e in cc.index],
                        "free": list(cc.free)}
              for cc in v.caches()}
    return json.dumps({"axes": v.axes(), "engine": c.engine, "saturation": c.saturation.value,
                       "round_before_quant": c.round_before_quant, "caches": caches},
                      sort_keys=True)


def input_hash(v: Variant) -> str:
    h = hashlib.sha256()
    h.update(__version__.encode())
    for name, data in sorted(kernel_sources().items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    h.update(_describe(v).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class _CacheView:
    role: str
    struct: str
    tensor: str
    shape: str
    index: str
    params: str
    offset: str
    access: object


def render_variant(v: Variant) -> str:
    caches = []
    for cache in v.caches():
        role, struct = cache.role, _STRUCT[cache.role]
        acc = access(v, role)
        used = acc.offset.symbols() | ({"c"} if acc.free else set())
        params = ", ".join(decl if name in used else decl.rsplit(" ", 1)[0] for name, decl in _PARAMS)
        caches.append(_CacheView(role=role, struct=struct, tensor=cache.tensor,
                                 shape=", ".join(str(e) for e in cache.shape),
                                 index=", ".join(str(e) for e in cache.index),
                                 params=params, offset=acc.offset_cpp(), access=acc))
    return _ENV.get_template(_TEMPLATE).render(
        version=__version__, input_hash=input_hash(v), uri=v.uri, v=v, contract=v.contract,
        axes=v.axes(), model=_DTYPE[v.dtype], cos_sin=_DTYPE[v.cos_sin],
        gemma=v.norm is Norm.GEMMA, rope=_ROPE[v.rope], index_mode=_INDEX_MODE[v.index_mode],
        kv_quant=_quant(v, v.kv_fp8, v.kv_scale, v.contract.saturation is Saturation.SATURATE),
        index_quant=_quant(v, v.index_fp8, KvScale.UNIT, True),  # SPEC §1: unit scale, saturating
        q_quant=_quant(v, v.q_fp8 is not QFp8.NONE, KvScale.PER_TENSOR, True),  # SPEC §1: saturating
        lanes=lanes.lane_map_of(v), caches=caches)


def source_of(v: Variant) -> str:
    """The checked-in source of a shipped variant, else a fresh rendering (a variant of a
    user's variants file, or one no file lists). A contract name is never redefined by an
    overlay, so a variant's name alone says whether generated/ holds its source."""
    path = GENERATED / f"{v.uri}.hip"
    return path.read_text() if path.exists() else render_variant(v)


def manifest(spec: Spec) -> str:
    entries = [{"uri": v.uri, "axes": v.axes(), "input_hash": input_hash(v)} for v in spec.variants]
    families = {f.name: [v.uri for v in f.variants] for f in spec.families}
    return json.dumps({"generator": __version__, "variants": entries, "families": families},
                      indent=1, sort_keys=True) + "\n"


@dataclass
class Report:
    written: list[str]
    unchanged: list[str]
    removed: list[str]

    @property
    def stale(self) -> list[str]:
        return self.written + self.removed


def expected_files(spec: Spec) -> dict[str, str]:
    files = {f"{v.uri}.hip": render_variant(v) for v in spec.variants}
    files["manifest.json"] = manifest(spec)
    return files


def generate(spec: Spec, out_dir: Path = GENERATED, dry_run: bool = False) -> Report:
    """Bring out_dir in line with the spec; with dry_run only report what would change."""
    files = expected_files(spec)
    report = Report([], [], [])
    if not dry_run:
        out_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(files):
        path = out_dir / name
        data = files[name].encode()
        if path.exists() and path.read_bytes() == data:
            report.unchanged.append(name)
            continue
        report.written.append(name)
        if not dry_run:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
    if out_dir.exists():
        for path in sorted(out_dir.glob("*.hip")):
            if path.name not in files:
                report.removed.append(path.name)
                if not dry_run:
                    path.unlink()
    return report
