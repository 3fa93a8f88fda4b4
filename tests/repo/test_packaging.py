"""Packaging: the console script, the public imports, and environment.yml mirroring pyproject."""

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = set(project["dependencies"])
    for items in project["optional-dependencies"].values():
        reqs.update(r for r in items if not r.startswith("dppo-core"))
    return reqs


def test_environment_yml_pip_section_mirrors_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {r for r in pip_section if not r.startswith("-e")}
    assert listed == _pyproject_requirements(), (
        "environment.yml's pip section and pyproject.toml differ: "
        f"only in environment.yml {sorted(listed - _pyproject_requirements())}, "
        f"only in pyproject {sorted(_pyproject_requirements() - listed)}"
    )
    assert "-e ." in pip_section


def test_torch_is_pinned_to_the_cpu_build_in_the_constraints():
    text = (ROOT / "requirements" / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0+cpu" in text.split()


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "dppo_core.tools.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("demo", "build"):
        assert command in out


def test_package_imports_and_has_a_version():
    import dppo_core

    assert dppo_core.__version__


def test_public_surface_imports():
    from dppo_core import DPPOConfig, DPPOTrainer
    from dppo_core.benchmark_data import load_benchmark
    from dppo_core.rewards import extract_answer, math_reward

    assert callable(DPPOTrainer) and DPPOConfig().num_generations >= 2
    assert extract_answer("so \\boxed{42}") == "42" and math_reward("\\boxed{42}", "42") == 1.0
    assert callable(load_benchmark)


def test_the_architecture_page_names_every_module_and_its_public_surface_exists():
    """docs/architecture.md places every module of the package in a layer, and every name its "Public surface"
    table lists is there (a class's methods are looked up on the classes of the same row), without importing
    TRL, verl or vLLM: an integration's names are read off its ``__all__`` in the source."""
    import ast
    import importlib
    import re
    from types import SimpleNamespace

    def owner(module: str) -> object:
        if not module.startswith("dppo_core.integrations."):
            return importlib.import_module(module)
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        names = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
        return SimpleNamespace(__all__=names[0] if names else [])

    doc = (ROOT / "docs" / "architecture.md").read_text()
    pkg = ROOT / "dppo_core"
    modules = {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")}
    modules |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    unplaced = sorted(m for m in modules if f"`{m}`" not in doc and f"`dppo_core.{m}`" not in doc)
    assert not unplaced, f"modules missing from docs/architecture.md: {unplaced}"
    rows = [line.split("|") for line in doc.split("## Public surface", 1)[1].splitlines()]
    checked = 0
    for cells in rows:
        if len(cells) < 4 or not cells[1].strip().startswith("`dppo_core"):
            continue
        owners: list = [owner(m) for m in re.findall(r"`(dppo_core[\w.]*)`", cells[1])]
        for name in re.findall(r"`(\w+)", cells[2]):
            found = [o for o in owners if name in getattr(o, "__all__", ()) or hasattr(o, name)]
            assert found, f"docs/architecture.md lists {name} under {cells[1].strip()}, which has no such name"
            if isinstance(vars(found[0]).get(name), type):
                owners.append(vars(found[0])[name])
            checked += 1
    assert checked > 40


#: The layers of docs/architecture.md, lowest first; a module may import its own layer and the ones below. Keys are
#: a module's name under ``dppo_core`` (``engines`` and ``tools`` hold their submodules).
LAYERS = [
    {"config", "config_checks", "config_files", "varlen", "distributed", "grading", "history", "grouplog",
     "model_files", "numerics", "registry", "metrics", "draws"},
    {"grpo", "pruning", "posterior", "biased_baselines", "packing", "shared_prefix", "rewards", "tasks",
     "benchmark_data", "models", "warm_start", "shapes", "pretrained"},
    {"estimator", "engines", "rollout"},
    {"trainer", "run", "data", "policy", "logprobs", "evaluate", "plans"},
    {"integrations"},
    {"tools", "__main__"},  # __main__: `python -m dppo_core` is the dppo command
]


def _package_imports() -> dict[str, list[tuple[str, str]]]:
    """Every module of the package (dotted name) and what it imports from the package, at module level or inside
    a function alike: ``[(imported module, imported name or "")]``. ``from dppo_core.x import y`` counts as an
    import of ``dppo_core.x.y`` where that is a module, else of ``dppo_core.x`` (name ``y``)."""
    import ast

    modules = _package_modules()
    graph: dict[str, list[tuple[str, str]]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package of this module
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                if not base.startswith("dppo_core"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.append((sub, "") if sub in modules else (base, alias.name))
            elif isinstance(node, ast.Import):
                edges += [(a.name, "") for a in node.names if a.name.startswith("dppo_core")]
        graph[name] = [(m, n) for m, n in edges if m != name]
    return graph


def _package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, not ``__init__``)."""
    modules = {}
    for path in _package_sources():
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_named_by(expr: object, bound: dict[str, str], modules: dict[str, Path]) -> str | None:
    """The package module an expression names: a name ``bound`` to one, or a dotted chain of its submodules."""
    import ast

    if isinstance(expr, ast.Name):
        return bound.get(expr.id)
    if isinstance(expr, ast.Attribute) and (outer := _module_named_by(expr.value, bound, modules)) is not None:
        inner = f"{outer}.{expr.attr}"
        return inner if inner in modules else None
    return None


def _private_attribute_reads() -> list[str]:
    """Every ``module._name`` in the package where ``module`` is a name bound to another package module
    (``import dppo_core.x as m``, ``from dppo_core.x import m``, ``from . import m``, or a dotted chain such as
    ``dppo_core.x._y``) and ``_name`` is private (a leading underscore; dunders such as ``__version__`` are not)."""
    import ast

    modules = _package_modules()
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # a local name -> the package module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("dppo_core"):
                        if a.asname:
                            bound[a.asname] = a.name
                        else:
                            bound["dppo_core"] = "dppo_core"
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{base}.{a.name}"

        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not (node.attr.startswith("__") and node.attr.endswith("__"))):
                owner = _module_named_by(node.value, bound, modules)
                if owner is not None and owner != name:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {owner}.{node.attr}")
    return found


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle_no_upward_arrow_and_no_private_import():
    """Every import counts, inside functions too: no two modules import each other through any chain, no module
    imports a higher layer's (the library never imports ``dppo_core.tools``), and no module imports a name that
    starts with ``_`` from another. The package's own ``__init__`` re-exports are edges like any other."""
    graph = _package_imports()
    arrows = {m: sorted({t for t, _ in edges if t.startswith("dppo_core.") or t == "dppo_core"})
              for m, edges in graph.items()}
    # a submodule importing its package's __init__ (e.g. ``from dppo_core.tools.bench.x import y`` loads it) is
    # not an arrow of the code; the package's __init__ importing its submodules is
    cycles = _cycles({m: [t for t in ts if not m.startswith(t + ".")] for m, ts in arrows.items()})
    assert not cycles, f"import cycles: {cycles}"
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}

    def layer_of(module: str) -> int:
        key = module.split(".")[1] if "." in module else None
        assert key is None or key in layer, f"{module} is in no layer of LAYERS (and of docs/architecture.md)"
        return len(LAYERS) if key is None else layer[key]  # the package's __init__: the public surface, on top

    upward = [f"{m} imports {t}" for m, ts in arrows.items() for t in ts if layer_of(t) > layer_of(m)]
    assert not upward, upward
    private = [f"{m} imports {t}.{n}" for m, edges in graph.items() for t, n in edges if n.startswith("_")
               and n != "__version__"]
    assert not private, private


def test_one_import_path_per_name_and_no_lazy_module_attributes():
    """No module but the package's own ``__init__`` (the lazy ``DPPOConfig`` and ``DPPOTrainer`` that keep
    ``import dppo_core`` fast) defines a module-level ``__getattr__``: a name is imported from the module that
    defines it. The re-exports this removed stay removed."""
    import ast
    import importlib

    lazy = [str(p.relative_to(ROOT)) for p in _package_sources() if p != ROOT / "dppo_core" / "__init__.py"
            and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(p.read_text()).body)]
    assert not lazy, f"module-level __getattr__ in {lazy}: import the names from the modules that define them"
    removed = {"dppo_core.rollout": ("VLLMRollout", "WeightSyncError", "checkpoint_weights"),
               "dppo_core.integrations": ("DPPOGRPOTrainer",), "dppo_core.tasks": ("load_benchmark", "BenchmarkRecord"),
               "dppo_core.models": ("warm_start", "WarmStartConfig", "kernel_fingerprint", "block_causal_mask")}
    for module, names in removed.items():
        found = [n for n in names if hasattr(importlib.import_module(module), n)]
        assert not found, f"{module} has {found} again: import them from where they are defined"
    assert not (ROOT / "dppo_core" / "lean_decode.py").exists() and not (ROOT / "dppo_core" / "vllm_engine.py").exists()


def test_no_module_reads_another_modules_private_attribute():
    """The attribute form of a private import: ``module._name`` on another package module bound to a name
    (``from dppo_core.integrations import verl as dv; dv._STATE``) reaches past that module's public functions
    just as ``from x import _y`` does. A module's own names, and dunders (``__version__``, ``__file__``), are fine."""
    found = _private_attribute_reads()
    assert not found, found


def _package_sources() -> list[Path]:
    """The package's modules: its .py files less those under dppo_core/assets (files the package ships, such as
    the course's exercise solutions, which are run as scripts and never imported as dppo_core modules)."""
    pkg = ROOT / "dppo_core"
    return [p for p in sorted(pkg.rglob("*.py")) if p.relative_to(pkg).parts[0] != "assets"]


def _library_files() -> list[Path]:
    pkg = ROOT / "dppo_core"
    return [p for p in _package_sources() if "tools" not in p.relative_to(pkg).parts]


#: What a step is made of: a class that overrides one of these (or a private method) changes how a step selects,
#: rolls out, scores or trains, which is a rollout plan's business (dppo_core.plans), not a trainer subclass's.
STEP_METHODS = {"select_prompts", "generate", "rollout", "roll_out", "score", "weigh", "train_step", "update"}


def test_no_class_in_the_package_subclasses_the_trainer_to_change_a_step():
    """A selection rule that reads rewards is a plan in one file plus its registration (dppo_core.registry): no class
    of the package subclasses ``DPPOTrainer`` and overrides a step's parts (the bench's trainer only times its
    evaluations), and every plan the registry names is the class registered under that name."""
    import ast

    from dppo_core import registry
    from dppo_core.plans import plan_class

    found = []
    for path in _package_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("DPPOTrainer") for b in node.bases):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                bad = sorted(m for m in methods if m in STEP_METHODS or (m.startswith("_") and not m.startswith("__")))
                if bad:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} overrides {bad}")
    assert not found, found
    assert {name: plan_class(name).name for name in registry.ROLLOUT_PLANS} == {n: n for n in registry.ROLLOUT_PLANS}


def test_library_modules_and_functions_stay_small():
    """No module of the package over 500 lines, the tools (``dppo_core/tools``) included; no library function over 65
    lines of code (its docstring not counted): there the tools are exempt, the library is what a reader studies."""
    import ast

    long_modules = [f"{p.relative_to(ROOT)}: {n}" for p in _package_sources()
                    if (n := len(p.read_text().splitlines())) > 500]
    assert not long_modules, long_modules
    long_functions = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.body[0]
                doc = (first.end_lineno - first.lineno + 1 if isinstance(first, ast.Expr)
                       and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str) else 0)
                if (n := node.end_lineno - node.lineno + 1 - doc) > 65:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert not long_functions, long_functions


def test_the_package_reads_at_110_columns():
    """No line of the package over 110 characters (the linter's limit for ``dppo_core/``, set in its ruff.toml):
    the module cap is kept by moving code to where it belongs, not by widening lines."""
    import tomllib

    assert tomllib.loads((ROOT / "dppo_core" / "ruff.toml").read_text())["line-length"] == 110
    wide = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "dppo_core").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 110]
    assert not wide, wide[:20]


def test_bitsandbytes_kernel_notice_is_dropped_and_other_warnings_are_not():
    """`import dppo_core` filters bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community"
    (printed on AVX512-BF16 CPUs without the optional `kernels` package; students read it as a broken
    install), and only that message."""
    import subprocess
    import sys

    code = ("import logging, dppo_core; log = logging.getLogger('bitsandbytes.backends.cpu.ops'); "
            "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s', 'no kernels'); "
            "log.warning('another bitsandbytes warning')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "kernels-community" not in proc.stderr and "another bitsandbytes warning" in proc.stderr
    # and the real import path (PEFT imports bitsandbytes) prints nothing of it
    proc = subprocess.run([sys.executable, "-c", "import dppo_core.policy, peft, bitsandbytes"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "kernels-community" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
