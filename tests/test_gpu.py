"""The CUDA path: each worker on a GPU, NCCL between workers. Skipped (with the reason) without a GPU."""

import pytest
import torch

import sdpipe
from sdpipe.data import digits, digits_mlp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_nccl_single_worker():
    train_data, eval_data = digits()
    result = sdpipe.train(
        digits_mlp(), train_data, eval_data=eval_data, stages=1, pipelines=1, epochs=3, device="cuda"
    ).result(timeout=300)
    assert result.history[-1]["accuracy"] > 0.85
    assert next(result.models[0].parameters()).device.type == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="NCCL needs one GPU per worker: 4 GPUs for 2x2")
def test_cuda_nccl_2x2_allreduce_identical():
    train_data, eval_data = digits()
    result = sdpipe.train(
        digits_mlp(), train_data, eval_data=eval_data, stages=2, pipelines=2, epochs=10, device="cuda"
    ).result(timeout=300)
    assert result.max_param_diff() < 1e-6 and result.history[-1]["accuracy"] >= 0.95


def test_cuda_with_gloo_staging_2x2():
    """Workers sharing one GPU: compute on the GPU, tensors staged through the CPU over gloo."""
    train_data, eval_data = digits()
    result = sdpipe.train(
        digits_mlp(), train_data, eval_data=eval_data, stages=2, pipelines=2, epochs=10, device="cuda", backend="gloo"
    ).result(timeout=300)
    assert result.max_param_diff() < 1e-6 and result.history[-1]["accuracy"] >= 0.95


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with fewer GPUs than 2 x 1 workers")
def test_nccl_with_fewer_gpus_than_workers_is_refused_before_launch():
    train_data, _ = digits()
    with pytest.raises(ValueError, match=r"device: NCCL needs one GPU per worker: 2 workers .* pass backend='gloo'"):
        sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=1, epochs=1, device="cuda")
