"""The tree's import rule (docs/architecture.md), checked on the source, every import included
(also those inside functions):

    formats/  <  converter/{knobs,config,units}  <  converter/plan/  <  converter/run/  <
    converter/commands/  <  converter/tools/  <  converter/api  <  converter/cli/

Each stage imports only itself and the stages before it; ``formats/`` imports nothing of
``converter``; imports form no cycle (module-level or inside functions); and importing a pure planning module loads
nothing of the rest of the program."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["formats", "converter.common", "converter.plan", "converter.run", "converter.commands",
          "converter.tools", "converter.api", "converter.cli"]
COMMON = {"converter", "converter.knobs", "converter.config", "converter.units"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage_of(module: str) -> int | None:
    """The stage index of a module of ours (None for third-party and stdlib modules)."""
    if module == "formats" or module.startswith("formats."):
        return 0
    if module in COMMON:
        return 1
    if module == "converter.__main__":
        return STAGES.index("converter.cli")
    for i, stage in enumerate(STAGES):
        if module == stage or module.startswith(stage + "."):
            return i
    return None


def our_modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("converter").rglob("*.py"), *ROOT.joinpath("formats").rglob("*.py")]
    return {module_name(p): p for p in files}


def imports_of(path: Path, module: str, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for each import of one of our modules in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in our_modules() else base))
    return [(line, m) for line, m in found if stage_of(m) is not None]


def test_every_module_has_a_stage():
    assert all(stage_of(m) is not None for m in our_modules())


def test_each_stage_imports_only_itself_and_the_stages_before_it():
    wrong = []
    for module, path in sorted(our_modules().items()):
        if module == "converter":
            continue  # the package's lazy __getattr__ (PEP 562) reaches converter.api on demand
        for line, target in imports_of(path, module):
            if stage_of(target) > stage_of(module):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} ({STAGES[stage_of(module)]}) "
                             f"imports {target} ({STAGES[stage_of(target)]})")
    assert not wrong, "imports against the stage order:\n" + "\n".join(wrong)


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (the package ``converter`` binds the API lazily,
    PEP 562: its edge to ``converter.api`` is no import)."""
    modules = our_modules()
    return {m: set() if m == "converter" else
            {t for _, t in imports_of(p, m, top_level_only=top_level_only) if t in modules and t != m}
            for m, p in modules.items()}


def test_module_level_imports_form_no_cycle():
    cycle = _first_cycle(import_graph(top_level_only=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_imports_inside_functions_form_no_cycle_either():
    """A function-level import that closes a circle hides a tangle the module graph does not show
    (e.g. plan/from_code <-> plan/placement_rules, run/destination <-> run/distributed)."""
    cycle = _first_cycle(import_graph(top_level_only=False))
    assert cycle is None, "import cycle through imports inside functions: " + " -> ".join(cycle or ())


@pytest.mark.parametrize("module", ["converter.plan.mesh", "converter.plan.copy_tasks", "converter.plan.placements"])
def test_a_pure_module_loads_nothing_else(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('converter', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))
    extra = {m for m in loaded if stage_of(m) not in (1, 2)}
    assert not extra, f"importing {module} also loaded {sorted(extra)}"
    assert "torch" not in loaded, f"importing {module} loaded torch"


def test_api_names_are_lazy_and_the_same_objects():
    code = ("import sys, converter; assert 'converter.api' not in sys.modules; "
            "f = converter.to_universal; import converter.api as a; assert f is a.to_universal; "
            "import converter.tools.verify; assert callable(converter.verify) and converter.verify is a.verify; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_tests_mirror_the_tree():
    """tests/ holds a folder per stage (plus support/ and e2e/); only conftest.py and this file
    stand at its root, so a new test lands next to the code it checks."""
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("*.py")) == ["conftest.py", "test_architecture.py"]
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert {"formats", "plan", "run", "commands", "tools", "cli", "e2e", "support"} <= folders
    stray = [p for p in tests.joinpath("support").glob("test_*.py")]
    assert not stray, f"tests in tests/support/: {stray}"
