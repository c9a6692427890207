"""The house rules the code is read by: the layers, one record per policy, no type tests in the worker."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from sdpipe import policies

ROOT = Path(__file__).resolve().parent.parent
#: the pure core (docs/architecture.md)
CORE = (
    "sdpipe.scheduler",
    "sdpipe.schedule",
    "sdpipe.sync_rules",
    "sdpipe.partition",
    "sdpipe.policies",
    "sdpipe.checks",
    "sdpipe.membership",
)


def _metrics():
    spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "tools" / "code_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure()


@pytest.mark.parametrize("module", CORE)
def test_the_pure_core_imports_no_torch_dask_or_store(module):
    """Loaded alone, a core module brings no torch or Dask in; and it imports only the standard library, numpy
    and the other core modules at its top level (no store, no protocol, no worker or driver code;
    ``partition.partition`` imports torch when it is called, to cut an ``nn.Sequential``)."""
    code = (
        f"import sys; import {module};"
        "bad=[m for m in ('torch','distributed','dask') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    own = {"sdpipe." + m.split(".")[-1] for m in CORE} | {"sdpipe.checks"}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            assert f"sdpipe.{node.module}" in own, f"{module} imports .{node.module}"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "numpy" or name in own, f"{module} imports {name}"


def test_no_module_but_the_registry_spells_a_policy_name():
    """Outside sdpipe/policies.py no code spells a policy's name or mode, but for the English word "none" (an
    empty list on the dashboard and in the command line's help) and the sync reason "ps" of a server's exchange
    (an event value, sync_rules.SERVED)."""
    spelled = _metrics()["policy_names_spelled_outside_the_registry"]
    odd = [s for s in spelled if not (s.endswith("'none'") or s.startswith("sdpipe/sync_rules.py"))]
    assert odd == []


def test_the_worker_never_tests_its_policys_type():
    assert _metrics()["policy_type_tests_in_the_worker"] == []


def test_every_record_is_whole_and_consistent():
    assert policies.NAMES == ("sdpipe", "allreduce", "ps", "adpsgd", "none")
    assert policies.DEFAULT in policies.NAMES and policies.SIMULATED_POLICY in policies.NAMES
    for r in policies.RECORDS.values():
        assert policies.record(r.name) is r and policies.of_mode(r.mode) is r and policies.of_mode(r.name) is r
        assert r.exchange in policies.EXCHANGES and r.colour.startswith("#")
        module, _, cls = r.worker.partition(":")
        assert module.startswith("sdpipe.sync.") and cls  # resolved on the worker (tests/test_sync_rules.py)
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
