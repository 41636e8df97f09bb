"""The house plan holds: imports run one way, no cycles, small modules with a docstring each.

Layers (a module may import its own package and any lower layer, never a higher one or a
sibling package of its own layer):

    0  errors, _startup           (_startup: process settings made before torch is imported)
    1  dtypes, hardware, fields, procs, seeds, signals
    2  ops                        kernels behind the switch
    3  model                      one model definition on the kernels
    4  engine                     the rollout engine and the model-level Decoder
    5  config, envs, metrics, invariance
    6  rl                         learner, rollout worker, controller
    7  apps                       the applications (one module per command)
    8  cli                        parser and dispatch
    9  __main__                   `python -m parity`
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "parity"
LAYERS = {"errors": 0, "_startup": 0, "dtypes": 1, "hardware": 1, "fields": 1, "procs": 1, "seeds": 1,
          "signals": 1, "ops": 2, "model": 3, "engine": 4, "config": 5, "envs": 5, "metrics": 5,
          "invariance": 5, "rl": 6, "apps": 7, "cli": 8, "__main__": 9}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every `parity.*` module `name` imports, at the top or inside a function."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("parity")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("parity"):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names}
    known = modules()
    return {m for m in found if m in known and m != name}


def area(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def graph() -> dict[str, set[str]]:
    return {name: imports(name, path) for name, path in modules().items()}


def test_every_module_is_small_and_says_what_it_is_for():
    for name, path in modules().items():
        source = path.read_text()
        assert len(source.splitlines()) <= MAX_LINES, f"{name}: {len(source.splitlines())} lines"
        assert ast.get_docstring(ast.parse(source)), f"{name}: no module docstring"


def test_imports_run_one_way():
    bad = []
    for name, targets in graph().items():
        src = area(name)
        if src is None:  # the package facade (parity/__init__) re-exports the public API
            continue
        for target in targets:
            dst = area(target)
            if dst is None or dst == src:
                continue
            if LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{name} -> {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_library_module_imports_an_application():
    bad = [f"{n} -> {t}" for n, ts in graph().items() if area(n) not in ("apps", "cli", "__main__")
           for t in ts if area(t) in ("apps", "cli", "__main__")]
    assert not bad, bad


def test_environments_are_pure():
    """Environments know nothing of the model, the engine or training (the field rules they share
    with the config, parity/fields.py, and the process test of parity/procs.py are neither)."""
    bad = [f"{n} -> {t}" for n, ts in graph().items() if area(n) == "envs"
           for t in ts if area(t) not in ("envs", "errors", "fields", "procs")]
    assert not bad, bad


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in g[node]:
            if nxt == "parity" or nxt.startswith(node + "."):  # a package importing its own modules
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt])
                                     if nxt in path else f"import cycle through {nxt}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in g:
        if name not in state:
            visit(name, [name])


def test_the_layer_table_covers_every_area():
    assert {area(n) for n in modules()} - {None} <= set(LAYERS)


def test_one_kv_allocator_and_one_driver():
    """KV-cache blocks are handed out by engine/block_manager.py only, and the cache storage is
    created by engine/model_runner.py only (the engine and the Decoder both go through them)."""
    for name, path in modules().items():
        text = path.read_text()
        if name != "parity.engine.block_manager":
            assert "class BlockManager" not in text and "Allocator" not in text, name
        if name not in ("parity.engine.model_runner", "parity.model.kv_cache", "parity.model"):
            assert "KVCache(" not in text, f"{name} builds its own KV cache"


def test_backend_names_and_dtypes_are_written_once():
    for name, path in modules().items():
        text = path.read_text()
        if name != "parity.ops":
            assert '("aligned", "standard")' not in text, f"{name}: use parity.ops.BACKENDS"
        if name != "parity.dtypes":
            assert '"bfloat16": torch.bfloat16' not in text, f"{name}: use parity.dtypes"
            assert "getattr(torch, " not in text, f"{name}: use parity.dtypes.dtype_from_name"


def test_every_file_the_native_kernels_build_from_ships_with_the_package():
    """A wheel holds what `ops/native.py` compiles: a header missing from package-data left a plain
    `pip install .` on the pure-PyTorch fallback, silently slow."""
    import fnmatch
    import tomllib

    from parity.ops import native

    data = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["parity.ops"]
    needed = [p.relative_to(PACKAGE / "ops").as_posix() for p in native._SOURCES + native._HEADERS]
    assert needed and all(p.is_file() for p in native._SOURCES + native._HEADERS)
    missing = [n for n in needed if not any(fnmatch.fnmatch(n, g) for g in globs)]
    assert not missing, f"not in pyproject's package-data: {missing}"
    present = sorted(p.relative_to(PACKAGE / "ops").as_posix() for p in (PACKAGE / "ops" / "csrc").iterdir())
    assert sorted(needed) == present, "a file in csrc/ that native.py neither compiles nor hashes"
