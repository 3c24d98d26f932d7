"""A simulated population whose members train with a Flower App's ClientApp (``simulate --flower-app DIR``), under
fedpar's strategies or answering the app's own ServerApp's Messages (simulations/flower_app_run.py).

The population machinery is :class:`~fedpar.simulations.population.PopulationMembers`' (ids, drop-outs, traces, the
virtual clock); what differs is what a seat is: a :class:`~fedpar.client.flower_app_member.FlowerAppTrainer`, which
calls the ClientApp as member ``i`` (partition ``i`` of the population, the run config, the member's own
``Context.state``, kept in one bounded store per worker process). The ClientApp loads its own data: fedpar knows a
member's training-set size only from ``[tool.fedpar] train-examples`` (tasks/flower_app.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedpar.client.flower_app_member import (Answer, FlowerAppTrainer, MemberStates, answer_message,
                                             member_context, runs_config)
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.simulations.population import PopulationMembers, PopulationSlice, client_id
from fedpar.simulations.traces import DAY_SECONDS
from fedpar.task import ClientData, Partition, TaskError, raised
from fedpar.tasks.flower_app import UNKNOWN_TRAIN_EXAMPLES, FlowerApp, FlowerAppError


class ClientAppPopulation(PopulationMembers):
    """The member source of a worker hosting ``population`` with ``app``'s ClientApp (``seed``: the initial arrays'
    draw, the same as the coordinator's). ``answers_messages``: the app's ServerApp drives, so the members only
    answer its Messages (:meth:`answer`) and need no initial arrays (the app may name no model)."""

    def __init__(self, population: PopulationSlice, app: FlowerApp, partition_of: Callable[[int, str], Partition],
                 seed: int, day_seconds: float = DAY_SECONDS, states: MemberStates | None = None,
                 answers_messages: bool = False):
        self.app = app
        self.answers_messages = answers_messages
        self.initial = None if answers_messages else app.initial_arrays(seed)
        self.states = states if states is not None else MemberStates()
        super().__init__(population, None, partition_of, seed, day_seconds=day_seconds)

    def member_data(self, i: int) -> ClientData:
        """Member ``i``'s training-set size, as a range of that length (the ClientApp reads its own data); TaskError
        in one line when the app's ``train-examples`` fails."""
        if self.answers_messages:  # the ServerApp weighs its replies itself: train-examples is for fedpar's strategies
            return ClientData(range(UNKNOWN_TRAIN_EXAMPLES))
        partition = self._partition(i)
        try:
            return ClientData(range(self.app.train_examples(partition.index, partition.count)))
        except Exception as exc:  # the app's own function: one line from the worker, not its traceback
            said = str(exc) if isinstance(exc, FlowerAppError) else \
                f"{self.app.directory}: [tool.fedpar] train-examples raised {raised(exc)}"
            raise TaskError(f"{said} for {self.member_id(i)}") from exc

    def seat_trainers(self, seats: int) -> list:
        """``seats`` trainers over the app's ClientApp, sharing this process's member states."""
        if not len(self.pop):
            return []
        return [FlowerAppTrainer(self.app.client_app, self.app.run_config, self.initial, self.states)
                for _ in range(seats)]

    def assign(self, trainer, i: int, task: pb.TrainTask) -> None:
        """Call the ClientApp as member ``i`` (its node, partition and state)."""
        partition = self._partition(i)
        trainer.use_member(self.member_id(i), partition.index, partition.count, self.train_size(i))

    def answer(self, i: int, data: bytes, max_bytes: int, run_config: dict[str, Any] | None = None) -> Answer:
        """Member ``i``'s reply to the Flower Message in ``data`` (client/flower_app_member.py;
        ``run_config``: the task's)."""
        member, partition = self.member_id(i), self._partition(i)
        return answer_message(self.app.client_app, data, max_bytes, member, lambda run_id: member_context(
            member, partition.index, partition.count, runs_config(self.app.run_config, run_config),
            self.states.of(member), run_id))

    def _partition(self, i: int) -> Partition:
        number = int(self.pop.numbers[i])
        return self.partition_of(number, client_id(number))
