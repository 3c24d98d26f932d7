"""The root folders install as subpackages of one import package, ``fedpar``."""

import json
import tomllib
from pathlib import Path

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
    import subprocess
    import sys
    from importlib.metadata import version
    out = subprocess.run([sys.executable, "-m", "fedpar", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"fedpar {version('fedpar')}", (out.stdout, out.stderr)


def test_a_built_wheel_installs_and_runs_outside_the_repository(tmp_path):
    """Build the wheel from a copy of what pyproject names, install it outside the repository, and from there
    import every room (from the install, not the source tree) and run the ``fedpar`` script."""
    import os
    import shutil
    import subprocess
    import sys
    from importlib.metadata import version

    packages, package_dir = _declared()
    source = tmp_path / "source"  # a copy: the in-tree build/ folder could hold modules removed since
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    for folder in set(package_dir.values()):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True, timeout=120)
    wheel = next((tmp_path / "dist").glob("fedpar-*.whl"))
    site = tmp_path / "site"  # installed with no dependencies: they come from this interpreter's site-packages
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=120)
    assert (site / f"fedpar-{version('fedpar')}.dist-info" / "licenses" / "LICENSE").read_text().startswith(
        (ROOT / "LICENSE").read_text()[:200])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of site-packages and of the editable install's finder
    rooms = sorted(packages)
    check = ("import importlib, json, sys\n"
             f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {rooms!r}}}))")
    out = subprocess.run([sys.executable, "-c", check], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    files = json.loads(out.stdout)
    for module, path in files.items():
        assert Path(path).is_relative_to(site / "fedpar"), (module, path)  # the wheel's, not ROOT's
    assert (site / "fedpar" / "protocol" / "fedpar.proto").is_file()
    script = subprocess.run([str(site / "bin" / "fedpar"), "--version"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and script.stdout.strip() == f"fedpar {version('fedpar')}", script.stderr
