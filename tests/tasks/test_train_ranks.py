"""`fedpar train --task --nproc 2 --fsdp 2`: the task's model, data, loss and optimizer on two FSDP2 ranks of the
engine (gloo), a real 2-rank run."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file

from fedpar.cli.main import main
from support.own_task import EXAMPLE, write_table


def test_two_fsdp_ranks_take_the_steps_one_process_takes_in_its_order(tmp_path, capsys):
    """240 training rows in batches of 64 (the last of 48): each epoch both runs draw the same order (the engine's
    ranks take halves of each batch) and FSDP averages the ranks' gradients, which is the gradient of the mean over
    the batch, so AdamW (on each rank's shard) moves both runs' weights alike."""
    csv = write_table(tmp_path / "table.csv")
    common = ["train", "--task", EXAMPLE, "--task-option", f"csv={csv}", "--task-option", "hidden=8", "--epochs", "3",
              "--lr", "0.05", "--batch-size", "64", "--no-plot", "--device", "cpu"]  # both on the CPU: compared
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--nproc", "2", "--fsdp", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = load_file(tmp_path / "one" / "global.safetensors"), load_file(tmp_path / "two" / "global.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-4, atol=1e-6)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (summary["ranks"], summary["steps"], summary["examples"]) == (2, 3 * 4, 3 * 240)
    first = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["test_accuracy"] == first["test_accuracy"]  # rank 0 evaluates the whole test set
    capsys.readouterr()


def test_a_task_with_its_own_train_hook_is_refused_on_ranks_in_one_line(tmp_path, capsys):
    hook = tmp_path / "hooked.py"
    hook.write_text("import torch\nfrom torch import nn\nfrom fedpar import ClientData, Task\n"
                    "def task():\n"
                    "    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))\n"
                    "    return Task(model=lambda: nn.Linear(2, 2), client_data=lambda p: ClientData(data),\n"
                    "                train=lambda *a: (0, {}), loss=nn.functional.cross_entropy)\n")
    assert main(["train", "--task", f"{hook}:task", "--nproc", "2", "--device", "cpu",
                 "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("has its own train hook, which trains in one process; drop "
                                                    "--nproc and the engine options (--fsdp, --dp-replicate, --tp; "
                                                    "and torchrun)")
