"""The command line, run as a user would."""

import argparse
import re
import subprocess
import sys

import pytest


def sdpipe(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sdpipe.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["none", "sdpipe"])
def test_cli_train_prints_progress_and_summary(policy, no_leaks):
    out = sdpipe(
        "train", "--epochs", "2", "--pipelines", "2", "--stages", "2", "--policy", policy, "--schedule", "gpipe"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 2/2: 100%" in out.stderr  # tqdm writes its bars to stderr
    assert f"summary: 2 stages x 2 pipelines, policy={policy}, schedule=gpipe" in out.stdout
    assert out.stdout.count("held-out accuracy 0.") == 2


@pytest.mark.cluster
@pytest.mark.parametrize(
    "example, metric",
    [("gpt", "held-out perplexity"), ("resnet", "held-out accuracy")],
)
def test_cli_trains_the_gpt_and_resnet_examples(example, metric, no_leaks):
    out = sdpipe("train", "--example", example, "--epochs", "1", "--pipelines", "1", "--stages", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 1/1: 100%" in out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("  pipeline 0:"))
    assert f"{metric} " in line and "held-out loss" in line, out.stdout
    if example == "gpt":  # perplexity after one epoch, from 128 untrained
        assert float(line.split("held-out perplexity ")[1].split()[0]) < 40, line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "gossip"], "sdpipe: error: policy: 'gossip' is not one of sdpipe, allreduce, ps, adpsgd, none"),
        (["--pipelines", "0"], "sdpipe: error: pipelines: must be an integer >= 1, got 0"),
        (["--batch-size", "30"], "sdpipe: error: batch_size: 30 is not divisible into 4 micro-batches"),
        (["--cluster", "tcp://127.0.0.1:9"], "sdpipe: error: cluster: cannot reach a Dask scheduler"),
        (["--slowdown", "x"], "--slowdown: 'x' is not PIPELINE=FACTOR"),
    ],
)
def test_cli_bad_input_is_one_clear_line(args, message):
    out = sdpipe("train", *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args", [["--pipelines", "0"], ["--policy", "gossip"], ["--batch-size", "30"], ["--checkpoint-every", "2"]]
)
def test_cli_rejects_bad_options_before_loading_torch_or_data(args):
    code = (
        "import sys; from sdpipe.cli import main; rc = main(['train', *sys.argv[1:]]); "
        "print(rc, sorted(m for m in ('torch', 'sklearn', 'distributed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2 []", (out.stdout, out.stderr[-2000:])
    assert out.stderr.startswith("sdpipe: error: ") and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_cli_help_gives_every_flag_a_sentence_and_its_default(command):
    import argparse

    from sdpipe.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]
    flags = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    assert flags and all(a.help for a in flags), [a.dest for a in flags if not a.help]
    text = sdpipe(command, "--help", timeout=60).stdout
    assert " ".join(text.split()).count("(default: ") == len(flags), text


def test_cli_train_flags_are_the_train_config_fields():
    """Every TrainConfig field of a number or a string is a flag with the field's type, default and docstring;
    the flags given reach TrainConfig (and so train) under the field's name."""
    from dataclasses import fields

    from sdpipe.cli import _check, _plain, build_parser
    from sdpipe.config import TrainConfig, field_docs

    parser = build_parser()
    flags = {a.dest: a for a in parser._subparsers._group_actions[0].choices["train"]._actions}
    docs = field_docs(TrainConfig)
    scalar = [f for f in fields(TrainConfig) if f.name not in ("cuts", "heterogeneity", "scheduler", "rebalance")]
    for f in scalar:
        action = flags[f.name]
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":  # a pair of flags
            assert isinstance(action, argparse.BooleanOptionalAction), f.name
            assert action.option_strings == [flag, f"--no-{flag[2:]}"] and action.default == f.default, f.name
            assert action.help == _plain(docs[f.name]), f.name
            continue
        assert action.option_strings == [flag] and action.default == f.default, f.name
        kind = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}.get(f.type, str)
        assert action.type is kind and action.help == _plain(docs[f.name]), f.name
        # help as a reader wants it: values written out, no internal names or markup, "none" as defaults read
        assert not re.search(r"[A-Z]{3,}_?[A-Z]* \(|``|\bNone\b", action.help), (f.name, action.help)
    assert flags["policy"].metavar == "{sdpipe,allreduce,ps,adpsgd,none}"
    args = parser.parse_args(
        [
            "train",
            "--weight-decay",
            "0.01",
            "--host",
            "10.0.0.2",
            "--timeout",
            "30",
            "--batch-size",
            "64",
            "--slowdown",
            "1=2",
            "--model",
            "cnn",
            "--no-drop-last",
        ]
    )
    config, options = _check(args)
    assert config == TrainConfig(**options)
    assert (config.weight_decay, config.host, config.timeout, config.batch_size) == (0.01, "10.0.0.2", 30.0, 64)
    assert config.drop_last is False
    assert config.heterogeneity.slowdown == {1: 2.0} and config.cuts == (6,)
    parts = ("heterogeneity", "scheduler", "cuts", "rebalance")
    given = {f.name: getattr(args, f.name) for f in scalar}
    assert {k: v for k, v in config.to_dict().items() if k not in parts} == given


def test_cli_simulate_prints_throughput():
    out = sdpipe(
        "simulate", "--stages", "2", "--pipelines", "8", "--steps", "20", "--slowdown", "7=4", "--policy", "sdpipe"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "simulated 2 stages x 8 pipelines, policy=sdpipe:" in out.stdout and "samples/s" in out.stdout
    bad = sdpipe("simulate", "--policy", "gossip")
    assert bad.returncode == 2
    assert "sdpipe: error: policy: 'gossip' is not one of sdpipe, allreduce, ps, adpsgd, none" in bad.stderr
    ps = sdpipe(
        "simulate",
        "--profile",
        "resnet50",
        "--gbit",
        "10",
        "--policy",
        "ps",
        "--stages",
        "4",
        "--pipelines",
        "16",
        "--steps",
        "5",
    )
    assert ps.returncode == 0 and "simulated 4 stages x 16 pipelines, policy=ps:" in ps.stdout, ps.stderr[-2000:]
    # the profile is priced for the run's micro-batch, per sample: four times the batch trains at about the same
    # samples/s (priced for a fixed micro-batch, samples counted by the batch would differ fourfold)
    rates = []
    for batch in ("32", "128"):
        out = sdpipe("simulate", "--profile", "resnet50", "--policy", "none", "--epochs", "1", "--batch-size", batch)
        rates.append(float(out.stdout.split(" samples/s")[0].rsplit(" ", 1)[1]))
    assert 0.95 < rates[1] / rates[0] < 1.1, rates
    bad = sdpipe("simulate", "--profile", "gpt3")
    assert bad.returncode == 2 and "sdpipe: error: profile: 'gpt3' is not one of resnet50, bert-base" in bad.stderr


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("run.toml", "epoch = 3\n", "config: {path}: unknown field 'epoch'; allowed: backend, batch_size,"),
        ("run.toml", 'epochs = "ten"\n', "config: {path}: field 'epochs' must be an integer, got 'ten'"),
        ("run.toml", "epochs = 2\n[nested\n", "config: {path} is not valid TOML"),
        ("run.json", '{"model": "rnn"}', "config: {path}: field 'model' is 'rnn'; allowed: mlp, cnn"),
        (
            "run.json",
            '{"slowdown": {"x": 2}}',
            "config: {path}: field 'slowdown': --slowdown: 'x=2' is not PIPELINE=FACTOR",
        ),
        ("run.json", "[1, 2]", "config: {path} must hold a table of options, got list"),
        ("run.json", '{"pipelines": 0}', "pipelines: must be an integer >= 1, got 0"),
        ("run.json", '{"timeout": "soon"}', "config: {path}: field 'timeout' must be a number, got 'soon'"),
    ],
)
def test_cli_config_file_errors_name_the_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    out = sdpipe("train", "--config", str(path))
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("sdpipe: error: ") and message.format(path=path) in line, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.cluster
def test_cli_config_file_with_flags_winning_and_a_checkpoint(tmp_path, no_leaks):
    config = tmp_path / "run.toml"
    config.write_text(
        f'epochs = 5\nstages = 1\npipelines = 2\npolicy = "sdpipe"\nslowdown = {{ 1 = 2.0 }}\n'
        f'checkpoint-every = 1\ncheckpoint_dir = "{tmp_path / "ck"}"\n'
    )
    out = sdpipe("train", "--config", str(config), "--epochs", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 1/1: 100%" in out.stderr and "summary: 1 stages x 2 pipelines, policy=sdpipe" in out.stdout
    assert f"checkpoint: {tmp_path / 'ck' / 'epoch-0001'}" in out.stdout
    resumed = sdpipe("train", "--config", str(config), "--epochs", "2", "--resume-from", str(tmp_path / "ck"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "epoch 2/2: 100%" in resumed.stderr and "epoch 1/2" not in resumed.stderr
    assert "checkpoint: " + str(tmp_path / "ck" / "epoch-0002") in resumed.stdout


SCRIPT = """\
import sdpipe
from sdpipe.data import digits, digits_mlp

{indent_note}
train_data, eval_data = digits()
{body}
"""

TRAIN = (
    "run = sdpipe.train(digits_mlp(), train_data, eval_data=eval_data, stages=2, pipelines=1, epochs=1)\n"
    "print('accuracy', run.result().history[-1]['accuracy'])"
)


def test_a_script_without_the_main_guard_gets_one_line(tmp_path):
    script = tmp_path / "train_digits.py"
    script.write_text(SCRIPT.format(indent_note="# as a user writes it: no main guard", body=TRAIN))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == [lines[0]] and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("sdpipe: train_digits.py line 6 trains at the top level of the script")
    assert 'if __name__ == "__main__":' in lines[0]


@pytest.mark.cluster
def test_a_script_with_the_main_guard_trains(tmp_path, no_leaks):
    script = tmp_path / "train_digits.py"
    body = 'if __name__ == "__main__":\n' + "".join("    " + line + "\n" for line in TRAIN.splitlines())
    script.write_text(SCRIPT.format(indent_note="", body=body))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "accuracy 0." in out.stdout


def test_cli_scheduler_flags_change_the_policys_preset():
    """Every number, string and yes/no field of SchedulerPolicy is a --scheduler-... flag of train and simulate;
    those given change the chosen policy's preset (to TrainConfig.scheduler), the others keep it."""
    from dataclasses import fields

    from sdpipe.cli import _check, _scheduler, build_parser
    from sdpipe.core.policies import record
    from sdpipe.core.scheduler import SchedulerPolicy

    parser = build_parser()
    for command in ("train", "simulate"):
        dests = {a.dest for a in parser._subparsers._group_actions[0].choices[command]._actions}
        assert {f"scheduler_{f.name}" for f in fields(SchedulerPolicy)} <= dests
    args = parser.parse_args(["train", "--policy", "allreduce", "--scheduler-staleness", "3", "--no-scheduler-overlap"])
    assert _scheduler(args, "allreduce") == record("allreduce").scheduler.updated(staleness=3, overlap=False)
    config = _check(args)[0]
    assert config.scheduler_policy() == record("allreduce").scheduler.updated(staleness=3, overlap=False)
    args = parser.parse_args(["simulate", "--policy", "none"])
    assert _scheduler(args, "none") is None  # no flag given: the policy's preset stands
    assert not {k for k in vars(args)} & {f"scheduler_{f.name}" for f in fields(SchedulerPolicy)}
