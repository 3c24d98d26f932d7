"""`fedpar export` as an operator of a service uses it. Of a run's outputs folder (STATE.runs/ID) while the run still
runs: its model is written as it ends, so the folder holds only its metrics and its checkpoints. It said the folder
'holds neither global.safetensors (a run's --out folder) nor LATEST (a coordinator checkpoint directory)', which reads
as a wrong folder; it now names the checkpoints folder to export, whose export is that checkpoint's model. Of a run id
(as `fedpar run get` takes): it said only that no such file exists; it now says how to get that run's model."""

from __future__ import annotations

import numpy as np
import torch

from fedpar.server.checkpoint import Checkpoint, save_checkpoint
from support.in_process import run_main


def test_export_of_a_running_service_runs_folder_names_its_checkpoints(tmp_path, capfd):
    run = tmp_path / "state.db.runs" / "3"  # what a service's run leaves while it runs
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    names = ["net.0.weight", "net.0.bias"]
    weights = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([0.5, -1.0], dtype=np.float32)]
    save_checkpoint(run / "checkpoints", Checkpoint(2, names, weights, {}, {"sampler": {}}))
    done = run_main(["export", str(run), "--to", str(tmp_path / "m.pt")], capfd)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        f"fedpar export: {run} is not a fedpar model: {run} holds no global.safetensors: its run has not ended (a "
        f"run writes it as it ends; one killed with kill -9 never does); export {run / 'checkpoints'} for its latest checkpoint's model"], done.stderr
    assert not (tmp_path / "m.pt").exists()
    done = run_main(["export", str(run / "checkpoints"), "--to", str(tmp_path / "m.pt")], capfd)  # as it says
    assert done.returncode == 0, done.stderr
    exported = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(exported) == names and all(np.array_equal(exported[n].numpy(), w) for n, w in zip(names, weights))


def test_export_of_a_run_id_says_how_to_get_that_runs_model(tmp_path, capfd):
    done = run_main(["export", "7", "--to", "m.pt"], capfd, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        "fedpar export: 7 does not exist; give a run's --out folder, a global.safetensors file or a coordinator "
        "checkpoint directory (a service's run 7? 'fedpar run get 7 --out DIR' downloads its model, then export "
        "DIR)"], done.stderr
    assert not (tmp_path / "m.pt").exists()
