"""The house rules the code is read by: the layers, one record per policy, no type tests in the worker."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from sdpipe.core import policies

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sdpipe"
#: the pure core (docs/architecture.md)
CORE = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (PACKAGE / "core").rglob("*.py")
)


def _metrics():
    spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "tools" / "code_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure()


def _sdpipe_imports(path: Path, top_level: bool = False) -> list:
    """The sdpipe modules ``path`` imports (anywhere in it, or at its top level only), as dotted names."""
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sdpipe"):
            out += [f"{node.module}.{a.name}" if node.module == "sdpipe" else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("sdpipe")]
    return out


@pytest.mark.parametrize("module", CORE)
def test_the_pure_core_imports_no_torch_dask_or_store(module):
    """Loaded alone, a core module brings no torch or Dask in; and at its top level it imports only the standard
    library, numpy and the other core modules (``partition.partition`` imports torch when it is called, to cut
    an ``nn.Sequential``)."""
    code = (
        f"import sys; import {module};"
        "bad=[m for m in ('torch','distributed','dask') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                inside = name.startswith("sdpipe.core") or top in sys.stdlib_module_names or top == "numpy"
                assert inside and not node_is_relative(node), f"{module} imports {name}"


def node_is_relative(node) -> bool:
    return isinstance(node, ast.ImportFrom) and node.level > 0


@pytest.mark.parametrize(
    "package, allowed",
    [
        ("wire", ("sdpipe.core", "sdpipe.wire")),  # the messages: used by every process
        ("service.py", ("sdpipe.core", "sdpipe.wire")),  # runs in the Dask scheduler
    ],
)
def test_the_messages_and_the_service_import_only_the_core_and_the_wire(package, allowed):
    files = [PACKAGE / package] if package.endswith(".py") else sorted((PACKAGE / package).rglob("*.py"))
    for f in files:
        for name in _sdpipe_imports(f):
            assert name.startswith(allowed), f"{f.relative_to(ROOT)} imports {name}"


def test_the_worker_never_imports_the_driver():
    for f in sorted((PACKAGE / "worker").rglob("*.py")):
        for name in _sdpipe_imports(f):
            assert not name.startswith(("sdpipe.driver", "sdpipe.widgets")), f"{f.relative_to(ROOT)} imports {name}"


def test_no_module_but_the_registry_spells_a_policy_name():
    """Outside sdpipe/core/policies.py no code spells a policy's name or mode, but for the English word "none" (an
    empty list on the dashboard and in the command line's help) and the sync reason "ps" of a server's exchange
    (an event value, sync_rules.SERVED)."""
    spelled = _metrics()["policy_names_spelled_outside_the_registry"]
    odd = [s for s in spelled if not (s.endswith("'none'") or s.startswith("sdpipe/core/sync_rules.py"))]
    assert odd == []


def test_the_worker_never_tests_its_policys_type():
    assert _metrics()["policy_type_tests_in_the_worker"] == []


def test_every_record_is_whole_and_consistent():
    assert policies.NAMES == ("sdpipe", "allreduce", "ps", "adpsgd", "none")
    assert policies.DEFAULT in policies.NAMES
    for r in policies.RECORDS.values():
        assert policies.record(r.name) is r and policies.of_mode(r.mode) is r and policies.of_mode(r.name) is r
        assert r.exchange in policies.EXCHANGES and r.colour.startswith("#")
        module, _, cls = r.worker.partition(":")
        assert module.startswith("sdpipe.worker.sync.") and cls  # resolved on the worker (tests/test_sync_rules.py)
        assert not r.rejoin or r.loss_tolerant  # a pipeline comes back only where the others went on
        assert not r.live or r.preset is not None  # a live switch takes the preset of the policy switched to
        assert r.coupled == (r.exchange == "all")
    assert policies.of_mode(policies.SWITCHED_MODE).uses_service
    with pytest.raises(ValueError, match=r"^policy: 'gossip' is not one of sdpipe, allreduce, ps, adpsgd, none$"):
        policies.record("gossip")


def test_the_widgets_read_only_public_names():
    for f in sorted((ROOT / "widgets").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sdpipe"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                parts = [p for p in node.module.split(".") if p.startswith("_")]
                assert not private and not parts, f"{f.name}:{node.lineno} imports {node.module} {private}"
