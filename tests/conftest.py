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

# The files with the most wall time, longest first (from `--durations=0` of a whole run, 2026-11-26, less what that
# day's in-process refusals saved; a file not listed keeps its place after them). A stale order costs only balance,
# never a test.
LONGEST_FIRST = [
    "simulations/test_resume_settings.py",
    "server/test_aggregator_ranks.py",
    "flower/test_server_app_deployed.py",
    "server/test_run_service.py",
    "test_composition_runs.py",
    "flower/test_server_app.py",
    "tasks/test_task_failures.py",
    "tasks/test_task_refusals.py",
    "simulations/test_simulate.py",
    "simulations/test_traces.py",
    "client/test_restart_mid_round.py",
    "client/test_hostile_coordinator.py",
    "test_composition.py",
    "client/test_engine_rank_failures.py",
    "parallel/test_train_mistakes.py",
    "test_packaging.py",
    "simulations/test_rank_loss.py",
    "client/test_engine_launch_env.py",
    "server/test_stop_signals.py",
    "parallel/test_train_stop_signals.py",
    "server/test_rank_stops.py",
    "test_cli_errors.py",
    "client/test_engine_agent.py",
    "parallel/test_train_cli.py",
    "simulations/test_lost_process.py",
    "test_docs.py",
    "server/test_full_disk.py",
    "parallel/test_world2.py",
    "simulations/test_hosts_in_a_service.py",
    "cli/test_train_mistakes.py",
    "server/test_rounds.py",
    "parallel/test_world4.py",
    "flower/test_flower_strategy_mistakes.py",
    "flower/test_flower_app_simulate.py",
    "simulations/test_secure_simulate.py",
    "test_cli_names.py",
    "simulations/test_simulate_workers_mismatch.py",
    "tasks/test_examples.py",
    "simulations/test_virtual_clock.py",
    "tasks/test_task_simulate.py",
    "simulations/test_host_rejoins.py",
    "server/test_crash_restart.py",
    "flower/test_client_app_population_mistakes.py",
    "server/test_load.py",
    "server/test_kill_anywhere.py",
    "simulations/test_simulate_ranks.py",
]


def pytest_collection_modifyitems(config, items):
    """Order the collected tests file by file, the files of LONGEST_FIRST first (a stable sort: within a file, and
    among the other files, the order stays pytest's)."""
    rank = {f"tests/{path}": i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
