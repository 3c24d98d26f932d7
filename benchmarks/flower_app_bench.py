"""A Flower App run by Flower and by fedpar: wall time and the largest difference of the final arrays.

One command: ``.venv/bin/python benchmarks/flower_app_bench.py`` (``--app DIR --clients N --run-config '...'``).

It runs the app's ServerApp, strategy and ClientApp three ways and prints each one's wall time, its ratio to Flower
in one process, and max |difference| of its final arrays from that run's:
  * Flower in one process: Flower's own objects on a minimal in-memory Grid that calls the ClientApp directly
    (tests/support/flower_reference.py) -- the baseline;
  * ``flwr.simulation.run_simulation`` (Flower's Ray simulation engine), only where Flower's simulation extra is
    installed (``pip install 'flwr[simulation]'``); otherwise it says "skipped: needs flwr[simulation]";
  * ``fedpar simulate --flower-app DIR`` (simulations/flower_app_run.py): fedpar's coordinator and worker processes
    over loopback gRPC, the ServerApp driven through fedpar's Grid.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/support
sys.path.insert(0, str(ROOT / "benchmarks"))
from results import RESULTS, write_results  # noqa: E402  (benchmarks/, this script's folder)

from fedpar.cli.argtypes import FedparParser  # noqa: E402


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest |a - b| over every array (inf when their names differ)."""
    if set(a) != set(b):
        return float("inf")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def with_flower_in_process(app_dir: Path, run_config: str | None, clients: int) -> dict[str, np.ndarray]:
    """Flower's objects in one process (the baseline)."""
    from support.flower_reference import run_with_flower

    return run_with_flower(app_dir, run_config, clients)


def with_run_simulation(app_dir: Path, run_config: str | None, clients: int) -> dict[str, np.ndarray] | None:
    """Flower's run_simulation on Ray; None when the simulation extra is missing."""
    if importlib.util.find_spec("ray") is None:
        return None
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedpar.server.flower_grid import strategy_results
    from fedpar.tasks.flower_app import load_flower_app

    app = load_flower_app(app_dir, run_config)

    def configured(context: Context) -> Context:
        # run_simulation with objects gives an empty run config, which Flower forbids changing in place: the app's
        # handlers get the same Context (its state included) with the app's run config
        return Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                       state=context.state, run_config=dict(app.run_config))

    server, client = ServerApp(), ClientApp()

    @server.main()
    def main(grid, context):
        app.server_app(grid, configured(context))

    @client.train()
    def train(message, context):
        return app.client_app(message, configured(context))

    @client.evaluate()
    def evaluate(message, context):
        return app.client_app(message, configured(context))

    with strategy_results() as results:
        run_simulation(server_app=server, client_app=client, num_supernodes=clients,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    arrays = results[-1].arrays
    return dict(zip(arrays.keys(), arrays.to_numpy_ndarrays()))


def with_fedpar(app_dir: Path, run_config: str | None, clients: int, workers: int) -> dict[str, np.ndarray]:
    """fedpar simulate --flower-app: the final arrays it kept (OUT/global.safetensors)."""
    from fedpar.server.final_model import load_final_model
    from fedpar.simulations.config import SimulationConfig
    from fedpar.simulations.flower_app_run import run_flower_app
    from fedpar.tasks.flower_app import load_flower_app

    with tempfile.TemporaryDirectory() as out:
        cfg = SimulationConfig(clients=clients, workers=workers, seats=2, out=out, deadline_seconds=600.0)
        run_flower_app(cfg, load_flower_app(app_dir, run_config), run_config)
        names, arrays = load_final_model(Path(out))
    return dict(zip(names, arrays))


def main(argv: list[str] | None = None) -> int:
    """Run the three ways and print the comparison."""
    p = FedparParser(description=__doc__.splitlines()[0])
    p.add_argument("--app", default=str(ROOT / "examples" / "flower_app"), help="the Flower App project directory")
    p.add_argument("--clients", type=int, default=4, help="nodes (partitions) of the federation")
    p.add_argument("--workers", type=int, default=2, help="fedpar's worker processes")
    p.add_argument("--run-config", default=None, help="overrides of the app's run config, as flwr run takes them")
    p.add_argument("--json", default=str(RESULTS / "flower_app_bench.json"), help="where the results go")
    args = p.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    app_dir = Path(args.app)

    started = time.perf_counter()
    baseline = with_flower_in_process(app_dir, args.run_config, args.clients)
    baseline_seconds = time.perf_counter() - started
    print(f"flower in one process: {baseline_seconds:.2f} s (baseline)")

    started = time.perf_counter()
    simulated = with_run_simulation(app_dir, args.run_config, args.clients)
    figures = {"clients": args.clients, "baseline_seconds": baseline_seconds}
    ratios = []
    if simulated is None:
        print("flwr.simulation.run_simulation: skipped: needs flwr[simulation]")
    else:
        seconds = time.perf_counter() - started
        figures.update(run_simulation_seconds=seconds, run_simulation_max_difference=max_difference(simulated, baseline))
        ratios.append({"what": f"flwr.simulation.run_simulation (Ray), {args.clients} clients, wall time",
                       "ratio": seconds / baseline_seconds, "against": "Flower in one process, same run"})
        print(f"flwr.simulation.run_simulation: {seconds:.2f} s, ratio {seconds / baseline_seconds:.2f}, "
              f"max |difference| {max_difference(simulated, baseline):.3g}")

    started = time.perf_counter()
    fedpar = with_fedpar(app_dir, args.run_config, args.clients, args.workers)
    seconds = time.perf_counter() - started
    print(f"fedpar simulate --flower-app: {seconds:.2f} s, ratio {seconds / baseline_seconds:.2f}, "
          f"max |difference| {max_difference(fedpar, baseline):.3g}")
    figures.update(fedpar_seconds=seconds, fedpar_max_difference=max_difference(fedpar, baseline))
    ratios.append({"what": f"fedpar simulate --flower-app, {args.clients} clients, wall time (max |difference| of the "
                           f"final arrays {figures['fedpar_max_difference']:.2g})",
                   "ratio": seconds / baseline_seconds, "against": "Flower in one process, same run"})
    if simulated is not None:
        figures["fedpar_vs_run_simulation_max_difference"] = max_difference(fedpar, simulated)
        ratios.append({"what": f"fedpar simulate --flower-app, {args.clients} clients, wall time (max |difference| "
                               f"from run_simulation's arrays {figures['fedpar_vs_run_simulation_max_difference']:.2g})",
                       "ratio": seconds / figures["run_simulation_seconds"],
                       "against": "flwr.simulation.run_simulation (Ray), same run"})
        print(f"fedpar vs run_simulation: max |difference| {figures['fedpar_vs_run_simulation_max_difference']:.3g}")
    print(f"wrote {write_results(Path(args.json), ratios, figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
