"""The root folders install as subpackages of one import package, ``fedpar``."""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> tuple[set[str], dict[str, str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"]), cfg["package-dir"]


def test_every_package_folder_is_declared():
    packages, package_dir = _declared()
    found = set()
    for top_name, top_dir in package_dir.items():
        for init in (ROOT / top_dir).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top_dir)
            found.add(".".join([top_name, *rel.parts]))
    missing = sorted(found - packages)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_nothing_is_installed_under_a_bare_name():
    packages, package_dir = _declared()
    assert all(p == "fedpar" or p.startswith("fedpar.") for p in packages)
    assert all(k == "fedpar" or k.startswith("fedpar.") for k in package_dir)


def test_subpackages_import_from_their_root_folders():
    import fedpar.aggregation
    import fedpar.server

    assert Path(fedpar.server.__file__).parent == ROOT / "server"
    assert Path(fedpar.aggregation.__file__).parent == ROOT / "aggregation"


def test_fedpar_version_names_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "fedpar", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"fedpar {version('fedpar')}", (out.stdout, out.stderr)


TRACEBACK = "Traceback"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> SimpleNamespace:
    """The wheel built from a copy of what pyproject names, pip-installed with its dependencies into a fresh venv
    (no system site-packages, no editable install, no PYTHONPATH), and a folder outside the repository to run in."""
    base = tmp_path_factory.mktemp("wheel")
    packages, package_dir = _declared()
    source = base / "source"  # a copy: the in-tree build/ folder could hold modules removed since
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    for folder in set(package_dir.values()):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    quiet = ["--disable-pip-version-check", "--no-input", "--quiet"]
    started = time.perf_counter()
    _run([sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "--no-build-isolation", str(source),
          "-w", str(base / "dist")], timeout=120)
    wheel = next((base / "dist").glob("fedpar-*.whl"))
    venv = base / "venv"
    # --without-pip: ensurepip would install pip into it first (seconds); this pip installs into the venv's own
    # interpreter instead (pip --python), as its pip would
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    # PYTHONDONTWRITEBYTECODE too (set on some machines): with --no-compile below, each command would compile all of
    # torch it imports again (seconds each); a user's Python writes the bytecode of the first command for the next
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV",
                                                             "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # as `source venv/bin/activate` sets it
    env["OMP_NUM_THREADS"] = "1"
    torch = f"torch=={version('torch').split('+')[0]}"  # this machine's build (pip's find-links hold the wheel)
    # --no-compile: pip would byte-compile all of torch (about half the install's time); Python compiles what
    # the commands below import, once.
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", *quiet,
                              "--no-compile", torch, str(wheel)], env=env, capture_output=True, text=True, timeout=600)
    if install.returncode and f"No matching distribution found for {torch}" in install.stderr:
        pytest.skip(f"no package index reachable here offers {torch}: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    seconds = time.perf_counter() - started
    print(f"wheel built and installed with its dependencies into a fresh venv in {seconds:.1f} s")
    return SimpleNamespace(venv=venv, fedpar=venv / "bin" / "fedpar", env=env, cwd=elsewhere, packages=packages,
                           site=_site_packages(venv, env), install_seconds=seconds)


def _run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-3000:])
    return out


def _site_packages(venv: Path, env: dict) -> Path:
    out = _run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               timeout=60, env=env)
    return Path(out.stdout.strip())


def _user_runs(installed: SimpleNamespace, *args: str, timeout: float = 120) -> str:
    """``fedpar ARGS`` as a user runs the installed script: exit 0 and no traceback; returns its stdout."""
    return _users_run(installed, [list(args)], timeout)[0]


def _users_run(installed: SimpleNamespace, commands: list[list[str]], timeout: float = 120) -> list[str]:
    """Each ``fedpar ARGS`` of ``commands``, side by side (each pays Python's start-up): each exits 0 with no
    traceback; returns their stdouts in order."""
    procs = [subprocess.Popen([str(installed.fedpar), *args], cwd=installed.cwd, env=installed.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in commands]
    outs = []
    for args, proc in zip(commands, procs):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        assert proc.returncode == 0, (args, proc.returncode, stdout[-2000:], stderr[-3000:])
        assert TRACEBACK not in stdout and TRACEBACK not in stderr, (args, stdout[-2000:], stderr[-3000:])
        outs.append(stdout)
    return outs


def test_the_installed_wheel_holds_every_room_and_its_license(installed):
    """Every room imports from the install (not the source tree), with the .proto and the license."""
    rooms = sorted(installed.packages)
    check = ("import importlib, json\n"
             f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {rooms!r}}}))")
    out = _run([str(installed.venv / "bin" / "python"), "-c", check], timeout=120, cwd=installed.cwd,
               env=installed.env)
    for module, path in json.loads(out.stdout).items():
        assert Path(path).is_relative_to(installed.site / "fedpar"), (module, path)  # the wheel's, not ROOT's
    assert (installed.site / "fedpar" / "protocol" / "fedpar.proto").is_file()
    license_file = installed.site / f"fedpar-{version('fedpar')}.dist-info" / "licenses" / "LICENSE"
    assert license_file.read_text().startswith((ROOT / "LICENSE").read_text()[:200])


def test_the_installed_fedpar_answers_version_and_every_help(installed):
    """`fedpar --version`, `fedpar --help` and each subcommand's --help, as the installed CLI lists them."""
    assert _user_runs(installed, "--version").strip() == f"fedpar {version('fedpar')}"
    listed = _run([str(installed.venv / "bin" / "python"), "-c",
                   "import json; from fedpar.cli.main import SUBCOMMANDS; print(json.dumps(list(SUBCOMMANDS)))"],
                  timeout=60, cwd=installed.cwd, env=installed.env)
    subcommands = json.loads(listed.stdout)
    assert {"serve", "client", "simulate", "train", "export"} <= set(subcommands)
    top, *helps = _users_run(installed, [["--help"], *([name, "--help"] for name in subcommands)])
    for name, help_text in zip(subcommands, helps):
        assert re.search(rf"^ +{re.escape(name)}( |$)", top, re.M), (name, top)  # listed by `fedpar --help`
        assert f"usage: fedpar {name}" in help_text


def test_the_installed_fedpar_simulates_two_rounds_on_the_bundled_digits(installed):
    out = installed.cwd / "run"
    _user_runs(installed, "simulate", "--clients", "2", "--rounds", "2", "--workers", "1", "--out", str(out),
               timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[-1]["test_accuracy"] > 0.5
    assert json.loads((out / "global.json").read_text())["model"]["dataset"] == "digits"


def _stdlib_submodule_uses(tree: ast.Module) -> set[str]:
    """The stdlib submodules (``importlib.util``) a module reaches as attributes of a package it imported bare
    (``import importlib``) without importing the submodule itself."""
    bound, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                bound |= {parts[0]} if alias.asname is None and parts[0] in sys.stdlib_module_names else set()
                imported |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            imported |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    used = set()
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in bound):
            continue
        name = node.id
        for part in chain:
            name = f"{name}.{part}"
            if name in imported:
                continue
            try:
                is_module = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):  # the parent is no package: an attribute, not a submodule
                is_module = False
            if is_module:
                used.add(name)
            break
    return used


def test_no_module_reaches_a_stdlib_submodule_it_did_not_import():
    """``import importlib`` then ``importlib.util.find_spec`` works in the editable install (whose finder imports
    importlib.util) and fails in a wheel's fresh interpreter: each module imports the submodules it uses, unless
    its package imports them itself (``os.path``)."""
    _, package_dir = _declared()
    uses: dict[str, set[str]] = {}
    for folder in set(package_dir.values()):
        for path in (ROOT / folder).rglob("*.py"):
            for name in _stdlib_submodule_uses(ast.parse(path.read_text(), str(path))):
                uses.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    missing = {}
    for name in sorted(uses):  # a fresh interpreter per package: -S, as no .pth file imports anything first
        package, attribute = name.rsplit(".", 1)
        probe = subprocess.run([sys.executable, "-I", "-S", "-c", f"import {package}; print(hasattr({package}, "
                                f"{attribute!r}))"], capture_output=True, text=True, timeout=60)
        if probe.stdout.strip() != "True":
            missing[name] = sorted(uses[name])
    assert not missing, f"import these submodules explicitly where they are used: {missing}"
