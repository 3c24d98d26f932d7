"""--device: parsing, the GPU-count check that runs before any rank starts, and the CLI's one-line refusals."""

from __future__ import annotations

import pytest
import torch

from fedpar.parallel.config import ConfigurationError
from fedpar.parallel.device import backend_for, check_device_layout, device_kind, parse_device, resolve_device
from fedpar.simulations.runner import worker_devices


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:3", " CUDA:1 "])
def test_valid_specs_are_normalised(spec):
    assert parse_device(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cpu:0", "auto:1", "", "mps"])
def test_invalid_specs_are_refused_naming_the_forms(spec):
    with pytest.raises(ConfigurationError, match="auto, cpu, cuda or cuda:N"):
        parse_device(spec)


def test_auto_means_cuda_only_where_a_gpu_is_visible():
    assert device_kind("auto", gpus=0) == "cpu" and device_kind("auto", gpus=1) == "cuda"
    assert device_kind("cpu", gpus=8) == "cpu" and device_kind("cuda:2", gpus=0) == "cuda"


def test_layouts_that_fit_pass_and_say_which_device():
    assert check_device_layout("auto", 4, gpus=0) == "cpu"  # no GPU: auto is the CPU, any number of ranks
    assert check_device_layout("cpu", 8, gpus=8) == "cpu"
    assert check_device_layout("auto", 2, gpus=2) == "cuda"
    assert check_device_layout("cuda:1", 1, gpus=2) == "cuda"


def test_more_ranks_than_gpus_is_refused_with_the_count_and_the_ways_out():
    with pytest.raises(ConfigurationError) as info:
        check_device_layout("auto", 2, gpus=1)  # what `fedpar train --nproc 2` on a one-GPU box asks for
    message = str(info.value)
    assert "2 local ranks need 2 GPUs" in message and "has 1 visible" in message
    assert "use 1 rank(s) or fewer" in message and "--device cpu" in message and "gloo" in message


def test_gpu_requests_without_gpus_or_out_of_range_are_refused():
    with pytest.raises(ConfigurationError, match="needs a CUDA GPU, but torch sees none.*--device cpu"):
        check_device_layout("cuda", 1, gpus=0)
    with pytest.raises(ConfigurationError, match="has 2 visible GPU.*numbered 0 to 1"):
        check_device_layout("cuda:2", 1, gpus=2)
    with pytest.raises(ConfigurationError, match="names one GPU but 2 local ranks"):
        check_device_layout("cuda:0", 2, gpus=4)


def test_cuda_visible_devices_is_named_in_the_refusal(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigurationError, match="CUDA_VISIBLE_DEVICES='3'"):
        check_device_layout("auto", 2, gpus=1)


def test_each_rank_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda", 1)
        assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu"))
    assert backend_for(torch.device("cpu")) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"


def test_simulation_workers_are_dealt_over_the_gpus():
    assert worker_devices("auto", 3, gpus=0) == ["cpu"] * 3
    assert worker_devices("auto", 5, gpus=2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert worker_devices("cuda:1", 2, gpus=2) == ["cuda:1", "cuda:1"]
    assert worker_devices("cpu", 2, gpus=2) == ["cpu", "cpu"]


def _fedpar(capsys, *args: str) -> tuple[int, str]:
    """``fedpar ARGS`` in this process (no rank starts): its exit code and stderr."""
    from fedpar.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:  # an option argparse refuses
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has a GPU for each of 2 ranks")
def test_train_with_more_ranks_than_gpus_stops_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    code, err = _fedpar(capsys, "train", "--device", "cuda", "--nproc", "2", "--out", str(tmp_path / "run"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpar train: ") and "--device cpu" in lines[0]
    assert (f"has {gpus} visible" in lines[0]) if gpus else ("torch sees none" in lines[0])
    assert not (tmp_path / "run").exists()  # no rank ran


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has a GPU for each of 2 ranks")
def test_serve_with_more_aggregator_ranks_than_gpus_stops_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    code, err = _fedpar(capsys, "serve", "--insecure", "--port", "0", "--device", "cuda", "--aggregator-ranks", "2",
                        "--out", str(tmp_path / "run"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpar serve: ") and "--device cpu" in lines[0], err
    if torch.cuda.is_available():  # auto takes the GPU, and so needs one per rank too
        code, err = _fedpar(capsys, "serve", "--insecure", "--port", "0", "--aggregator-ranks", "2",
                            "--out", str(tmp_path / "run"))
        assert code == 2 and "2 local ranks need 2 GPUs" in err, err
    assert not (tmp_path / "run").exists()  # no rank ran


@pytest.mark.parametrize("command", ["client", "serve", "simulate"])
def test_every_role_refuses_a_bad_device_in_one_line(command, tmp_path, capsys):
    extra = {"client": ["--agent-id", "a", "--insecure"], "serve": ["--insecure", "--out", str(tmp_path)],
             "simulate": ["--out", str(tmp_path)]}[command]
    code, err = _fedpar(capsys, command, "--device", "gpu0", *extra)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == \
        f"fedpar {command}: --device 'gpu0' is not a device; use auto, cpu, cuda or cuda:N"
