"""Size and coupling figures of the package's code, for before/after comparisons of a refactoring.

    python tools/code_metrics.py            # a table
    python tools/code_metrics.py --json     # the same as JSON

Counted with :mod:`ast` over ``sdpipe/`` (and ``widgets/`` for long lines):

* the longest functions, classes and modules (lines from ``def``/``class`` to the body's last line, decorators
  and the unit's own docstring excluded), and how many are over the house limits (function 60, class 300,
  module 700 lines);
* the places outside ``sdpipe/core/policies.py`` that spell a policy's name or mode in code (a string constant that
  is not a docstring, in ``sdpipe/`` and ``widgets/``): ``sdpipe`` alone is left out, as it is also the
  package's, the logger's and the program's name;
* type tests of the policy in the worker (``hasattr(...policy...)``, ``policy.name`` compared with a string);
* the rule sets ruff checks (``[tool.ruff.lint] select`` in ``pyproject.toml``);
* lines over 120 characters;
* ``isinstance`` checks against a policy class (one defined in ``sdpipe/worker/sync/``) outside that module;
* imports of the package's own modules inside functions;
* test functions that call policy decisions without a cluster: tests in modules without the ``cluster``,
  ``hosts``, ``browser`` or ``gpu`` markers that reference a name of ``sdpipe.worker.sync`` or
  ``sdpipe.core.sync_rules``.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 120
POLICY_MODULES = (
    *tuple(sorted(f"sdpipe/worker/sync/{p.name}" for p in (ROOT / "sdpipe" / "worker" / "sync").glob("*.py"))),
    "sdpipe/core/sync_rules.py",
)
#: house limits on a unit's length in lines
LIMITS = {"function": 60, "class": 300, "module": 700}
WORKER_MODULES = ("sdpipe/worker/loop.py", "sdpipe/worker/boundary.py", "sdpipe/worker/stage.py")


def _docstrings(tree: ast.AST) -> set:
    """The ids of the string constants that are docstrings (of the module, a class or a function) or that stand
    alone as a statement (an attribute's docstring)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.add(id(node.value))
    return out


def _policy_spellings(tree: ast.AST, rel: str, spelled: set) -> list:
    docs = _docstrings(tree)
    return [
        f"{rel}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in spelled and id(node) not in docs
    ]


def _policy_type_tests(tree: ast.AST, rel: str) -> list:
    out = []
    for node in ast.walk(tree):
        text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Compare)) else ""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "isinstance"):
            if "policy" in text:
                out.append(f"{rel}:{node.lineno} {text}")
        elif isinstance(node, ast.Compare) and "policy.name" in text:
            against = [node.left, *node.comparators]
            if any(isinstance(c, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for c in against):
                out.append(f"{rel}:{node.lineno} {text}")
    return out


def _ruff_rules() -> list:
    import tomllib

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {}).get("ruff", {}).get("lint", {})
    return sorted(lint.get("select", []) + lint.get("extend-select", []))


def _spelled() -> set:
    """Every policy's name and its workers' mode, from the registry (``sdpipe`` left out: see the docstring)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from sdpipe.core.policies import RECORDS

    return {x for r in RECORDS.values() for x in (r.name, r.mode)} - {"sdpipe"}


def _units(tree: ast.AST, path: str):
    """Each function and class with its length: from ``def``/``class`` to its last line, less its own docstring
    (an API's reference text, as ``help()`` shows it, is not code of the unit)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines -= first.end_lineno - first.lineno + 1
            yield kind, f"{path}:{node.name}", lines


def _policy_classes() -> set:
    names = set()
    for rel in POLICY_MODULES:
        p = ROOT / rel
        if p.exists():
            names |= {n.name for n in ast.parse(p.read_text()).body if isinstance(n, ast.ClassDef)}
    return names


def _policy_names() -> set:
    names = set()
    for rel in POLICY_MODULES:
        p = ROOT / rel
        if p.exists():
            tree = ast.parse(p.read_text())
            names |= {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    return names


def measure() -> dict:
    files = sorted((ROOT / "sdpipe").rglob("*.py"))
    all_files = files + sorted((ROOT / "widgets").glob("*.py"))
    policy_classes = _policy_classes()
    spelled = _spelled()
    units, long_lines, isinstance_checks, local_imports = [], [], [], []
    modules, spellings, type_tests = [], [], []
    for f in all_files:
        rel = str(f.relative_to(ROOT))
        text = f.read_text()
        long_lines += [f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1) if len(line) > LIMIT]
        modules.append(("module", rel, len(text.splitlines())))
        tree = ast.parse(text)
        if rel != "sdpipe/core/policies.py":
            spellings += _policy_spellings(tree, rel, spelled)
        if rel in WORKER_MODULES:
            type_tests += _policy_type_tests(tree, rel)
        units += list(_units(tree, rel))
        if f not in files:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and rel not in POLICY_MODULES
                and len(node.args) == 2
            ):
                target = node.args[1]
                names = [
                    e.id
                    for e in (target.elts if isinstance(target, ast.Tuple) else [target])
                    if isinstance(e, ast.Name)
                ]
                if any(n in policy_classes for n in names):
                    isinstance_checks.append(f"{rel}:{node.lineno}")
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
                    if isinstance(node, ast.ImportFrom) and (node.level >= 1 or module.startswith("sdpipe")):
                        local_imports.append(f"{rel}:{node.lineno}")
    functions = sorted((u for u in units if u[0] == "function"), key=lambda u: -u[2])
    classes = sorted((u for u in units if u[0] == "class"), key=lambda u: -u[2])
    modules.sort(key=lambda u: -u[2])
    return {
        "longest_functions": [[n, k] for _, n, k in functions[:5]],
        "longest_classes": [[n, k] for _, n, k in classes[:5]],
        "longest_modules": [[n, k] for _, n, k in modules[:5]],
        f"functions_over_{LIMITS['function']}": len([u for u in functions if u[2] > LIMITS["function"]]),
        f"classes_over_{LIMITS['class']}": len([u for u in classes if u[2] > LIMITS["class"]]),
        f"modules_over_{LIMITS['module']}": len([u for u in modules if u[2] > LIMITS["module"]]),
        "policy_names_spelled_outside_the_registry": spellings,
        "policy_type_tests_in_the_worker": type_tests,
        "ruff_rules": _ruff_rules(),
        "lines_over_120": len(long_lines),
        "policy_isinstance_outside_policy_code": isinstance_checks,
        "package_imports_inside_functions": len(set(local_imports)),
        "policy_decision_tests_without_cluster": _policy_tests(),
    }


def _policy_tests() -> int:
    names = _policy_names()
    count = 0
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        text = f.read_text()
        tree = ast.parse(text)
        if any(
            m in text for m in ("pytest.mark.cluster", "pytest.mark.hosts", "pytest.mark.browser", "pytest.mark.gpu")
        ):
            continue
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("sdpipe.worker.sync", "sdpipe.core.sync_rules")
            ):
                imported |= {a.asname or a.name for a in node.names}
        used = imported & names
        if not used:
            continue
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                if any(isinstance(n, ast.Name) and n.id in used for n in ast.walk(fn)):
                    count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    m = measure()
    if args.json:
        print(json.dumps(m, indent=1))
        return
    for key, value in m.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            print(f"{key}:")
            for name, n in value:
                print(f"    {n:5d}  {name}")
        elif isinstance(value, list):
            print(f"{key}: {len(value)}" + (f" ({', '.join(value)})" if value else ""))
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
