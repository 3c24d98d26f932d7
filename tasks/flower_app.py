"""A Flower App project (the layout ``flwr new`` makes) as fedpar reads it: ``--flower-app DIR [--run-config ...]``.

``DIR/pyproject.toml`` names the app's parts in ``[tool.flwr.app.components]`` (``serverapp`` and ``clientapp``,
``package.module:attr`` references imported with DIR on ``sys.path``, as Flower's own loader does) and its run config
in ``[tool.flwr.app.config]``, which ``--run-config 'key=value ...'`` overrides exactly as ``flwr run --run-config``
does (Flower's own parser: TOML values, nested keys flattened with dots, unknown keys refused).

When fedpar drives (``--strategy fedavg|...``) it needs what only the ServerApp's ``main`` would otherwise make, the
initial arrays, and fedpar keeps that in a table of its own, ``[tool.fedpar]`` in the same pyproject:
  * ``model = "package.module:factory"``: called with no arguments, it returns a ``torch.nn.Module`` (its
    ``state_dict``, as ``ArrayRecord(model.state_dict())`` holds it) or an ``ArrayRecord``: the initial global arrays,
    drawn under ``torch.manual_seed(--seed)``;
  * ``train-examples = "package.module:fn"`` (optional): ``fn(partition_id, num_partitions)`` returns a member's
    training-set size, which the coordinator learns when members join (it bounds the ``num-examples`` a reply may
    claim, and secure aggregation's weight range); without it each member declares
    :data:`UNKNOWN_TRAIN_EXAMPLES`.
Flower ignores ``[tool.fedpar]``; the app still runs with ``flwr run`` unchanged.

Of ``[tool.flwr.federations]`` fedpar reads the default federation (:class:`Federation`): its
``options.num-supernodes`` is ``simulate``'s ``--clients`` when not given; its Ray backend options are ignored with
one line; a SuperLink address without ``--clients`` is refused in one line. A FAB file is refused: fedpar reads the
project directory.

Its settings (``--flower-app``, ``--run-config``) are declared in ``fedpar.task.FlowerAppReference``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np


ROUNDS_HINT = "set the app's rounds with --run-config num-server-rounds=N"  # the key `flwr new`'s apps read
UNKNOWN_TRAIN_EXAMPLES = 100_000  # a member's declared training-set size when [tool.fedpar] has no train-examples


class FlowerAppError(ValueError):
    """A Flower App fedpar cannot run as it is: one line saying what to do."""


@dataclass(frozen=True)
class Federation:
    """The default federation of ``[tool.flwr.federations]`` (what ``flwr run DIR`` would use), as far as fedpar
    reads it: a simulation's ``options.num-supernodes``, a SuperLink ``address``, the Ray backend options."""

    name: str
    num_supernodes: int | None
    address: str | None
    backend_options: tuple[str, ...]  # options.backend.* (client-resources, init-args, ...), dotted
    table_missing: bool = False  # the default names no table: only a simulation without --clients needs one

    def simulated_clients(self, given: int | None) -> tuple[int | None, list[str]]:
        """The members ``fedpar simulate`` hosts (``given``: ``--clients``, None when not given; None back: the
        simulation's default) and one line for each thing of the federation it ignores; FlowerAppError when it cannot
        tell how many members to simulate."""
        notes = []
        if self.backend_options:
            notes.append(f"the Ray backend options of federation {self.name!r} ({', '.join(self.backend_options)}) "
                         "do not apply: --workers and --seats say how many processes and threads host the members")
        if given is not None:
            if self.table_missing:
                notes.append(f"[tool.flwr.federations] default = {self.name!r} names no table; --clients "
                             f"{given} says how many members to simulate")
            if self.address:
                notes.append(f"federation {self.name!r}'s address {self.address} is not dialled: the members run here")
            return given, notes
        if self.table_missing:
            raise FlowerAppError(f"[tool.flwr.federations] default = {self.name!r} names no [tool.flwr.federations."
                                 f"{self.name}] table; add it, or pass --clients N to simulate N members")
        if self.num_supernodes is not None:  # as flwr run simulates them
            return self.num_supernodes, notes
        if self.address:
            raise FlowerAppError(f"federation {self.name!r} runs on the SuperLink at {self.address}, which fedpar "
                                 "simulate does not dial: pass --clients N to simulate N members here "
                                 "(deployed: fedpar "
                                 "serve --flower-app and fedpar client --flower-app)")
        return None, notes


@dataclass
class FlowerApp:
    """A loaded Flower App project: its directory, its run config (overrides applied), its component references,
    the ``[tool.fedpar]`` table; the ClientApp and ServerApp are imported when first asked for."""

    directory: Path
    run_config: dict[str, Any]
    clientapp_ref: str
    serverapp_ref: str
    fedpar_table: dict[str, Any] = field(default_factory=dict)
    federation: Federation | None = None  # the pyproject's default federation, if it names one

    @cached_property
    def client_app(self):
        """The ``flwr.clientapp.ClientApp`` the project names."""
        from flwr.clientapp import ClientApp
        return _component(self, self.clientapp_ref, "clientapp", ClientApp)

    def check_client_app(self) -> None:
        """Load the ClientApp now, so that a broken one is a FlowerAppError here rather than in each process that
        hosts members."""
        self.client_app  # noqa: B018  (the cached load is the check)

    @cached_property
    def server_app(self):
        """The ``flwr.serverapp.ServerApp`` the project names."""
        from flwr.serverapp import ServerApp
        return _component(self, self.serverapp_ref, "serverapp", ServerApp)

    def initial_arrays(self, seed: int = 0) -> list[tuple[str, np.ndarray]]:
        """The initial global arrays, (name, array) in the ArrayRecord's order, from ``[tool.fedpar] model``."""
        import torch
        from flwr.app import ArrayRecord

        factory = self._fedpar_reference("model", "a function returning the model (a torch.nn.Module) or an "
                                                  "ArrayRecord of the initial arrays")
        torch.manual_seed(seed)
        try:
            made = factory()
            record = ArrayRecord(made.state_dict()) if isinstance(made, torch.nn.Module) else made
        except Exception as exc:
            raise FlowerAppError(f"{self.directory}: [tool.fedpar] model failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(record, ArrayRecord) or not len(record):
            raise FlowerAppError(f"{self.directory}: [tool.fedpar] model must return a torch.nn.Module or a non-empty "
                                 f"ArrayRecord, got {type(made).__name__}")
        return [(name, np.ascontiguousarray(array.numpy())) for name, array in record.items()]

    def train_examples(self, partition_id: int, num_partitions: int) -> int:
        """Member ``partition_id``'s training-set size, from ``[tool.fedpar] train-examples``
        (:data:`UNKNOWN_TRAIN_EXAMPLES` without it)."""
        if "train-examples" not in self.fedpar_table:
            return UNKNOWN_TRAIN_EXAMPLES
        fn = self._fedpar_reference("train-examples", "a function (partition_id, num_partitions) -> int")
        count = fn(int(partition_id), int(num_partitions))
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise FlowerAppError(f"{self.directory}: [tool.fedpar] train-examples must return a whole number >= 1, "
                                 f"got {count!r}")
        return int(count)

    def _fedpar_reference(self, key: str, what: str):
        """The callable ``[tool.fedpar] key`` names."""
        ref = self.fedpar_table.get(key)
        if not isinstance(ref, str):
            raise FlowerAppError(f"{self.directory}/pyproject.toml has no [tool.fedpar] {key} = 'package.module:attr' "
                                 f"({what}); add it so that fedpar can drive the app with its own strategy")
        target = _load(self.directory, ref, f"[tool.fedpar] {key}")
        if not callable(target):
            raise FlowerAppError(f"{self.directory}: [tool.fedpar] {key} = {ref!r} is a {type(target).__name__}, not "
                                 f"{what}")
        return target


def load_flower_app(directory: str | Path, run_config_overrides: str | None = None) -> FlowerApp:
    """The Flower App project in ``directory``, its run config overridden by ``run_config_overrides`` (``flwr run
    --run-config``'s text); FlowerAppError saying what to do for a project fedpar cannot read."""
    folder = Path(directory).expanduser().resolve()
    if folder.is_file():
        what = "a FAB (flwr build's archive)" if folder.suffix == ".fab" else "a file"
        raise FlowerAppError(f"--flower-app {directory} is {what}; fedpar does not unpack or ship FABs: pass the "
                             "project directory (the one holding pyproject.toml), present on every machine")
    toml_path = folder / "pyproject.toml"
    if not toml_path.is_file():
        raise FlowerAppError(f"--flower-app {directory}: no pyproject.toml there; give the Flower App project's "
                             "directory (flwr new makes one)")
    try:
        project = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise FlowerAppError(f"--flower-app {directory}: pyproject.toml cannot be read: {exc}") from None
    app = project.get("tool", {}).get("flwr", {}).get("app", {})
    components = app.get("components") if isinstance(app, dict) else None
    if not isinstance(components, dict):
        raise FlowerAppError(f"--flower-app {directory}: pyproject.toml has no [tool.flwr.app.components] table; add "
                             "serverapp = 'package.module:app' and clientapp = 'package.module:app'")
    refs = {}
    for key in ("clientapp", "serverapp"):
        ref = components.get(key)
        if not isinstance(ref, str) or ":" not in ref:
            raise FlowerAppError(f"--flower-app {directory}: [tool.flwr.app.components] needs {key} = "
                                 f"'package.module:attr', got {ref!r}")
        refs[key] = ref
    fedpar_table = project.get("tool", {}).get("fedpar", {})
    if not isinstance(fedpar_table, dict):
        raise FlowerAppError(f"--flower-app {directory}: [tool.fedpar] must be a table")
    loaded = FlowerApp(folder, _run_config(folder, app.get("config", {}), run_config_overrides), refs["clientapp"],
                       refs["serverapp"], dict(fedpar_table),
                       _default_federation(directory, project.get("tool", {}).get("flwr", {}).get("federations")))
    plain_flower_logs()  # every process that runs an app loads it here: the coordinator, each worker, an agent
    return loaded


def plain_flower_logs() -> None:
    """Flower's console log lines (flwr's own handler on the "flwr" logger, coloured by default) without ANSI colour
    codes unless they go to a terminal, and not there either with NO_COLOR set: a log file, a pipe or a CI log
    otherwise holds escape sequences around every "INFO :". Per process: a worker process has its own handler. A
    FLWR_LOG_LEVEL of WARNING or above (a --quiet run's) holds the logger to it, for the process's own handler too."""
    import os

    from flwr.common.logger import LOGGER_NAME, ConsoleHandler

    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, ConsoleHandler):
            handler.colored = _is_terminal(handler.stream) and not os.environ.get("NO_COLOR")
    if os.environ.get("FLWR_LOG_LEVEL", "").upper() in ("WARNING", "ERROR", "CRITICAL"):  # e.g. a --quiet run's
        logging.getLogger(LOGGER_NAME).setLevel(os.environ["FLWR_LOG_LEVEL"].upper())  # own handler gets them too


@contextlib.contextmanager
def quiet_flower_logs(quiet: bool = True):
    """``--quiet`` for the span: Flower's console lines (a ServerApp's rounds, a legacy strategy's per-round notes)
    show only at ERROR, in this process and in those it starts meanwhile (Flower reads FLWR_LOG_LEVEL as it is
    imported); a level the user set there is kept, and both are as they were afterwards."""
    import os

    if not quiet or "FLWR_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["FLWR_LOG_LEVEL"] = "ERROR"
    flower_log = logging.getLogger("flwr")  # the logger, not its handler: a process's own handler gets its lines too
    level = flower_log.level
    flower_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        os.environ.pop("FLWR_LOG_LEVEL", None)
        flower_log.setLevel(level)


def _is_terminal(stream) -> bool:
    """Whether ``stream`` writes to a terminal (a closed or replaced stream without isatty: no)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _default_federation(directory: str | Path, federations: Any) -> Federation | None:
    """The federation ``[tool.flwr.federations] default`` names (None without one; ``table_missing`` for one that is
    not there); FlowerAppError for one whose num-supernodes is not a whole number >= 1."""
    if not isinstance(federations, dict) or not isinstance(federations.get("default"), str):
        return None
    name = federations["default"]
    table = federations.get(name)
    if not isinstance(table, dict):  # said by a simulation that needs it (serve, client and --clients do not)
        return Federation(name, None, None, (), table_missing=True)
    options = table.get("options") if isinstance(table.get("options"), dict) else {}
    count = options.get("num-supernodes")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise FlowerAppError(f"--flower-app {directory}: federation {name!r}'s options.num-supernodes must be a whole "
                             f"number >= 1, got {count!r}")
    backend = options.get("backend") if isinstance(options.get("backend"), dict) else {}
    address = table.get("address")
    return Federation(name, count, address if isinstance(address, str) else None,
                      tuple(f"options.backend.{key}" for key in _dotted(backend)))


def _dotted(table: dict[str, Any], prefix: str = "") -> list[str]:
    """The leaf keys of a nested TOML table, dotted."""
    keys = []
    for key, value in table.items():
        keys += _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def _run_config(folder: Path, defaults: Any, overrides: str | None) -> dict[str, Any]:
    """The app's run config, flattened, with ``overrides`` fused in as ``flwr run`` does."""
    try:
        from flwr.common.config import flatten_dict, fuse_dicts, parse_config_args
    except ImportError:
        raise FlowerAppError("--flower-app needs Flower: pip install 'fedpar[flower]'") from None
    text = (overrides or "").strip()
    if text:
        _check_pairs(text)
    # a .toml file is read here: Flower's own reading says only '[Errno 2] ...' of a missing one
    read = _run_config_file(text) if text.endswith(".toml") else None
    try:
        config = flatten_dict(defaults if isinstance(defaults, dict) else {})
        if text:
            config = fuse_dicts(config, flatten_dict(read) if read is not None else parse_config_args([text]))
    except ValueError as exc:
        raise FlowerAppError(f"--run-config: {exc} (the keys are those of [tool.flwr.app.config] in "
                             f"{folder}/pyproject.toml)") from None
    except Exception as exc:  # click.ClickException: a malformed override string
        message = getattr(exc, "message", None) or str(exc)
        raise FlowerAppError(f"--run-config: {message}") from None
    return config


def _run_config_file(path: str) -> dict[str, Any]:
    """The TOML file of overrides a --run-config ending in .toml names (as ``flwr run`` reads it); FlowerAppError,
    one line, for one that cannot be read, as --config says of its file."""
    from fedpar.protocol.small_files import read_toml_file

    try:
        return read_toml_file(Path(path).expanduser(), "--run-config")
    except ValueError as exc:
        raise FlowerAppError(f"{exc} (a --run-config ending in .toml is a file of overrides; else give "
                             "KEY=VALUE pairs)") from None


# Flower's own pattern for one KEY=VALUE of a --run-config string (flwr.common.config.parse_config_args), which
# skips whatever does not match it: fedpar refuses that instead.
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def _check_pairs(overrides: str) -> None:
    """FlowerAppError naming the first part of a --run-config string that is not KEY=VALUE (Flower drops it)."""
    if overrides.endswith(".toml"):
        return
    left = _PAIR.sub(" ", overrides).split()
    if left:
        raise FlowerAppError(f"--run-config: {left[0][:64]!r} is not KEY=VALUE; write pairs separated by "
                             "spaces, e.g. 'num-server-rounds=3 lr=0.05'")


def _load(folder: Path, ref: str, what: str) -> Any:
    """The object ``ref`` names, imported with ``folder`` on sys.path (Flower's loader)."""
    from flwr.supercore.object_ref import load_app

    _import_from(folder, ref.partition(":")[0])
    try:
        return load_app(ref, FlowerAppError, folder)
    except FlowerAppError as exc:
        first_line = (str(exc).strip().splitlines() or ["cannot be loaded"])[0]
        raise FlowerAppError(f"{folder}: {what} = {ref!r}: {first_line}") from None
    except Exception as exc:  # the app's own import failing
        raise FlowerAppError(f"{folder}: importing {what} = {ref!r} failed: {type(exc).__name__}: {exc}") from None


def _import_from(folder: Path, module: str) -> None:
    """Make ``module`` (of a Flower App in ``folder``) import from ``folder``: Flower's loader takes a module of that
    name already imported, or the first folder on sys.path holding one, so the second of two apps whose packages share
    a name (e.g. both made by ``flwr new``) ran the first one's code. The app's own package is imported afresh when
    one of that name from elsewhere was imported; a module the folder does not hold (an installed package) is left."""
    top = module.split(".")[0]
    folder = folder.absolute()
    if not ((folder / top).is_dir() or (folder / f"{top}.py").is_file()):
        return
    loaded = sys.modules.get(top)
    if loaded is not None:
        where = getattr(loaded, "__file__", None) or next(iter(getattr(loaded, "__path__", None) or []), None)
        if where is None or not Path(where).resolve().is_relative_to(folder.resolve()):
            for name in [name for name in sys.modules if name == top or name.startswith(top + ".")]:
                del sys.modules[name]
    while str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()


def _component(app: FlowerApp, ref: str, key: str, kind: type) -> Any:
    """Component ``key`` of ``app``, checked to be a ``kind``."""
    found = _load(app.directory, ref, f"[tool.flwr.app.components] {key}")
    if not isinstance(found, kind):
        raise FlowerAppError(f"{app.directory}: [tool.flwr.app.components] {key} = {ref!r} is a "
                             f"{type(found).__name__}, not a {kind.__module__.rpartition('.')[0]}.{kind.__name__}")
    return found

