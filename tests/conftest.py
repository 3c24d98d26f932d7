"""The suite's processes share one bytecode cache, and the longest test files start first: `make test` gives pytest-xdist's workers whole files in collection order
(--dist loadfile --no-loadscope-reorder), so the long ones are shared out while the many short ones fill the gaps,
and the two workers finish together instead of one running a long file alone at the end."""

from __future__ import annotations

import os
import sys

# Some machines (this project's among them) set PYTHONDONTWRITEBYTECODE: every fedpar process a test starts would
# then compile fedpar's modules from source again (about 0.5 s of CPU each, for hundreds of processes). The suite's
# processes share one bytecode cache instead (__pycache__ is git-ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The files with the most wall time, longest first (from `--durations=0` of a whole run, 2026-11-28; a file not
# listed keeps its place after them). A stale order costs only balance, never a test.
LONGEST_FIRST = [
    "server/test_aggregator_ranks.py",
    "server/test_run_service.py",
    "test_composition_runs.py",
    "simulations/test_rank_loss.py",
    "server/test_stop_signals.py",
    "flower/test_server_app_deployed.py",
    "cli/test_train_refusals.py",
    "test_composition.py",
    "simulations/test_simulate_workers_coordinator.py",
    "simulations/test_resume_settings.py",
    "parallel/test_train_cli.py",
    "test_packaging.py",
    "parallel/test_stop_in_checkpoint.py",
    "client/test_restart_mid_round.py",
    "simulations/test_simulate_checkpoint_lock.py",
    "client/test_engine_rank_failures.py",
    "server/test_full_disk.py",
    "test_cli_errors.py",
    "simulations/test_simulate_user_refusals.py",
    "server/test_rounds.py",
    "parallel/test_train_stop_signals.py",
    "parallel/test_world2.py",
    "server/test_rank_stops.py",
    "simulations/test_lost_process.py",
    "simulations/test_resume_every_round_done.py",
    "test_qa73_cli_sighup.py",
    "server/test_kill_anywhere.py",
    "server/test_load.py",
    "server/test_metrics_port_cli.py",
    "server/test_crash_restart.py",
    "client/test_agent_misuse.py",
    "simulations/test_traces.py",
    "simulations/test_resume_refusal_first.py",
    "simulations/test_simulate.py",
    "tasks/test_task_failures.py",
    "server/test_secure_rounds.py",
    "tasks/test_examples.py",
    "simulations/test_qa73_data_same_model_own_task.py",
    "parallel/test_train_bar_interrupted.py",
    "test_docs.py",
    "simulations/test_host_rejoins.py",
    "client/test_engine_agent.py",
    "server/test_run_qa2_stopped_round.py",
    "simulations/test_simulate_workers_mismatch.py",
    "flower/test_server_app.py",
    "client/test_hostile_coordinator.py",
]


def pytest_collection_modifyitems(config, items):
    """Order the collected tests file by file, the files of LONGEST_FIRST first (a stable sort: within a file, and
    among the other files, the order stays pytest's)."""
    rank = {f"tests/{path}": i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
