"""Models beyond one tensor per boundary: structures of tensors between stages, batches of different sizes,
losses and metrics beyond class labels, map-style datasets, and the one-line errors for what cannot work."""

import copy
import math

import pytest
import torch
from torch import nn

import sdpipe
from sdpipe.data import batch_indices, digits
from sdpipe.worker.tree import Layout, flatten, header, layout_of, read_header, split, unflatten

from helpers import assert_records_valid, train_on


# ------------------------------------------------------------------ structures, without a cluster
def test_structures_flatten_split_and_rebuild():
    h, m = torch.randn(5, 7, 3), torch.ones(5, 7, dtype=torch.bool)
    obj = {"h": h, "rest": (m, [h[:, 0]])}
    leaves, skeleton = flatten(obj)
    assert [t.shape for t in leaves] == [h.shape, m.shape, (5, 3)]
    back = unflatten(skeleton, leaves)
    assert isinstance(back["rest"], tuple) and isinstance(back["rest"][1], list)
    assert torch.equal(back["rest"][1][0], h[:, 0])
    parts = split(obj, 3)  # 5 rows into 2, 2, 1
    assert [p["h"].shape[0] for p in parts] == [2, 2, 1] and parts[2]["rest"][0].shape == (1, 7)
    layout = layout_of(obj)
    assert layout == Layout(skeleton, ("float32", "bool", "float32"), (3, 2, 2), ((7, 3), (7,), (3,)))
    assert layout.header_size == 30  # per tensor: dtype, dimensions, 8 sizes
    # dtypes and sizes travel in the header: they may change from one micro-batch to the next
    other = [torch.randn(2, 9, 3, dtype=torch.float64), torch.zeros(2, 9, dtype=torch.bool), torch.randn(2, 3)]
    assert read_header(header(other)) == [("float64", (2, 9, 3)), ("bool", (2, 9)), ("float32", (2, 3))]
    assert len(header(other)) == layout.header_size
    with pytest.raises(ValueError, match=r"output\['a'\]\[1\] is a str"):
        layout_of({"a": (h, "mask")})
    with pytest.raises(ValueError, match="micro-batch as dimension 0"):
        layout_of((h, torch.zeros(4)))


# ------------------------------------------------------------------ a model whose stages pass a tuple and a dict
class Embed(nn.Module):
    """Stage 0: a hidden state and a mask (bool), as a tuple."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 32)

    def forward(self, x):
        return torch.tanh(self.lin(x)), x[:, 20:44].sum(1) > 4.0


class Mix(nn.Module):
    """Stage 1: takes the tuple, returns a dict with a new state, its input passed on (a second path for its
    gradient), and the mask."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, inp):
        h, mask = inp
        return {"h": torch.relu(self.lin(h)), "skip": 0.5 * h, "mask": mask}


class Head(nn.Module):
    """Stage 2: class scores from the dict, shifted where the mask is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 10)
        self.shift = nn.Parameter(torch.zeros(10))

    def forward(self, d):
        return self.lin(d["h"] + d["skip"]) + d["mask"].float().unsqueeze(1) * self.shift


def structured_model(seed=0):
    torch.manual_seed(seed)
    return [Embed(), Mix(), Head()]


def reference(stages, X, Y, *, epochs, batch_size, lr):
    """One process, whole batches (the last one shorter), the batches a 1-pipeline run reads."""
    model = nn.Sequential(*stages)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    n = len(X)
    for epoch in range(epochs):
        for b in range(-(-n // batch_size)):
            idx = batch_indices(n, batch_size, 0, epoch, b)
            opt.zero_grad()
            nn.functional.cross_entropy(model(X[idx]), Y[idx]).backward()
            opt.step()
    return model


@pytest.mark.cluster
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tuple_and_dict_between_stages_match_one_process(schedule, shared_cluster, no_leaks):
    """3 stages, one pipeline: a tuple (with a bool mask) crosses the first boundary, a dict the second; the
    epoch's last batch is shorter (1437 = 22 x 64 + 29), so two sizes of micro-batch cross; the weights equal
    a single-process training's within 1e-5."""
    (X, Y), (EX, EY) = digits()
    assert len(X) % 64 == 29
    stages = structured_model()
    run = sdpipe.train(
        copy.deepcopy(stages),
        (X, Y),
        eval_data=(EX, EY),
        stages=3,
        pipelines=1,
        policy="none",
        schedule=schedule,
        optimizer="sgd",
        lr=0.05,
        batch_size=64,
        microbatches=4,
        drop_last=False,
        epochs=2,
        cluster=shared_cluster,
    )
    result = run.result(timeout=300)
    assert_records_valid(result.events)
    ref = reference(stages, X, Y, epochs=2, batch_size=64, lr=0.05)
    got = result.models[0].state_dict()
    diff = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())
    assert diff < 1e-5, diff
    moved = max(
        float((v - s).abs().max())
        for v, s in zip(ref.parameters(), nn.Sequential(*structured_model()).parameters(), strict=True)
    )
    assert moved > 1e-2  # the comparison could fail: training changed the weights
    # every batch of the epoch was trained, the last one shorter
    assert sorted(h["samples"] for h in result.history) == [len(X), len(X)]
    assert all(h["share"] == pytest.approx(1.0) for h in result.history)
    with torch.no_grad():
        acc = float((result.models[0](EX).argmax(1) == EY).float().mean())
    assert result.history[-1]["accuracy"] == pytest.approx(acc) and result.history[-1]["metric"] == "accuracy"


# ------------------------------------------------------------------ the one-line errors, before any worker starts
class Words(nn.Module):
    def forward(self, x):
        return "not a tensor"


class Narrow(nn.Module):
    def forward(self, x):
        return x[:, :10]


@pytest.mark.parametrize(
    "stages, options, message",
    [
        (
            [nn.Linear(64, 16), Words()],
            {},
            "model: stage 1 must return a tensor or a tuple, list or dict of tensors with the micro-batch as "
            "dimension 0; its output is a str",
        ),
        ([nn.Linear(64, 16), (lambda: None)], {}, "model: a list of stages must hold nn.Module"),
        (
            [Narrow(), nn.Linear(64, 10)],
            {},
            "model: stage 1 fails on stage 0's output float32[8, 10]: RuntimeError: mat1 and mat2 shapes cannot be "
            "multiplied",
        ),
        ([nn.Linear(64, 16), nn.Linear(16, 10)], {"metric": "top5"}, "metric: must be 'accuracy', 'perplexity'"),
        (
            [nn.Linear(64, 16), nn.Linear(16, 10)],
            {"loss_fn": lambda out, y: out.sum(1)},
            "loss_fn: must return a one-element float tensor, got float32[8] for the last stage's output",
        ),
        (
            [nn.Linear(64, 16), nn.Linear(16, 10)],
            {"drop_last": False, "batch_size": 1432},
            "drop_last: the last batch would hold 5 samples",
        ),
    ],
)
def test_bad_models_and_losses_get_one_line_naming_the_stage_or_field(stages, options, message):
    (X, Y), _ = digits()
    options = {"microbatches": 4, "batch_size": 32, **options}
    if options["batch_size"] == 1432:
        options["microbatches"] = 8
    with pytest.raises(ValueError) as info:
        sdpipe.train(stages, (X, Y), stages=2, pipelines=1, **options)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text


def test_accuracy_needs_class_scores():
    (X, Y), _ = digits()
    with pytest.raises(ValueError, match=r"^metric: 'accuracy' needs integer targets .* targets float32\[8\]$"):
        sdpipe.train(
            [nn.Linear(64, 16), nn.Linear(16, 1), nn.Flatten(0)],
            (X, Y.float()),
            stages=3,
            pipelines=1,
            loss_fn=nn.MSELoss(),
            metric="accuracy",
        )


# ------------------------------------------------------------------ sequences whose length changes from batch to batch
class Ragged(torch.utils.data.Dataset):
    """Windows of the standard library's text whose length depends on the item (16, 24, 32 or 40 tokens)."""

    def __init__(self, tokens, n):
        self.tokens, self.n = tokens, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        length = 16 + 8 * (i % 4)
        lo = 41 * i
        return self.tokens[lo : lo + length], self.tokens[lo + 1 : lo + length + 1]


def shortest(items):
    """A batch of the items cut to the shortest one's length: each batch has its own sequence length."""
    t = min(len(x) for x, _ in items)
    return torch.stack([x[:t] for x, _ in items]), torch.stack([y[:t] for _, y in items])


@pytest.mark.cluster
def test_sequences_of_changing_length_through_a_map_style_dataset_match_one_process(shared_cluster, no_leaks):
    """A small GPT on a map-style Dataset whose collate_fn gives every batch its own sequence length; the
    activations crossing the boundary change shape from batch to batch; one pipeline equals one process."""
    from sdpipe.examples import char_gpt, encode, lm_loss, stdlib_text

    text, _ = stdlib_text(20_000, 0)
    data = Ragged(encode(text), 160)
    model = char_gpt(block=40, width=32, heads=2, layers=2)
    ref = copy.deepcopy(model)
    run = sdpipe.train(
        model,
        data,
        collate_fn=shortest,
        loss_fn=lm_loss,
        stages=2,
        pipelines=1,
        policy="none",
        optimizer="sgd",
        lr=0.1,
        batch_size=4,
        microbatches=2,
        epochs=1,
        cluster=shared_cluster,
    )
    result = run.result(timeout=300)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    lengths = set()
    for b in range(len(data) // 4):
        x, y = shortest([data[i] for i in batch_indices(len(data), 4, 0, 0, b).tolist()])
        lengths.add(x.shape[1])
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    assert len(lengths) >= 3, lengths
    got = result.models[0].state_dict()
    diff = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())
    assert diff < 1e-5, diff
    assert (
        max(
            float((a - b).abs().max())
            for a, b in zip(ref.parameters(), char_gpt(block=40, width=32, heads=2, layers=2).parameters(), strict=True)
        )
        > 1e-3
    )
    # the activations' sizes were recorded by their shapes: one stage record per worker, from the probe
    assert result.history[0]["samples"] == 160


@pytest.mark.cluster
def test_gpt_example_under_allreduce_reports_perplexity_with_identical_replicas(shared_cluster, no_leaks):
    from sdpipe.examples import char_data, char_gpt, lm_loss

    train_set, eval_set = char_data(train_chars=40_000, eval_chars=8_000)
    run = sdpipe.train(
        char_gpt(),
        train_set,
        eval_data=eval_set,
        loss_fn=lm_loss,
        metric="perplexity",
        stages=2,
        pipelines=2,
        policy="allreduce",
        lr=0.003,
        batch_size=32,
        epochs=2,
        cluster=shared_cluster,
    )
    result = run.result(timeout=300)
    assert_records_valid(result.events)
    assert result.max_param_diff() < 1e-6
    last = [h for h in result.history if h["epoch"] == 1]
    assert len(last) == 2 and all(h["metric"] == "perplexity" and "accuracy" not in h for h in last)
    first = {h["pipeline"]: h for h in result.history if h["epoch"] == 0}
    for h in last:
        assert h["perplexity"] == pytest.approx(math.exp(h["eval_loss"]))
        assert h["eval_loss"] < min(4.2, first[h["pipeline"]]["eval_loss"])  # ln(128) = 4.85 untrained
    # the dashboard shows the metric by its name
    from sdpipe.widgets import Dashboard

    dash = Dashboard(result)
    assert "held-out perplexity per epoch" in [a.text for a in dash.figure.layout.annotations]
    curve = dash.trace("accuracy/1")
    assert list(curve.x) == [0, 1] and list(curve.y) == pytest.approx(
        [h["perplexity"] for h in sorted(result.history, key=lambda h: h["epoch"]) if h["pipeline"] == 1]
    )


# ------------------------------------------------------------------ an IterableDataset, sharded per pipeline
class DigitStream(torch.utils.data.IterableDataset):
    """The digits as a stream of (image, label) pairs in a fixed order, with no length."""

    def __init__(self, X, Y):
        self.X, self.Y = X, Y

    def __iter__(self):
        for i in range(len(self.X)):
            yield self.X[i], self.Y[i]


@pytest.mark.cluster
def test_a_stream_on_one_pipeline_trains_its_batches_in_order_as_one_process(shared_cluster, no_leaks):
    """Stage 0 reads the stream and sends each batch's targets to the last stage; with one pipeline its shard is
    the whole stream: consecutive batches, the last one shorter, equal to one process within 1e-5."""
    from sdpipe.data import digits_mlp

    (X, Y), (EX, EY) = digits()
    model = digits_mlp()
    ref = copy.deepcopy(model)
    result = sdpipe.train(
        model,
        DigitStream(X, Y),
        eval_data=DigitStream(EX, EY),  # read once on the driver: every pipeline evaluates all of it
        stages=2,
        pipelines=1,
        policy="none",
        optimizer="sgd",
        lr=0.05,
        batch_size=64,
        drop_last=False,
        epochs=2,
        cluster=shared_cluster,
    ).result(timeout=300)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for lo in range(0, len(X), 64):
            opt.zero_grad()
            nn.functional.cross_entropy(ref(X[lo : lo + 64]), Y[lo : lo + 64]).backward()
            opt.step()
    got = result.models[0].state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) < 1e-5
    assert [h["samples"] for h in result.history] == [len(X), len(X)]
    with torch.no_grad():
        acc = float((result.models[0](EX).argmax(1) == EY).float().mean())
    assert result.history[-1]["accuracy"] == pytest.approx(acc)


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["sdpipe", "allreduce"])
def test_a_stream_is_sharded_per_pipeline(policy, shared_cluster, no_leaks):
    """Two pipelines each train on their own shard (items p, p + 2, ...): 1437 items give shards of 719 and 718,
    so 11 full batches of 64 each; the replicas end identical and learnt."""
    from sdpipe.data import digits_mlp

    (X, Y), (EX, EY) = digits()
    result = train_on(
        shared_cluster,
        digits_mlp(),
        DigitStream(X, Y),
        eval_data=(EX, EY),
        stages=2,
        pipelines=2,
        policy=policy,
        lr=0.01,
        batch_size=64,
        epochs=3,
    )
    assert sorted((h["epoch"], h["pipeline"], h["samples"]) for h in result.history) == [
        (e, p, 704) for e in range(3) for p in range(2)
    ]
    assert result.max_param_diff() < 1e-6
    assert min(h["accuracy"] for h in result.history if h["epoch"] == 2) > 0.85


class Shifty(nn.Module):
    """Returns a tuple on full micro-batches and a bare tensor on a shorter one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 16)

    def forward(self, x):
        h = self.lin(x)
        return (h, h) if x.shape[0] == 8 else h


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 10)

    def forward(self, inp):
        return self.lin(inp[0] + inp[1]) if isinstance(inp, tuple) else self.lin(inp)


@pytest.mark.cluster
def test_a_stage_whose_structure_changes_ends_the_run_with_one_line_naming_it(shared_cluster, no_leaks):
    (X, Y), _ = digits()
    run = sdpipe.train(
        [Shifty(), Pair()],
        (X[:100], Y[:100]),  # batches of 32, 32, 32 and 4: the last one's micro-batches hold 1 sample
        stages=2,
        pipelines=1,
        batch_size=32,
        drop_last=False,
        epochs=1,
        cluster=shared_cluster,
    )
    with pytest.raises(Exception) as info:
        run.result(timeout=120)
    assert "model: stage 0's output float32[1, 16] is not structured as on the trial micro-batch" in str(info.value)
    assert run.status == "error"


SCRIPT = """
import sdpipe
from torch import nn
from sdpipe.data import digits


class Broken(nn.Module):
    def forward(self, x):
        return x[:, :16] if x.shape[0] == 8 else (x[:, :16],)


if __name__ == "__main__":
    (X, Y), _ = digits()
    run = sdpipe.train([Broken(), nn.Linear(16, 10)], (X[:100], Y[:100]), stages=2, pipelines=1, batch_size=32,
                       drop_last=False, epochs=1)
    try:
        run.result(timeout=120)
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
"""


@pytest.mark.cluster
def test_a_failed_rank_on_the_embedded_cluster_prints_no_traceback(tmp_path, no_leaks):
    """The run's error is one line; Dask's record of the failed task (its traceback) stays out of the terminal."""
    import subprocess
    import sys

    (tmp_path / "broken.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "broken.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("RunError: worker pipeline 0 stage 0") and "is not structured as" in out.stdout
    assert "Traceback" not in out.stderr and "Compute Failed" not in out.stderr, out.stderr[-3000:]
