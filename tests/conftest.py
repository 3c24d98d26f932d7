"""The longest test files start first: `make test` gives pytest-xdist's workers whole files in collection order
(--dist loadfile --no-loadscope-reorder), so the long ones are shared out while the many short ones fill the gaps,
and the two workers finish together instead of one running a long file alone at the end."""

from __future__ import annotations

# The files with the most wall time, longest first (from `--durations` of a whole run; a file not listed keeps its
# place after them). A stale order costs only balance, never a test.
LONGEST_FIRST = [
    "server/test_run_service.py",
    "tasks/test_examples.py",
    "test_packaging.py",
    "server/test_aggregator_ranks.py",
    "test_composition.py",
    "test_composition_runs.py",
    "test_cli_errors.py",
    "parallel/test_train_cli.py",
    "server/test_stop_signals.py",
    "test_docs.py",
    "server/test_kill_anywhere.py",
    "server/test_load.py",
    "simulations/test_rank_loss.py",
    "simulations/test_same_model.py",
    "tasks/test_task_simulate.py",
    "simulations/test_virtual_clients.py",
    "simulations/test_host_rejoins.py",
    "parallel/test_world2.py",
    "server/test_crash_restart.py",
    "simulations/test_batched_simulate.py",
    "examples/test_flower_example.py",
    "parallel/test_train_cnn.py",
    "security/test_deployed_form.py",
    "client/test_engine_agent.py",
    "simulations/test_simulate_ranks.py",
    "server/test_long_run_memory.py",
    "flower/test_server_app_deployed.py",
    "parallel/test_world4.py",
    "parallel/test_compile.py",
]


def pytest_collection_modifyitems(config, items):
    """Order the collected tests file by file, the files of LONGEST_FIRST first (a stable sort: within a file, and
    among the other files, the order stays pytest's)."""
    rank = {f"tests/{path}": i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
