"""Tuned launch choices: the main loop's pipeline depth per variant and token range.

Which depth is fastest depends on the shape: a deeper pipeline hides more memory
latency on long runs of tokens but costs registers and a longer start on short
ones. `benchmarks/tune.py` times every depth a library holds (1..KVF_MAX_PIPELINE_DEPTH)
on the GPU and writes tuning/<name>.json; the runtime only reads those files, so
nothing is tuned at run time. A device or variant without an entry gets depth 0, the
library's default.

File format: {"device": "<torch.cuda.get_device_name()>", "command": "...",
"choices": {"<variant uri>": [[max_tokens, depth], ..., [null, depth]]}}, ranges
ascending, the last one open.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from codegen.paths import TUNED

from .abi import DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH

Ranges = tuple[tuple[Optional[int], int], ...]  # ((max_tokens or None, depth), ...)


class TuningError(ValueError):
    pass


@dataclass(frozen=True)
class Table:
    device: str
    choices: dict[str, Ranges]

    def depth(self, uri: str, tokens: int) -> int:
        return pick(self.choices.get(uri, ()), tokens)


def pick(ranges: Ranges, tokens: int) -> int:
    for upto, depth in ranges:
        if upto is None or tokens <= upto:
            return depth
    return 0


def parse(data, where: str) -> Table:
    """A table from decoded JSON; errors name the file and the entry."""
    if not isinstance(data, dict) or not isinstance(data.get("device"), str):
        raise TuningError(f"{where}: expected an object with a 'device' name")
    choices = data.get("choices")
    if not isinstance(choices, dict):
        raise TuningError(f"{where}: 'choices' must map variant names to token ranges")
    out: dict[str, Ranges] = {}
    for uri, ranges in choices.items():
        if not isinstance(ranges, list) or not ranges:
            raise TuningError(f"{where}: {uri}: expected a list of [max_tokens, depth] pairs")
        parsed, last = [], 0
        for i, item in enumerate(ranges):
            ok = isinstance(item, list) and len(item) == 2
            upto, depth = item if ok else (None, None)
            open_end = upto is None and i == len(ranges) - 1
            if not ok or not (open_end or (type(upto) is int and upto > last)):
                raise TuningError(f"{where}: {uri}: range {i}: expected [max_tokens > {last}, depth] "
                                  f"(max_tokens null only in the last), got {item!r}")
            if type(depth) is not int or not 1 <= depth <= MAX_PIPELINE_DEPTH:
                raise TuningError(f"{where}: {uri}: range {i}: depth must be 1..{MAX_PIPELINE_DEPTH}, "
                                  f"got {depth!r}")
            parsed.append((upto, depth))
            last = upto if upto is not None else last
        out[uri] = tuple(parsed)
    return Table(device=data["device"], choices=out)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise TuningError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TuningError(f"{path}:{e.lineno}: not JSON: {e.msg}") from None


def load(path: Path) -> Table:
    return parse(_read(path), str(path))


@lru_cache(maxsize=None)
def table_for(device: str, root: Path = TUNED) -> Optional[Table]:
    """The tuned table for a device name (e.g. 'NVIDIA H200'), if one is stored. Only
    that device's file is parsed (a broken file for another GPU does not matter here);
    two files for one device are an error, not a silent choice."""
    found = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else ():
        data = _read(path)
        if isinstance(data, dict) and data.get("device") == device:
            found.append((path, data))
    if len(found) > 1:
        raise TuningError(f"{root}: {', '.join(p.name for p, _ in found)} all tune {device!r}; keep one")
    return parse(found[0][1], str(found[0][0])) if found else None


def depth_used(device: str, uri: str, tokens: int) -> int:
    """The depth a call of `tokens` tokens runs at on `device` (for reports)."""
    table = table_for(device)
    return (table.depth(uri, tokens) if table else 0) or DEFAULT_PIPELINE_DEPTH
