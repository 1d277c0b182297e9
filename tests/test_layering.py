"""Lower layers never import upper ones (DESIGN.md's layering rule), checked on the source.

``memory`` knows nothing of the tree; ``cache`` nothing of models; the scheduler never
imports the model; nothing below the engine imports it; the HTTP server, the frontend
language, the router and the benchmarks sit on top (the server and the router never import
each other). Function-level imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import radixserve

# Higher number = higher layer. A module may import its own layer's package and lower layers.
RANKS = {
    "sampling_params": 0, "config": 0, "chat_template": 0, "grammar": 0, "images": 0,
    "tenancy": 0, "config_rules": 0, "config_help": 0, "flags": 0, "http_serve": 0,
    "memory": 1, "storage": 1, "kernels": 1,
    "cache": 2, "model": 2,
    "request": 3, "parallel": 3,
    "sched": 4, "kv_events": 4,
    "engine": 5, "placement": 5, "protocol": 5,
    "server": 6, "lang": 6, "bench": 6, "router": 6,
    "cli": 7, "__init__": 7, "__main__": 7,
}
# Same-layer imports across packages that are part of the design.
# The server and the router share placement (``placement``) and the request models (``protocol``)
# from below: neither imports the other.
# A request's grammar (``grammar.spec``, plain data) is one of its sampling parameters.
# The kernel layer packs weights on the huge pages the KV pool is allocated on (``memory.kv_pool``).
# Storage objects hold KV rows in the pool's format (``memory.quant``: a quantized row carries
# its scale).
# The server's configured chat template is checked (read, parsed) with the config.
# The config's dataclasses take their option names, rules and help texts from their own modules.
ALLOWED = {("kernels", "memory"), ("bench", "server"), ("__main__", "cli"), ("cli", "__init__"),
           ("storage", "memory"), ("sampling_params", "grammar"), ("config", "chat_template"),
           ("config", "config_rules"), ("config", "config_help")}

ROOT = Path(radixserve.__file__).parent


def _top(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "radixserve":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, package: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
    return out


def test_no_upward_imports() -> None:
    violations = []
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 30
    for path in files:
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        src = _top(module if path.name != "__init__.py" else module + ".__init__")
        if path.name == "__init__.py" and path.parent == ROOT:
            src = "__init__"
        assert src in RANKS, f"{module}: give its package a layer in RANKS"
        for imp in _imports(path, package):
            dst = _top(imp)
            if dst is None or dst == src:
                continue
            assert dst in RANKS, f"{module} imports {imp}: unknown package"
            if RANKS[dst] > RANKS[src] or (RANKS[dst] == RANKS[src] and (src, dst) not in ALLOWED):
                violations.append(f"{module} ({src}) imports {imp} ({dst})")
    assert not violations, "\n".join(violations)
