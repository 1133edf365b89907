"""The package layout is a rule, not a hope: every import runs down the layers, and only commands use click.

The layers, lowest first (consulrun/__init__.py says what each owns):
the foundation modules (`errors`, `records`, `timefmt`), `consul`, `manifest`,
`protocol`, `report`, `units`, `commands`, and the entry points (`cli`,
`entry`, `manpage`). A module may import its own package and any lower layer,
never a higher one; imports inside functions and under TYPE_CHECKING count
too, since each is an arrow a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "consulrun"
FOUNDATION = {"errors", "records", "timefmt"}
LAYERS = ["consul", "manifest", "protocol", "report", "units", "commands"]
ENTRY = {"cli", "entry", "manpage", "__main__"}
NO_CLICK = {"consul", "manifest", "protocol", "report", "units"}
MODULE_LINES_AT_MOST = 400


def _layer(module: str) -> int:
    """Rank of a dotted module name under consulrun: foundation 0, the packages 1..6, entry points 7."""
    parts = module.split(".")
    if parts == ["consulrun"] or parts[1] in FOUNDATION:
        return 0
    if parts[1] in ENTRY:
        return len(LAYERS) + 1
    return LAYERS.index(parts[1]) + 1


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        found.append((".".join(parts), path))
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it stands; `from pkg import mod` names pkg.mod."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module.startswith("consulrun"):
                base = node.module
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists():
                        out.append((node.lineno, candidate))
    return out


def test_every_module_belongs_to_a_layer() -> None:
    for module, path in _modules():
        if module == "consulrun":
            continue
        top = module.split(".")[1]
        assert top in FOUNDATION | ENTRY | set(LAYERS), f"{path}: not in any layer; add it to one (tests/test_layout.py)"


def test_imports_run_down_the_layers() -> None:
    upward = []
    for module, path in _modules():
        own = _layer(module)
        for line, imported in _imports(path):
            if imported.split(".")[0] != "consulrun" or imported == "consulrun":
                continue
            if _layer(imported) > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {imported}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_consul_package_imports_nothing_of_ours_but_the_foundation() -> None:
    wrong = [f"{path.name}:{line}: {imported}" for module, path in _modules() if module.startswith("consulrun.consul")
             for line, imported in _imports(path)
             if imported.startswith("consulrun.") and _layer(imported) != 0 and not imported.startswith("consulrun.consul")]
    assert not wrong, wrong


@pytest.mark.parametrize("package", sorted(NO_CLICK))
def test_only_commands_and_entry_points_use_click(package: str) -> None:
    users = [f"{path.relative_to(PACKAGE.parent)}:{line}" for module, path in _modules()
             if module.split(".")[1:2] == [package] for line, imported in _imports(path)
             if imported == "click" or imported.startswith("click.")]
    assert not users, users


def test_every_package_says_what_it_owns_and_may_import() -> None:
    for name in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, f"consulrun/{name}/__init__.py: its docstring must say what it may import"
        body = ast.parse((PACKAGE / name / "__init__.py").read_text(encoding="utf-8")).body
        # A package's __init__ imports nothing: `run` pays only for the modules it uses.
        assert all(isinstance(node, ast.Expr) for node in body), f"consulrun/{name}/__init__.py holds code"


def test_no_module_is_long_without_saying_why() -> None:
    long = []
    for module, path in _modules():
        lines = path.read_text(encoding="utf-8").count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if lines > MODULE_LINES_AT_MOST and "Why this module is long" not in doc:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, "modules over ~400 lines whose docstring does not say why they are one:\n" + "\n".join(long)


def test_the_mutation_groups_name_files_and_functions_that_exist() -> None:
    """scripts/mutation.toml names code by path and name: a move or a rename must carry it along."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomllib's forerunner (pyproject's test extra pulls it in there)
        import tomli as tomllib

    config = tomllib.loads((PACKAGE.parent / "scripts" / "mutation.toml").read_text(encoding="utf-8"))
    missing = []
    for group, spec in config["groups"].items():
        for path, names in spec["mutate"].items():
            file = PACKAGE.parent / path
            if not file.is_file():
                missing.append(f"{group}: {path}")
                continue
            tree = ast.parse(file.read_text(encoding="utf-8"))
            defined = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                        if isinstance(t, ast.Name)}
            for name in names:
                outer, _, inner = name.partition(".")
                node = defined.get(outer)
                found = node is not None or outer in assigned
                if found and inner:
                    found = isinstance(node, ast.ClassDef) and any(
                        isinstance(m, ast.FunctionDef) and m.name == inner for m in node.body)
                if not found:
                    missing.append(f"{group}: {path}: {name}")
    assert not missing, missing
    tests = [t for spec in [*config["groups"].values(), {"tests": [t for s in config["subsets"].values() for t in s]}]
             for t in spec["tests"] if t.startswith("tests/")]
    assert all((PACKAGE.parent / t.split("::")[0]).is_file() for t in tests), tests


def test_the_package_top_level_holds_only_the_layers_and_the_entry_points() -> None:
    """A data file belongs to the package that reads it (manifest.schema.json and systemd_settings.json: manifest/)."""
    allowed = {f"{name}.py" for name in FOUNDATION | ENTRY | {"__init__"}} | set(LAYERS) | {"__pycache__"}
    stray = sorted(p.name for p in PACKAGE.iterdir() if p.name not in allowed)
    assert not stray, stray


# --- The tests' own layout ----------------------------------------------------------------------


def _test_modules_imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a `tests.test_*` module in the file, wherever it stands
    (`from tests import test_x` and `from .test_x import y` count too)."""
    package = list(path.relative_to(PACKAGE.parent).parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        out += [(node.lineno, name) for name in names
                if name.split(".")[0] == "tests" and name.split(".")[-1].startswith("test_")]
    return out


def test_no_test_module_imports_another() -> None:
    """What several test modules share lives in tests/harness/ (a module per concern) or
    tests/conftest.py (and the harness modules it registers as plugins): a test module imported by
    another drags its fixtures, marks and module-level code along, and ties the two modules' edits
    together."""
    tests = PACKAGE.parent / "tests"
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}"
             for path in sorted(tests.rglob("*.py"))
             for line, module in _test_modules_imported(path)]
    assert not found, ("imports of a test module (move what is shared to tests/harness/):\n"
                       + "\n".join(found))
