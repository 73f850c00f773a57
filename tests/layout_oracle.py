"""A cache read back through its contract's index expressions, as the variants files
spell them, evaluated by Python's own expression parser (`ast`): independent of the
generator's grammar, folding and emitter, so a new contract in YAML is checked by the same
tests as the shipped ones without a hand-written formula."""
import ast
import functools
import operator

import torch
import yaml

from kvforge.codegen.paths import VARIANTS_YAML, user_variant_files

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _eval(node, env):
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    raise ValueError(f"not an index expression: {ast.dump(node)}")


@functools.lru_cache(maxsize=None)
def contract_yaml(name):
    """The contract's mapping as written in the last variants file that defines it."""
    found = None
    for path in (VARIANTS_YAML, *user_variant_files()):
        # BaseLoader: every scalar a string (YAML 1.1 would read the index symbol `off` as false)
        found = (yaml.load(path.read_text(), Loader=yaml.BaseLoader).get("contracts") or {}).get(name, found)
    if found is None:
        raise KeyError(name)
    return found


def read(contract, role, cache, slot, num_kv_heads, head_dim, page_size=None):
    """[heads, D] stored for `slot` (heads = kv heads; 1 for the index cache; D = 1 for a
    scale cache) at the cache's page size (default: the contract's)."""
    spec = contract_yaml(contract)["caches"][role]
    ps = page_size or int(spec.get("page_size") or contract_yaml(contract)["caches"]["k"]["page_size"])
    heads = 1 if role == "index" else num_kv_heads
    head_dim = 1 if role.endswith("_scale") else head_dim
    env = {"page": slot // ps, "off": slot % ps, "slot": slot, "h": torch.arange(heads).view(-1, 1),
           "d": torch.arange(head_dim).view(1, -1), "D": head_dim, "nkv": num_kv_heads,
           "x": 16 // cache.element_size(), "page_size": ps}
    index = [torch.as_tensor(_eval(ast.parse(str(e), mode="eval"), env)).expand(heads, head_dim)
             for e in spec["index"]]
    return cache[tuple(index)]
