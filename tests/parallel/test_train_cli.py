"""`fedpar train` end to end: a real 2-rank FSDP run on digits through the command line, and config errors."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedpar.cli.config import load_toml_section
from fedpar.parallel.config import (ConfigurationError, ParallelConfig, ParallelLayout, TrainConfig,
                                   train_config_from_dict)
from support.processes import children


# Process start-up dominates (7-18 s per launch when idle); on a 2-core box shared with other jobs a
# launch plus its lazy imports has taken several minutes, so allow more than the suite's 300 s default.
pytestmark = pytest.mark.timeout(900)

# Multi-rank runs here are gloo on the CPU on every machine, so their figures do not depend on the GPUs present
# (tests/parallel/test_cuda.py covers NCCL and the GPU paths).
GLOO = ("--device", "cpu")


# One FSDP run of 2 epochs on 2 ranks, checkpointed every 20 steps: the summary test reads it, and the SIGKILL test
# compares a killed and resumed run with it (ceil(1437 / 32) = 45 batches per epoch).
FSDP_STEPS = 2 * 45


def _fsdp_args(out: Path, *extra: str) -> list[str]:
    return ["--model", "mlp", "--dataset", "digits", "--epochs", "2", "--nproc", "2", "--dp-replicate", "1",
            "--fsdp", "2", "--batch-size", "32", "--lr", "0.05", "--log-every", "1", "--checkpoint-every", "20",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The uninterrupted run: its folder, and its exit code and output (`fedpar train`'s main, run in this process,
    launches the two ranks; the launcher prints the summary)."""
    from fedpar.cli.main import main

    out = tmp_path_factory.mktemp("fsdp") / "straight"
    argv = ["train", *GLOO, *_fsdp_args(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    # The ranks are spawned processes that write to file descriptor 1 (rank 0's epoch lines): send it to a file too.
    with tempfile.TemporaryFile("w+") as ranks_out, pytest.MonkeyPatch.context() as mp, \
            contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(name, raising=False)
        fd1 = os.dup(1)
        os.dup2(ranks_out.fileno(), 1)
        try:
            code = main(argv)
        finally:
            os.dup2(fd1, 1)
            os.close(fd1)
        ranks_out.seek(0)
        printed = stdout.getvalue() + ranks_out.read()
    return out, subprocess.CompletedProcess(argv, code, printed, stderr.getvalue())


def test_train_two_ranks_fsdp_writes_metrics_summary_and_plot(fsdp_run):
    out, proc = fsdp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == FSDP_STEPS
    assert summary["test_accuracy"] > 0.85  # an MLP reaches ~0.95 on digits in 2 epochs
    assert summary["samples_per_second"] > 0 and summary["wall_seconds"] > 0
    assert len(summary["peak_memory_bytes"]) == 2 and min(summary["peak_memory_bytes"]) > 10 * 2**20
    states = summary["model_state_bytes"]
    assert abs(states[0] - states[1]) / states[0] < 0.1  # FSDP: each rank holds half
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["epoch"] for r in evals] == [0, 1]
    assert evals[-1]["test_accuracy"] == summary["test_accuracy"]
    train = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(train) == FSDP_STEPS and train[-1] < train[0]
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "test_accuracy" in proc.stdout


def test_train_rejects_degrees_that_do_not_multiply_to_the_world_size(tmp_path: Path, capsys, monkeypatch):
    from fedpar.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["train", "--model", "gpt", "--dataset", "text", "--nproc", "2", *GLOO, "--dp-replicate", "1",
                 "--tp", "3", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "multiply" in err and "--nproc" in err
    assert not any(tmp_path.iterdir())  # rejected before any rank started


def test_parallel_config_infers_one_degree_and_explains_bad_settings():
    assert ParallelConfig(dp=1, fsdp=-1, tp=2).resolved(8).fsdp == 4
    assert ParallelConfig().resolved(3).dp == 3
    with pytest.raises(ConfigurationError, match="only one degree"):
        ParallelConfig(dp=-1, fsdp=-1).resolved(4)
    with pytest.raises(ConfigurationError, match="stages-per-rank"):
        ParallelConfig(dp=1, pp=2, pp_schedule="interleaved1f1b").resolved(2)
    with pytest.raises(ConfigurationError, match="use --fsdp"):
        ParallelConfig(dp=2, tp=2).resolved(4)
    cfg = TrainConfig(batch_size=30, parallel=ParallelConfig(dp=4).resolved(4))
    with pytest.raises(ConfigurationError, match="multiple of 4"):
        cfg.check()


def test_interleaved_schedule_microbatches_must_be_a_multiple_of_its_rounds():
    def interleaved(pp: int, microbatches: int) -> ParallelConfig:
        return ParallelConfig(dp=1, pp=pp, stages_per_rank=2, pp_schedule="interleaved1f1b",
                              microbatches=microbatches).resolved(pp)

    # torch: rounds = max(1, microbatches // pp), and microbatches % rounds must be 0 (its docstring examples).
    for pp, microbatches in [(2, 3), (2, 4), (2, 6), (4, 4), (4, 5), (4, 10), (4, 12)]:
        assert interleaved(pp, microbatches).microbatches == microbatches
    with pytest.raises(ConfigurationError, match=r"5 // 2 = 2 rounds .* use --microbatches 4 or 6"):
        interleaved(2, 5)
    with pytest.raises(ConfigurationError, match=r"9 // 4 = 2 rounds .* use --microbatches 8 or 10"):
        interleaved(4, 9)
    with pytest.raises(ConfigurationError, match=r"11 // 4 = 2 rounds .* use --microbatches 10 or 12"):
        interleaved(4, 11)
    # The other schedules have no such rule.
    assert ParallelConfig(dp=1, pp=2, pp_schedule="1f1b", microbatches=5).resolved(2).microbatches == 5


@pytest.mark.parametrize("scaling, warmup, base_lr", [("linear", 4, 0.2), ("sqrt", 3, 0.1 * 2 ** 0.5),
                                                      ("none", 0, 0.1)])
def test_logged_lr_follows_the_warmup_and_the_batch_size_scaling(tmp_path: Path, monkeypatch, scaling, warmup,
                                                                 base_lr):
    """One in-process run: the lr of every step is lr x scaling(128 / 64) x min(1, step / warmup)."""
    from fedpar.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--dataset", "digits", "--nproc", "1", "--max-steps", "6",
                 "--batch-size", "128", "--base-batch-size", "64", "--lr", "0.1", "--lr-scaling", scaling,
                 "--warmup-steps", str(warmup), "--log-every", "1", "--no-plot", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
    expected = {step: base_lr * (min(1.0, step / warmup) if warmup else 1.0) for step in lrs}
    assert lrs == pytest.approx(expected, rel=1e-12)
    if warmup:
        assert lrs[1] == pytest.approx(base_lr / warmup) and lrs[warmup] == pytest.approx(base_lr)


def test_the_step_bar_shows_each_step_with_its_own_loss(tmp_path: Path, monkeypatch):
    """On a terminal the bar said 'loss nan' until the first log interval: it was shown before the loss was read."""
    from fedpar.cli.main import main
    from fedpar.cli.progress import StepBar

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shown = []
    monkeypatch.setattr(StepBar, "shows_steps", lambda self: True)
    monkeypatch.setattr(StepBar, "step", lambda self, done, total, note="": shown.append((done, total, note)))
    # on the CPU: on a GPU the bar shows the newest loss that has arrived, none at first (tests/parallel/
    # test_loss_readout.py), so that the step need not wait for its loss
    assert main(["train", "--model", "mlp", "--dataset", "digits", "--nproc", "1", "--max-steps", "4",
                 "--log-every", "3", "--no-plot", "--device", "cpu", "--out", str(tmp_path / "run")]) == 0
    assert [(done, total) for done, total, _ in shown] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    losses = [float(note.removeprefix("loss ")) for _, _, note in shown]
    assert all(math.isfinite(loss) and 0 < loss < 10 for loss in losses), shown
    assert len(set(losses)) == 4, shown  # each step's own loss, not the last logged one


def test_lr_scaling_rules():
    assert TrainConfig(lr=0.1, batch_size=256, base_batch_size=64, lr_scaling="linear").scaled_lr() == pytest.approx(0.4)
    assert TrainConfig(lr=0.1, batch_size=256, base_batch_size=64, lr_scaling="sqrt").scaled_lr() == pytest.approx(0.2)
    assert TrainConfig(lr=0.1, batch_size=256, base_batch_size=64).scaled_lr() == pytest.approx(0.1)


def test_toml_config_with_command_line_overrides(tmp_path: Path):
    path = tmp_path / "train.toml"
    path.write_text('[train]\nmodel = "gpt"\nlr = 0.01\n[train.parallel]\ntp = 2\npp = 2\n')
    cfg = train_config_from_dict({**load_toml_section(path, "train"), "lr": 0.02, "pp": 1})
    assert (cfg.model, cfg.lr, cfg.parallel.tp, cfg.parallel.pp) == ("gpt", 0.02, 2, 1)
    path.write_text('[train]\nlearning_rate = 1\n')
    with pytest.raises(ConfigurationError, match="learning_rate"):
        train_config_from_dict(load_toml_section(path, "train"))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b"resource_tracker"


def test_train_sigkilled_mid_run_resumes_and_ends_exactly_like_an_uninterrupted_run(tmp_path: Path, fsdp_run, capsys,
                                                                                  monkeypatch):
    from fedpar.cli.main import main

    straight, proc = fsdp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    crashed = tmp_path / "crashed"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "train", *GLOO, *_fsdp_args(crashed, "--no-plot")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = crashed / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        # Kill rank 1 (as the kernel's OOM killer would) once a checkpoint exists and training went on.
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            if steps and max(steps) >= 30:
                ranks = [p for p in children(proc.pid) if b"resource_tracker" not in _cmdline(p)]
                os.kill(ranks[-1], signal.SIGKILL)
                break
            time.sleep(0.02)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, f"the run finished before it could be killed; make it longer: {err[-2000:]}"
    assert not (crashed / "summary.json").exists()
    (said,) = [line for line in err.splitlines() if line.startswith("fedpar train:")]
    # it said what happened and what to do next (QA: no next step, and '--debug shows the traceback' of a kill)
    assert "was killed by SIGKILL" in said and "; the same command resumes from its checkpoint step-" in said, err
    assert "--debug" not in said and "Traceback" not in err, err
    # The same command again, resumed by `fedpar train`'s main in this process (it spawns the two ranks itself).
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", *GLOO, *_fsdp_args(crashed, "--no-plot")]) == 0, capsys.readouterr().err[-3000:]
    a = json.loads((straight / "summary.json").read_text())
    b = json.loads((crashed / "summary.json").read_text())
    assert b["resumed_from_step"] in range(20, FSDP_STEPS, 20) and b["steps"] == a["steps"] == FSDP_STEPS
    assert b["test_accuracy"] == a["test_accuracy"]

    def rows(out: Path, kind: str) -> dict[int, dict]:
        return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == kind}

    la, lb = rows(straight, "train"), rows(crashed, "train")
    assert all(la[s]["loss"] == lb[s]["loss"] for s in la if s > b["resumed_from_step"])  # bit-identical
    ea, eb = rows(straight, "eval"), rows(crashed, "eval")
    assert all(ea[s] == eb[s] for s in ea if s > b["resumed_from_step"])  # the epochs' evaluations too


# ------------------------------------------------- config files with nested tables, start-up validation
def _tiny_text(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text("to be or not to be, that is the question. " * 60, encoding="utf-8")
    return path


def _parsed_train_config(argv: list[str]) -> TrainConfig:
    from fedpar.cli.config import apply_config_defaults
    from fedpar.cli.main import build_parser
    from fedpar.cli.train import config_from_args

    parser = build_parser()
    apply_config_defaults(parser._subparsers._group_actions[0].choices["train"], argv[1:], "train")
    return config_from_args(parser.parse_args(argv))


def test_cli_config_file_nested_train_tables_are_honoured_and_flags_override_them(tmp_path: Path, capsys):
    from fedpar.cli.main import main

    toml = tmp_path / "train.toml"
    toml.write_text('[train]\nmodel = "gpt"\ndataset = "text"\nlr = 0.01\n'
                    '[train.parallel]\ntp = 2\npp = 2\nmicrobatches = 8\npp-schedule = "gpipe"\n'
                    '[train.model_kwargs]\nn_layer = 2\nd_model = 32\n')
    cfg = _parsed_train_config(["train", "--config", str(toml), "--pp", "1", "--model-arg", "n_layer=3"])
    assert (cfg.model, cfg.lr) == ("gpt", 0.01)
    p = cfg.parallel
    assert (p.tp, p.pp, p.microbatches, p.pp_schedule) == (2, 1, 8, "gpipe")  # --pp on the command line wins
    assert cfg.model_kwargs == {"n_layer": 3, "d_model": 32}
    # Without a [train] table the top level is read; other subcommands' tables there are left alone.
    flat = tmp_path / "flat.toml"
    flat.write_text('model = "gpt"\n[parallel]\ntp = 2\n[serve]\nport = 1\n[serve.strategy_options]\neta = 1\n')
    cfg = _parsed_train_config(["train", "--config", str(flat)])
    assert (cfg.model, cfg.parallel.tp) == ("gpt", 2)
    with pytest.raises(SystemExit):
        main(["train", "--config", str(toml), "--help"])
    help_text = capsys.readouterr().out
    assert "tensor-parallel degree (mlp, gpt) (default: 2)" in help_text
    assert "pipeline microbatches per step (default: 8)" in help_text


def test_cli_config_file_errors_name_the_table(tmp_path: Path, capsys, monkeypatch):
    from fedpar.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    toml = tmp_path / "train.toml"
    toml.write_text("[train]\ntp = 2\n[train.parallel]\ntp = 1\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "tp is set twice, in [train] and in [train.parallel]" in capsys.readouterr().err
    toml.write_text("[train.parallel]\ntensor_parallel = 2\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "unknown option(s) for 'train': parallel.tensor_parallel;" in capsys.readouterr().err
    toml.write_text("[train.parallel]\nfdsp = 2\n")  # a typo: the key as written, and the one it misspells
    assert main(["train", "--config", str(toml)]) == 2
    assert "unknown option(s) for 'train': parallel.fdsp (did you mean parallel.fsdp?);" in capsys.readouterr().err


@pytest.mark.parametrize("extra, expected", [
    (["--pp", "2", "--model-arg", "n_layer=1"],
     "1 transformer blocks but --pp 2 x --stages-per-rank 1 = 2 pipeline stages"),
    (["--pp", "2", "--stages-per-rank", "2", "--pp-schedule", "interleaved1f1b", "--microbatches", "4",
      "--model-arg", "n_layer=3"], "(--model-arg n_layer=4)"),
    (["--tp", "2", "--model-arg", "n_head=3", "--model-arg", "d_model=36"],
     "--tp 2 cannot split the attention heads: block 0 has n_heads=3"),
    (["--tp", "2", "--model-arg", "ffn_hidden=33"], "--tp 2 cannot split the feed-forward layer"),
    (["--pp", "2", "--mixed-precision", "bf16"], "on CPU only FSDP2 (--fsdp > 1) trains in bf16"),
    (["--dp-replicate", "2", "--mixed-precision", "bf16"], "use --mixed-precision fp32 (or auto)"),
    (["--pp", "2", "--stages-per-rank", "2", "--pp-schedule", "interleaved1f1b", "--microbatches", "5",
      "--batch-size", "40", "--model-arg", "n_layer=4"], "use --microbatches 4 or 6"),
])
def test_train_refuses_bad_layouts_before_any_rank_starts(tmp_path: Path, capsys, monkeypatch, extra, expected):
    from fedpar.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    argv = ["train", "--model", "gpt", "--dataset", "text", "--data-path", str(_tiny_text(tmp_path)),
            "--nproc", "2", *GLOO, "--out", str(out), *extra]
    if "--dp-replicate" not in extra:
        argv += ["--dp-replicate", "1"]
    started = time.perf_counter()
    assert main(argv) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists() and time.perf_counter() - started < 5  # refused in the launcher, nothing spawned


@pytest.mark.parametrize("extra, expected", [
    (["--dataset", "mnist"], "--dataset mnist needs --data-path DIR holding train.npz"),
    (["--dataset", "mnist", "--data-path", "NOWHERE"], "MNIST folder NOWHERE does not exist"),
    (["--dataset", "text"], "--dataset text needs --data-path FILE"),
    (["--model", "gpt"], "the gpt model trains on --dataset text"),
    (["--model", "mlp", "--dataset", "text", "--data-path", "TEXT"],  # gpt there unless --model says otherwise
     "--dataset text is a language-modelling corpus; use --model gpt"),
    (["--model-arg", "depth=3"], "model 'mlp' does not take depth"),
])
def test_train_says_a_data_or_model_mistake_in_one_line_before_any_rank_starts(tmp_path: Path, capsys, monkeypatch,
                                                                               extra, expected):
    from fedpar.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    extra = [str(_tiny_text(tmp_path)) if a == "TEXT" else str(tmp_path / "nowhere") if a == "NOWHERE" else a
             for a in extra]
    assert main(["train", "--nproc", "2", *GLOO, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedpar train: ") and len(err.strip().splitlines()) == 1, err
    assert expected.replace("NOWHERE", str(tmp_path / "nowhere")) in err
    assert not out.exists()  # refused in the launcher, nothing spawned


def test_train_refuses_a_layout_given_in_a_config_file(tmp_path: Path, capsys, monkeypatch):
    from fedpar.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    toml = tmp_path / "train.toml"
    toml.write_text(f'[train]\nmodel = "gpt"\ndataset = "text"\ndata_path = "{_tiny_text(tmp_path)}"\n'
                    f'out = "{tmp_path / "run"}"\n[train.parallel]\ndp_replicate = 1\npp = 2\n'
                    '[train.model_kwargs]\nn_layer = 1\n')
    assert main(["train", "--config", str(toml), "--nproc", "2", *GLOO]) == 2
    assert "--pp 2 x --stages-per-rank 1 = 2 pipeline stages" in capsys.readouterr().err


def test_mixed_precision_resolves_to_what_really_applies():
    from fedpar.parallel.precision import uses_autocast

    def layout(device: str, **kw) -> ParallelLayout:
        degrees = {"dp": 1, **kw}
        world = 1
        for name in ("dp", "fsdp", "tp", "pp"):
            world *= degrees.get(name, 1)
        return ParallelConfig(**degrees, microbatches=2).resolved(world, device)

    def resolve(device: str, **kw) -> str:
        return layout(device, **kw).precision

    assert [resolve("cpu", mixed_precision=m) for m in ("auto", "fp32")] == ["fp32", "fp32"]
    assert resolve("cpu", fsdp=2, mixed_precision="bf16") == "bf16"  # FSDP2's MixedPrecisionPolicy applies it
    assert resolve("cuda", pp=2, fsdp=2) == "bf16" and resolve("cuda", tp=2) == "bf16"
    assert resolve("cuda", pp=2) == "fp32"  # auto: nothing would apply bf16 to bare pipeline stages
    with pytest.raises(ConfigurationError, match="pipeline stages"):
        resolve("cuda", pp=2, mixed_precision="bf16")
    with pytest.raises(ConfigurationError, match="on CPU only FSDP2"):
        resolve("cpu", tp=2, mixed_precision="bf16")
    assert uses_autocast(layout("cuda", tp=2))
    assert not uses_autocast(layout("cuda", fsdp=2))


def test_a_layout_is_resolved_once_frozen_and_passed_to_the_ranks_as_it_is():
    import pickle

    from fedpar.parallel.config import layout_for

    layout = ParallelConfig(dp=-1, fsdp=2).resolved(4, "cpu")
    assert (layout.dp, layout.world_size, layout.device_type, layout.precision) == (2, 4, "cpu", "fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.fsdp = 4
    assert layout_for(layout, 4, "cpu") is layout  # a rank uses the launcher's layout, resolving nothing again
    with pytest.raises(ConfigurationError, match="resolved for 4 cpu rank"):
        layout_for(layout, 2, "cpu")
    assert pickle.loads(pickle.dumps(layout)) == layout  # what spawn does between our own processes
    cfg = TrainConfig(batch_size=8, parallel=ParallelConfig(dp=2)).resolved(2, "cpu")
    assert isinstance(cfg.parallel, ParallelLayout) and cfg.parallel.world_size == 2


def _stale_lock(out: Path) -> None:
    """OUT/.fedpar.lock as a killed run leaves it: its holder's pid, that process gone."""
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / ".fedpar.lock").write_text(gone.stdout)


def test_train_under_torchrun_takes_its_ranks_from_the_environment_and_a_pipeline_from_a_config_file(
        tmp_path: Path):
    """One real launch: torchrun starts the ranks and sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*, and `fedpar train
    --config`, whose [train.parallel] asks for --pp 2, only joins them and trains a pipelined GPT. Into an --out
    holding a crashed run's stale lock, which it takes over and leaves no lock behind (a zoo model's run: see
    test_a_task_run_under_torchrun_leaves_no_lock_in_its_out_folder_not_even_a_crashed_runs)."""
    out = tmp_path / "run"
    _stale_lock(out)
    toml = tmp_path / "train.toml"
    toml.write_text(f'[train]\nmodel = "gpt"\ndataset = "text"\ndata_path = "{_tiny_text(tmp_path)}"\n'
                    'batch_size = 8\nblock_size = 16\nlr = 0.003\noptimizer = "adamw"\neval_batches = 0\n'
                    '[train.parallel]\ndp_replicate = 1\npp = 2\nmicrobatches = 2\npp_schedule = "gpipe"\n'
                    '[train.model_kwargs]\nn_layer = 2\nn_head = 2\nd_model = 32\n')
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
           "OMP_NUM_THREADS": "1"}
    # torch.distributed.run is torchrun's module: found wherever torch is, even when no torchrun script is on PATH.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",  # loopback
                           "--nproc_per_node=2", "-m", "fedpar", "train", "--config", str(toml), *GLOO,
                           "--max-steps", "6", "--log-every", "3", "--no-plot", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["backend"], len(summary["peak_memory_bytes"])) == (2, "gloo", 2)
    par = summary["config"]["parallel"]
    assert (par["pp"], par["microbatches"], par["pp_schedule"], par["dp"]) == (2, 2, "gpipe", 1)
    assert summary["config"]["model_kwargs"] == {"n_layer": 2, "n_head": 2, "d_model": 32}
    assert summary["steps"] == 6 and summary["precision"] == "fp32"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["kind"] == "train"]
    assert math.isfinite(summary["val_loss"]) and train[-1] < train[0]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


_LINEAR_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task
from fedpar.tasks import share_of

X = torch.randn(80, 10, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()
TRAIN, TEST = TensorDataset(X[:64], Y[:64]), TensorDataset(X[64:], Y[64:])

def task():
    return Task(model=lambda: nn.Linear(10, 2), client_data=lambda p: share_of(TRAIN, p),
                test_data=lambda: TEST, loss=nn.functional.cross_entropy)
"""


def test_a_task_run_under_torchrun_leaves_no_lock_in_its_out_folder_not_even_a_crashed_runs(tmp_path: Path):
    """Rank 0, which holds --out, ended by os._exit (parallel/init.py exit_rank_process), skipping the with block that
    lets the lock go: OUT/.fedpar.lock stayed after every torchrun run. The stale lock a killed run left (its holder
    gone, its pid in it) is taken over, and goes with this run too. A --task run here; a zoo model's torchrun run is
    checked the same in test_train_under_torchrun_takes_its_ranks_from_the_environment_and_a_pipeline_from_a_config_file
    (one launch for both)."""
    out = tmp_path / "out"
    _stale_lock(out)
    (tmp_path / "tasks.py").write_text(_LINEAR_TASK)
    chosen = ["--task", "tasks.py:task"]
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "fedpar", "train", *chosen, *GLOO, "--max-steps", "2", "--no-plot", "--out", "out"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
