"""Agent worker processes for simulations: each hosts a group of real agents, one thread apiece."""

from __future__ import annotations

import logging
import os
import sys
import threading
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.stats import AgentStats
from fedpar.client.task_trainer import TaskTrainer
from fedpar.datasets import load_dataset
from fedpar.datasets.settings import DataFiles, DataSource, Partitioning
from fedpar.security.sslcontext import client_ssl_context
from fedpar.security.tls import channel_credentials, client_tls_files
from fedpar.simulations.client_batching import BatchedTrainer, ClientBatcher
from fedpar.simulations.population import PopulationHost, PopulationSlice, client_seed
from fedpar.parallel.config import Device, Precision
from fedpar.parallel.device import flush_denormals
from fedpar.parallel.stopping import die_with_parent
from fedpar.sections import Seeded
from fedpar.simulations.config import Population
from fedpar.task import Partition, Task, TaskReference
from fedpar.tasks.reference import load_task
from fedpar.tasks.zoo import classifier_for


@dataclass
class AgentSpec:
    """One simulated agent: which share of the task's data it holds and how it misbehaves."""

    agent_id: str
    index: int = 0  # its share of the task's data: Partition.index of WorkerConfig.clients
    step_delay: float = 0.0  # seconds added per local step: a slow device
    drop_probability: float = 0.0  # chance per round of vanishing before the upload
    certs_dir: str | None = None  # mutual TLS with DIR/ca.pem and DIR/AGENT_ID.pem/.key; None: plaintext


# Sections are listed last first: a dataclass takes its bases' fields from the last base on.
@dataclass(kw_only=True)
class WorkerConfig(Precision, Device, Population, TaskReference, Partitioning, DataFiles, DataSource, Seeded):
    """What one worker process needs to build and run its agents: the simulation's sections it uses, as the
    simulation holds them (``device``: this worker's, e.g. "cuda:1"; the runner deals workers over the GPUs)."""

    server: str
    agents: list[AgentSpec]
    poll_seconds: float = 2.0
    client_batching: bool = False  # the process's agents of one round train as one batched model
    population: PopulationSlice | None = None  # virtual clients this process hosts (instead of ``agents``)
    log_level: int = logging.WARNING  # of the worker's fedpar loggers: the parent's (simulate --log-level)

    def partition_of(self, index: int, agent_id: str) -> Partition:
        """The Partition of client ``index`` (``agent_id``) of this federation."""
        return Partition(index, self.clients, agent_id, self.partition, self.seed, self.val_fraction)


def worker_task(cfg: WorkerConfig, splits=None) -> Task:
    """The task this worker's agents train: ``--task``, loaded, or the zoo's classifier ``cfg.model`` on
    ``cfg.dataset`` (``splits``: that data, loaded already)."""
    if cfg.task is not None:
        return load_task(cfg.task, cfg.task_options)  # once per process: its data is loaded once
    if splits is None:
        splits = load_dataset(cfg.dataset, cfg.data_dir)
    return classifier_for(cfg.model, splits, cfg.dataset, cfg.examples_per_client)


def build_agent(cfg: WorkerConfig, spec: AgentSpec, task: Task, compute_lock: threading.Lock | None = None,
                batcher: ClientBatcher | None = None) -> Agent:
    """A real agent over gRPC training ``task`` on its share of the task's data (``spec.index`` of
    ``cfg.clients``); ``batcher``: it trains in its process's client batch (the zoo's in-memory arrays only)."""
    files = client_tls_files(spec.agent_id, spec.certs_dir) if spec.certs_dir else None
    data = task.client_data(cfg.partition_of(spec.index, spec.agent_id))
    seed = client_seed(cfg.seed, spec.agent_id)
    torch.manual_seed(cfg.seed)
    if batcher is not None:
        trainer = BatchedTrainer(task.model(), data.train, data.val, batcher, seed=seed,
                                 seconds_per_step_delay=spec.step_delay, compute_lock=compute_lock, device=cfg.device)
    else:
        trainer = TaskTrainer(task, data, seed=seed, device=cfg.device, precision=cfg.precision,
                              seconds_per_step_delay=spec.step_delay, compute_lock=compute_lock)
    agent_cfg = AgentConfig(server=cfg.server, agent_id=spec.agent_id, poll_seconds=cfg.poll_seconds,
                            drop_probability=spec.drop_probability, give_up_after=60.0,
                            credentials=channel_credentials(files) if files else None, insecure=not files,
                            data_tls=client_ssl_context(files) if files else None,
                            seed=cfg.seed * 1_000_003 + zlib.crc32(spec.agent_id.encode()))  # own drops and jitter
    return Agent(agent_cfg, trainer)


def run_worker(cfg: WorkerConfig, splits=None) -> list[AgentStats]:
    """Run every agent of ``cfg`` in a thread until the coordinator shuts down (``splits``: the loaded data)."""
    torch.set_num_threads(1)  # several worker processes share the cores
    flush_denormals()
    logging.basicConfig(level=min(cfg.log_level, logging.WARNING), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("fedpar").setLevel(cfg.log_level)
    task = worker_task(cfg, splits)
    if cfg.population is not None:
        return PopulationHost(cfg.server, cfg.population, task, cfg.partition_of, cfg.seed, cfg.seats,
                              cfg.poll_seconds, cfg.device, cfg.precision, cfg.trace_day_seconds,
                              give_up_after=60.0).run()
    compute_lock = threading.Lock()  # this process's agents take turns on its CPU (see TaskTrainer)
    batcher = ClientBatcher(cfg.device, compute_lock) if cfg.client_batching else None
    return _run_agents([build_agent(cfg, spec, task, compute_lock, batcher) for spec in cfg.agents])


def _run_agents(agents: list[Agent]) -> list[AgentStats]:
    """Run each agent in a thread until the coordinator shuts down; the first agent's error is raised."""
    stats: list[AgentStats] = [AgentStats() for _ in agents]
    errors: list[BaseException] = []

    def _run(i: int) -> None:
        try:
            stats[i] = agents[i].run()
        except BaseException as exc:  # reported by the parent
            errors.append(exc)

    threads = [threading.Thread(target=_run, args=(i,), name=a.config.agent_id) for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return stats


def run_worker_process(conn: Connection, dataset: str, data_dir: str | None) -> None:
    """Process target: load the data while the coordinator starts, then run the agents of the WorkerConfig that
    arrives on ``conn`` (None: the simulation was called off), and exit at once when they are done.

    A normal interpreter shutdown of a process that used gRPC and torch takes seconds here (measured: 4 s per
    worker), which every simulation would wait for; its agents have closed their channels, so skip it.
    """
    die_with_parent()  # a simulation killed outright takes its agents with it
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
        run_worker(cfg, splits)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
