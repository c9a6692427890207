"""The notebooks' own test harness (notebooks/conftest.py) under nbval, on a notebook made here.

A cell that sends the kernel's message socket more than it holds before nbval reads (a live dashboard over a
long run) must still end with its printout and its end seen; nbval reads a cell's messages only once it ended.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

#: 4,000 outputs of 20 kB (80 MB) before the cell's last line: more than a bounded socket pair holds
FLOOD = "from IPython.display import display\nfor i in range(4000):\n    display('x' * 20000)\nprint('the end')"


def test_a_cell_that_sends_more_than_a_socket_holds_still_ends_under_nbval(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(FLOOD), nbformat.v4.new_code_cell("assert 1 + 1 == 2")]
    nbformat.write(nb, tmp_path / "flood.ipynb")
    shutil.copy(ROOT / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
