"""--no-plot (one setting of simulate, serve and train): a run draws no PNG and never imports matplotlib (about a
second of CPU a run), and an earlier run's plots in its --out are not left behind as if they were its own."""

from __future__ import annotations

import json
import subprocess
import sys

# fedpar's main in a process of its own, which then says whether matplotlib was imported by the end of the run
SAYS_MATPLOTLIB = ("import sys; from fedpar.cli.main import main; code = main(sys.argv[1:]); "
                   "print('matplotlib imported:', 'matplotlib' in sys.modules); sys.exit(code)")


def _simulate(out, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SAYS_MATPLOTLIB, "simulate", "--clients", "2", "--rounds", "1",
                           "--local-epochs", "1", "--quiet", "--out", str(out), *more],
                          capture_output=True, text=True, timeout=240)


def test_a_simulation_with_no_plot_draws_none_imports_no_matplotlib_and_leaves_no_earlier_plot(tmp_path):
    out = tmp_path / "out"
    drawn = _simulate(out)
    assert drawn.returncode == 0, drawn.stderr
    assert "matplotlib imported: True" in drawn.stdout
    assert {p.name for p in out.glob("*.png")} == {"accuracy.png", "loss.png", "labels.png"}

    bare = _simulate(out, "--no-plot")
    assert bare.returncode == 0, bare.stderr
    assert "matplotlib imported: False" in bare.stdout
    assert not list(out.glob("*.png"))  # the earlier run's were set aside with its other files, and removed
    wrote = [line for line in bare.stdout.splitlines() if line.startswith("wrote ")]  # what it names it wrote
    assert wrote == [f"wrote {out}/metrics.jsonl, metrics.csv, global.safetensors, global.json and summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["config"]["plot"] is False


def test_serve_simulate_and_train_take_the_setting_and_a_config_file_sets_it(tmp_path):
    """One declaration (tests/test_settings_declared_once.py holds it to one help text): each command parses it."""
    from fedpar.cli.main import build_parser, subcommand_parser

    parser = build_parser()
    for name in ("serve", "simulate", "train"):
        command = subcommand_parser(parser, name)
        assert command.parse_args(["--no-plot"]).plot is False and command.parse_args([]).plot is True, name
    config = tmp_path / "run.toml"
    config.write_text("plot = false\n")
    out = tmp_path / "out"
    done = _simulate(out, "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "matplotlib imported: False" in done.stdout and not list(out.glob("*.png"))
