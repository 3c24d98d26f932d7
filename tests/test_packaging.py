"""The root folders install as subpackages of one import package, ``fedpar``."""

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
