"""Simulation worker processes: each is a client runtime (client/runtime.py) hosting a slice of the population
(simulations/population.py) against the run's coordinator; only the members sampled in a round get a model and
their data."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from fedpar.cli.task_options import task_label
from fedpar.client.stats import AgentStats
from fedpar.datasets import load_dataset
from fedpar.datasets.settings import DataFiles, DataSource, Partitioning
from fedpar.security.tls import client_tls_files
from fedpar.simulations.population import PopulationSlice, host_population
from fedpar.parallel.child_logs import log_like_parent
from fedpar.parallel.config import Device, Precision
from fedpar.parallel.device import flush_denormals
from fedpar.parallel.stopping import die_with_parent, dump_stacks_on_signal
from fedpar.sections import Seeded
from fedpar.simulations.config import Population
from fedpar.models.weights import weight_specs
from fedpar.task import FlowerAppReference, Partition, Task, TaskError, TaskReference, first_difference
from fedpar.tasks.flower_app import load_flower_app
from fedpar.tasks.reference import load_task
from fedpar.tasks.zoo import classifier_for


# Sections are listed last first: a dataclass takes its bases' fields from the last base on.
@dataclass(kw_only=True)
class WorkerConfig(Precision, Device, Population, FlowerAppReference, TaskReference, Partitioning, DataFiles,
                   DataSource, Seeded):
    """What one worker process needs to host its slice of the population: the simulation's sections it uses, as
    the simulation holds them (``device``: this worker's, e.g. "cuda:1"; the runner deals workers over the GPUs)."""

    server: str
    population: PopulationSlice  # the clients this process speaks for
    poll_seconds: float = 2.0
    client_batching: bool = False  # the seats of this process train as one batched model
    log_level: int = logging.WARNING  # of the worker's fedpar loggers: the parent's (simulate --log-level)
    certs_dir: str | None = None  # mutual TLS: DIR/ca.pem and DIR/HOST_ID.pem/.key (the host's); None: plaintext
    answers_messages: bool = False  # the Flower App's ServerApp drives: its members answer its Messages
    model_layout: list | None = None  # a task's: the coordinator's model (weight_specs), which the worker's must be

    def partition_of(self, index: int, agent_id: str) -> Partition:
        """The Partition of client ``index`` (``agent_id``) of this federation."""
        return Partition(index, self.clients, agent_id, self.partition, self.seed, self.val_fraction)


def worker_task(cfg: WorkerConfig, splits=None) -> Task:
    """The task this worker's clients train: ``--task``, loaded, or the zoo's classifier ``cfg.model`` on
    ``cfg.dataset`` (``splits``: that data, loaded already)."""
    if cfg.task is not None:
        return load_task(cfg.task, cfg.task_options)  # once per process: its data is loaded once
    if splits is None:
        splits = load_dataset(cfg.dataset, cfg.data_dir)
    return classifier_for(cfg.model, splits, cfg.dataset, cfg.examples_per_client)


TASK_FAILED_EXIT = 3  # a worker stopped by its task's own code, having said so in one line


def run_worker(cfg: WorkerConfig, splits=None) -> AgentStats:
    """Host ``cfg.population`` until the coordinator says training is over (``splits``: the loaded data); what
    its members did."""
    torch.set_num_threads(1)  # several worker processes share the cores
    flush_denormals()
    log_like_parent(cfg.log_level)
    tls = client_tls_files(cfg.population.host_id, cfg.certs_dir) if cfg.certs_dir else None
    if cfg.flower_app:  # the app's ClientApp trains the members (simulations/client_app_population.py)
        from fedpar.simulations.client_app_population import ClientAppPopulation
        members = ClientAppPopulation(cfg.population, load_flower_app(cfg.flower_app, cfg.run_config),
                                   cfg.partition_of, cfg.seed, cfg.trace_day_seconds,
                                   answers_messages=cfg.answers_messages)
        return host_population(cfg.server, cfg.population, None, cfg.partition_of, cfg.seed, cfg.seats,
                               cfg.poll_seconds, give_up_after=60.0, tls=tls, members=members).run()
    task = worker_task(cfg, splits)
    if cfg.model_layout is not None:
        same_model_as_the_coordinator(task, cfg.model_layout)
    return host_population(cfg.server, cfg.population, task, cfg.partition_of, cfg.seed, cfg.seats,
                           cfg.poll_seconds, cfg.device, cfg.precision, cfg.trace_day_seconds, give_up_after=60.0,
                           tls=tls, client_batching=cfg.client_batching, task_name=task_label(cfg)).run()


def same_model_as_the_coordinator(task: Task, layout: list) -> None:
    """TaskError unless ``task``'s model() in this worker process makes the coordinator's weights, ``layout``
    (weight_specs): a task that sizes its model by something of the process would fail its members every round."""
    ours, theirs = weight_specs(task.built_model()), [(name, dtype, tuple(shape)) for name, dtype, shape in layout]
    if ours != theirs:
        where = first_difference(ours, theirs, "the coordinator's had")
        raise TaskError(f"task {task.name!r}: model() made other weights in a worker process than in the "
                        f"coordinator's ({where}): the task must build the same model in every process (no sizes from "
                        "the process id, the clock or an unseeded draw)")


def run_worker_process(conn: Connection, dataset: str, data_dir: str | None, say: Connection | None = None) -> None:
    """Process target: load the data while the coordinator starts, then host the slice of the WorkerConfig that
    arrives on ``conn`` (None: the simulation was called off), and exit at once when it is done. ``say``: the
    workers' one turn to say that the task failed (simulations/worker_processes.py one_turn): the others fail alike,
    silently.

    A normal interpreter shutdown of a process that used gRPC and torch takes seconds here (measured: 4 s per
    worker), which every simulation would wait for; its host has closed its channels, so skip it.
    """
    die_with_parent()  # a simulation killed outright takes its workers with it
    dump_stacks_on_signal()
    try:
        splits, problem = (load_dataset(dataset, data_dir) if dataset else None), None  # a task loads its own
    except (ValueError, OSError) as exc:  # the coordinator loads the same data and says what is wrong, once
        splits, problem = None, exc
    try:
        cfg = conn.recv()
    except (EOFError, KeyboardInterrupt):  # the simulation stopped before it got here
        cfg = None
    if cfg is not None:
        if problem is not None:
            raise problem
        try:
            run_worker(cfg, splits)
        except TaskError as exc:  # e.g. client_data raised as the host counted its members' examples
            if _takes_turn(say):
                fix = f"the task ({cfg.task})" if cfg.task else f"the app ({cfg.flower_app})"
                print(f"fedpar simulate: {exc}: fix {fix}", file=sys.stderr, flush=True)
            os._exit(TASK_FAILED_EXIT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _takes_turn(turn: Connection | None) -> bool:
    """Whether this worker got the turn (worker_processes.one_turn); True without one."""
    return turn is None or os.read(turn.fileno(), 1) == b"."
