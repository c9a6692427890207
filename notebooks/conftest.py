"""Every notebook cell run under nbval: no traceback or logged error in what it printed.

nbval fails a cell that raises, and compares the outputs of the cells marked ``NBVAL_CHECK_OUTPUT``; what any
other cell printed on stderr (a worker process's logged traceback, forwarded by the kernel, a warning) would
pass unseen.  A notebook a reader runs must show none, so each cell's stream and error outputs are scanned.

nbval reads a cell's messages from the kernel only once the cell has finished.  A kernel publishes them on a
ZeroMQ socket that, like the one nbval reads, holds 1,000 messages and then drops what comes next: a cell that
runs for minutes beside a live dashboard (a redraw is a few widget messages, four times a second) filled both,
and the cell's own printout and its end ("idle") were dropped, which nbval reports as "Timeout of 5 seconds
exceeded waiting for output".  The socket nbval reads from therefore holds any number of messages (a frontend,
such as JupyterLab, reads them as they come and never drops any).
"""

import re

import pytest
import zmq
from jupyter_client.connect import ConnectionFileMixin

_connect_iopub = ConnectionFileMixin.connect_iopub


def _unbounded_iopub(self, identity=None):
    """The iopub socket of a kernel client, holding every message until it is read (set before it connects)."""
    self.context.setsockopt(zmq.RCVHWM, 0)
    try:
        return _connect_iopub(self, identity)
    finally:
        self.context.sockopts.pop(zmq.RCVHWM, None)


ConnectionFileMixin.connect_iopub = _unbounded_iopub

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
