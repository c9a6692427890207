"""Every notebook cell run under nbval: no traceback or logged error in what it printed.

nbval fails a cell that raises, and compares the outputs of the cells marked ``NBVAL_CHECK_OUTPUT``; what any
other cell printed on stderr (a worker process's logged traceback, forwarded by the kernel, a warning) would
pass unseen.  A notebook a reader runs must show none, so each cell's stream and error outputs are scanned.
"""

import re

import pytest

#: what must not appear in a cell's output: a traceback, a logged error, an unhandled thread exception
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|\b(?:ERROR|CRITICAL) - |Exception in thread|\bError: ")


def problems(outputs) -> list:
    """The lines of a cell's outputs (nbformat dicts) that show a traceback or a logged error."""
    bad = []
    for out in outputs or []:
        if out.get("output_type") == "error":
            bad.append(f"{out.get('ename')}: {out.get('evalue')}")
        elif out.get("output_type") == "stream":
            bad += [line for line in out.get("text", "").splitlines() if TRACEBACK.search(line)]
    return bad


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    outputs = getattr(item, "test_outputs", None)  # an nbval cell's outputs, as the kernel sent them
    bad = problems(outputs) if outputs is not None else []
    if bad:
        pytest.fail(f"the cell printed a traceback or an error: {bad[:5]}", pytrace=False)
    return result
