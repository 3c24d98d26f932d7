"""A Flower App project as `--flower-app DIR` reads it: components and run config from its pyproject.toml, run-config
overrides parsed as `flwr run --run-config` parses them, and a project fedpar cannot read refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedpar.cli.main import main  # noqa: E402
from fedpar.tasks.flower_app import UNKNOWN_TRAIN_EXAMPLES, FlowerAppError, load_flower_app  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower_app"
PYPROJECT = """
[tool.flwr.app.components]
serverapp = "{package}.server_app:app"
clientapp = "{package}.client_app:app"

[tool.flwr.app.config]
num-server-rounds = 3
lr = 0.1
nested.depth = 2
"""


def project(root: Path, package: str, pyproject: str = PYPROJECT, client_app: str = "app = ClientApp()\n") -> Path:
    """A Flower App project under ``root``, its package ``package`` holding ``client_app`` (and an empty ServerApp)."""
    (root / package).mkdir(parents=True)
    (root / "pyproject.toml").write_text(pyproject.format(package=package))
    (root / package / "__init__.py").write_text("")
    (root / package / "client_app.py").write_text("from flwr.clientapp import ClientApp\n" + client_app)
    (root / package / "server_app.py").write_text("from flwr.serverapp import ServerApp\napp = ServerApp()\n")
    return root


def test_the_examples_components_run_config_and_fedpar_table_are_read():
    app = load_flower_app(EXAMPLE, "lr=0.2 local-epochs=3")
    assert app.run_config == {"num-server-rounds": 3, "fraction-train": 1.0, "local-epochs": 3, "lr": 0.2,
                              "batch-size": 32}
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    assert isinstance(app.client_app, ClientApp) and isinstance(app.server_app, ServerApp)
    names = [name for name, _ in app.initial_arrays(0)]
    assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    first, again = app.initial_arrays(0), app.initial_arrays(0)
    assert all((a == b).all() for (_, a), (_, b) in zip(first, again))  # drawn from the seed
    assert app.train_examples(0, 4) == 288
    from flwr.common.config import get_project_config, validate_config
    assert validate_config(get_project_config(EXAMPLE), check_module=True, project_dir=EXAMPLE) == (True, [], [])


def test_overrides_follow_flwr_run_nested_keys_quoted_strings_and_a_toml_file(tmp_path):
    root = project(tmp_path / "p", "pkg_overrides")
    app = load_flower_app(root, "nested.depth=5 lr=0.01")
    assert app.run_config == {"num-server-rounds": 3, "lr": 0.01, "nested.depth": 5}
    overrides = tmp_path / "over.toml"
    overrides.write_text("num-server-rounds = 7\n")
    assert load_flower_app(root, str(overrides)).run_config["num-server-rounds"] == 7
    assert load_flower_app(root, None).run_config["lr"] == 0.1
    assert load_flower_app(root, None).train_examples(0, 2) == UNKNOWN_TRAIN_EXAMPLES  # no [tool.fedpar] key


@pytest.mark.parametrize("breakage, message", [
    ("no-pyproject", "no pyproject.toml there"),
    ("no-components", "has no [tool.flwr.app.components] table"),
    ("no-clientapp", "needs clientapp = 'package.module:attr'"),
    ("unknown-override", "Key 'epochs' is not present"),
    ("malformed-override", "--run-config: The provided configuration string is in an invalid format"),
    ("empty-value", "--run-config: 'lr=' is not KEY=VALUE"),  # Flower's parser drops it
    ("bare-word", "--run-config: 'epochs' is not KEY=VALUE"),
    ("missing-module", "importing [tool.flwr.app.components] clientapp"),
    ("missing-attribute", "Unable to load attribute nothing"),
    ("not-a-clientapp", "is a int, not a flwr.clientapp.ClientApp"),
    ("no-model", "no [tool.fedpar] model = 'package.module:attr'"),
])
def test_a_project_fedpar_cannot_run_is_refused_in_one_line(tmp_path, breakage, message):
    package = f"pkg_{breakage.replace('-', '_')}"
    text, overrides, client_app = PYPROJECT, None, "app = ClientApp()\n"
    if breakage == "no-components":
        text = "[tool.flwr.app.config]\nlr = 0.1\n"
    elif breakage == "no-clientapp":
        text = PYPROJECT.replace('clientapp = "{package}.client_app:app"', "")
    elif breakage == "unknown-override":
        overrides = "epochs=3"
    elif breakage == "malformed-override":
        overrides = "lr=[1"
    elif breakage == "empty-value":
        overrides = "lr="
    elif breakage == "bare-word":
        overrides = "lr=0.2 epochs"
    elif breakage == "missing-module":
        text = PYPROJECT.replace("{package}.client_app:app", "{package}.nowhere:app")
    elif breakage == "missing-attribute":
        text = PYPROJECT.replace("{package}.client_app:app", "{package}.client_app:nothing")
    elif breakage == "not-a-clientapp":
        client_app = "app = 3\n"
    root = project(tmp_path / "p", package, text, client_app)
    if breakage == "no-pyproject":
        (root / "pyproject.toml").unlink()
    with pytest.raises(FlowerAppError) as caught:
        app = load_flower_app(root, overrides)
        app.client_app  # noqa: B018
        app.initial_arrays(0)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_simulate_and_client_say_a_bad_project_in_one_line_and_exit_2(tmp_path, capsys):
    assert main(["simulate", "--flower-app", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpar simulate: --flower-app") and "no pyproject.toml" in err and "\n" not in err
    assert main(["client", "--insecure", "--agent-id", "a", "--flower-app", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpar client: --flower-app") and "\n" not in err
    assert main(["client", "--insecure", "--agent-id", "a", "--run-config", "lr=1"]) == 2
    assert capsys.readouterr().err.strip() == "fedpar client: --run-config needs --flower-app"


@pytest.mark.parametrize("extra, message", [
    (["--task", "examples/own_task.py:task"], "--flower-app and --task both say what the clients train; give one"),
    (["--client-batching"], "--client-batching stacks fedpar's own local loop; a Flower App trains in its ClientApp"),
])
def test_settings_that_cannot_go_with_a_flower_app_are_refused_before_anything_starts(tmp_path, capsys, extra,
                                                                                        message):
    code = main(["simulate", "--flower-app", str(EXAMPLE), "--strategy", "fedavg", *extra, "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith(f"fedpar simulate: {message}")


FEDERATIONS = PYPROJECT + """
[tool.flwr.federations]
default = "{{default}}"

[tool.flwr.federations.local-simulation]
options.num-supernodes = 3
options.backend.client-resources.num-cpus = 2
options.backend.client-resources.num-gpus = 0.0

[tool.flwr.federations.remote]
address = "127.0.0.1:9093"
insecure = true
"""


def test_the_default_federations_num_supernodes_is_clients_and_ray_options_are_ignored_in_one_line(tmp_path):
    root = project(tmp_path, "fed_app", FEDERATIONS.replace("{{default}}", "local-simulation"))
    federation = load_flower_app(root).federation
    assert (federation.name, federation.num_supernodes, federation.address) == ("local-simulation", 3, None)
    clients, notes = federation.simulated_clients(None)
    assert clients == 3 and len(notes) == 1 and "\n" not in notes[0]
    assert "options.backend.client-resources.num-cpus, options.backend.client-resources.num-gpus" in notes[0]
    assert "--workers and --seats" in notes[0]
    assert federation.simulated_clients(5)[0] == 5  # --clients given wins
    assert load_flower_app(project(tmp_path / "plain", "plain_app")).federation is None


def test_simulate_takes_the_examples_num_supernodes_as_clients(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["simulate", "--flower-app", str(EXAMPLE), "--strategy", "fedavg", "--rounds", "1", "--workers", "1",
                 "--run-config", "local-epochs=1", "--quiet", "--out", str(out)])
    assert code == 0 and capsys.readouterr().err == ""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["sampled"] == 4  # [tool.flwr.federations.local-simulation] options.num-supernodes = 4


def test_a_federation_address_without_clients_and_a_fab_are_refused_in_one_line(tmp_path, capsys):
    root = project(tmp_path / "remote", "remote_app", FEDERATIONS.replace("{{default}}", "remote"))
    assert main(["simulate", "--flower-app", str(root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "127.0.0.1:9093" in err and "pass --clients N" in err
    fab = tmp_path / "my-app.1.0.0.fab"
    fab.write_bytes(b"PK\x03\x04")
    for command in (["simulate", "--out", str(tmp_path / "out")], ["client", "--insecure", "--agent-id", "a"]):
        assert main([*command, "--flower-app", str(fab)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "is a FAB" in err and "pass the project directory" in err


def test_a_default_federation_with_no_table_is_said_only_where_a_count_is_needed_and_clients_then_runs(tmp_path, capfd):
    """QA: a default naming no federation table stopped simulate, serve and client alike with 'add it or pass
    --clients', and simulate --clients N stopped there too (serve and client take no --clients)."""
    import shutil

    from support.in_process import run_main

    root = tmp_path / "app"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("__pycache__"))
    toml = root / "pyproject.toml"
    toml.write_text(toml.read_text().replace('default = "local-simulation"', 'default = "nowhere"'))
    simulate = ["simulate", "--flower-app", str(root), "--strategy", "fedavg", "--rounds", "1", "--workers",
                "1", "--quiet", "--out", str(tmp_path / "run")]
    done = run_main(simulate, capfd)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["fedpar simulate: [tool.flwr.federations] default = 'nowhere' names no "
                                        "[tool.flwr.federations.nowhere] table; add it, or pass --clients N to "
                                        "simulate N members"]
    done = run_main([*simulate, "--clients", "2"], capfd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "default = 'nowhere' names no table; --clients 2 says how many members to simulate" in done.stderr
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["sampled"] == 2
    agent = ["client", "--insecure", "--server", "127.0.0.1:9", "--agent-id", "a", "--give-up-after", "1",
             "--flower-app", str(root)]
    done = run_main(agent, capfd)
    assert done.returncode == 1 and "unreachable for 1.0s" in done.stderr, done.stderr[-3000:]  # loaded, dialled
