"""The C allocator while a worker trains: Dask's fixed trim threshold must not turn every activation into fresh
pages (sdpipe.worker.allocator).  Real processes started as Dask's nanny starts its workers."""

import os
import subprocess
import sys

import pytest

PROBE = r"""
import resource, torch
from sdpipe.worker.allocator import training_thresholds

def faults(n=50):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        t = torch.ones(256 * 1024)  # 1 MiB: above glibc's fixed 128 KiB mmap threshold
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

outside = faults()
with training_thresholds():
    faults(5)  # the heap grows once
    inside = faults()
print(outside, inside)
"""


def _faults(env_extra: dict) -> list:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"} | env_extra
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(x) for x in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_a_fixed_trim_threshold_is_lifted_while_training():
    outside, inside = _faults({"MALLOC_TRIM_THRESHOLD_": "65536"})  # as Dask's nanny sets it
    assert outside >= 50 * 100  # every 1 MiB tensor faulted its pages in anew
    assert inside < outside / 20  # while training they reuse the heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_a_process_without_the_setting_is_left_alone():
    outside, inside = _faults({})
    assert outside < 50 * 100 and inside < 50 * 100  # glibc adapts by itself
