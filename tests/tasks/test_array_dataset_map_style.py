"""fedpar's ArrayDataset (what load_csv_table and share_of give a task) is a map-style dataset as the own-task guide
promises: indexed, it gives one example as the built-in batching gives a row; a torch DataLoader batches it as the
built-in loop does; and a task that wraps it in its own Dataset trains under `fedpar simulate`."""

from __future__ import annotations

import textwrap

import torch
from torch.utils.data import DataLoader

from fedpar.datasets.tables import load_csv_table
from fedpar.task import Partition
from fedpar.tasks import share_of
from fedpar.tasks.data import default_batches
from support.own_task import write_table
from support.simulation_runs import simulate_rows

WRAPPING_TASK = textwrap.dedent("""
    from torch import nn
    from torch.utils.data import Dataset

    from fedpar import ClientData, Task
    from fedpar.datasets.tables import load_csv_table
    from fedpar.tasks import share_of


    class Wrapped(Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]


    def task(csv: str) -> Task:
        table = load_csv_table(csv)

        def client_data(partition):
            share = share_of(table.train, partition)
            return ClientData(Wrapped(share.train), share.val)

        return Task(model=lambda: nn.Linear(table.input_shape[0], table.num_classes), client_data=client_data,
                    test_data=lambda: Wrapped(table.test), loss=nn.functional.cross_entropy)
""")


def test_indexing_and_a_dataloader_give_what_the_built_in_batching_gives(tmp_path):
    train = share_of(load_csv_table(write_table(tmp_path / "table.csv")).train, Partition(0, 4)).train
    inputs, target = train[0]
    assert inputs.dtype == torch.float32 and inputs.shape == (4,)
    assert target.dtype == torch.int64 and target.ndim == 0
    whole = next(default_batches(train, len(train)))
    assert torch.equal(inputs, whole[0][0]) and torch.equal(target, whole[1][0])
    assert torch.equal(train[-1][0], whole[0][-1])
    for (x, y), (bx, by) in zip(DataLoader(train, batch_size=8), default_batches(train, 8)):
        assert torch.equal(x, bx) and torch.equal(y, by)
    assert sum(len(y) for _, y in DataLoader(train, batch_size=8, shuffle=True)) == len(train)


def test_a_task_wrapping_it_in_its_own_dataset_trains(tmp_path):
    csv = write_table(tmp_path / "table.csv")
    (tmp_path / "wrap_task.py").write_text(WRAPPING_TASK)
    _, rows = simulate_rows(task=f"{tmp_path / 'wrap_task.py'}:task", task_options={"csv": str(csv)}, clients=2,
                            rounds=1, local_epochs=1, seed=1, workers=1, out=str(tmp_path / "run"))
    assert rows[0]["reported"] == 2 and not rows[0].get("training_error")
