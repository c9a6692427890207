"""The CUDA path on a GPU machine, in one go: what the GPU tests cover, and what one GPU for several workers does.

    python tools/gpu_check.py [--out DIR]

Prints (and writes DIR/gpu_check.json): the GPUs and versions; a 1 x 1 run
with NCCL; a 2 x 2 run with the workers sharing the GPU and tensors staged
over gloo (replicas identical, accuracy); and a 2 x 1 run asking for NCCL
with fewer GPUs than workers, to record how it ends (NCCL needs one GPU per
rank).  Every run has a timeout; nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)

    import torch

    import sdpipe
    from sdpipe.data import digits, digits_mlp

    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
        "names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
    }
    try:
        report["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        report["nvidia_smi"] = repr(e)
    print(json.dumps(report), flush=True)
    train_data, eval_data = digits()

    def attempt(name, **kw):
        t = time.monotonic()
        row = {"name": name, "args": {k: v for k, v in kw.items()}}
        try:
            r = sdpipe.train(digits_mlp(), train_data, eval_data=eval_data, **kw).result(timeout=240)
            last = max(h["epoch"] for h in r.history)
            row.update(
                ok=True,
                accuracy=min(h["accuracy"] for h in r.history if h["epoch"] == last),
                max_param_diff=r.max_param_diff(),
                samples_per_s=sum(h["samples_per_s"] for h in r.history if h["epoch"] == last),
                model_device=str(next(r.models[0].parameters()).device),
            )
        except BaseException as e:  # recorded, not raised: the next check still runs
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-1500:])
        row["seconds"] = round(time.monotonic() - t, 1)
        print(json.dumps(row), flush=True)
        report.setdefault("runs", []).append(row)

    attempt("1x1 nccl", stages=1, pipelines=1, epochs=3, device="cuda")
    attempt("2x2 cuda, gloo staging", stages=2, pipelines=2, epochs=10, device="cuda", backend="gloo")
    attempt(
        "2x2 cuda, gloo staging, sdpipe (arrival windows)",
        stages=2,
        pipelines=2,
        epochs=10,
        device="cuda",
        backend="gloo",
        policy="sdpipe",
    )
    attempt(
        "2x2 cuda, gloo staging, sdpipe with overlapped averaging",
        stages=2,
        pipelines=2,
        epochs=10,
        device="cuda",
        backend="gloo",
        policy="sdpipe",
        scheduler={"overlap": True},
    )
    attempt("2x2 cpu (for comparison)", stages=2, pipelines=2, epochs=10)
    attempt("2x1 nccl on fewer GPUs than workers", stages=2, pipelines=1, epochs=2, device="cuda", timeout=60)
    attempt("2x1 cuda, gloo staging", stages=2, pipelines=1, epochs=3, device="cuda", backend="gloo")
    leftovers = [
        c
        for c in __import__("psutil").Process().children(recursive=True)
        if "resource_tracker" not in " ".join(c.cmdline())
    ]
    report["processes_left"] = [" ".join(c.cmdline())[:120] for c in leftovers]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("processes left:", report["processes_left"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
