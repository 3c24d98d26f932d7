"""System heterogeneity traces: how fast each simulated client computes, how fast its links are, and when in the
day it is online. Read from CSV or JSON (no pickle), or generated in the shapes the FedScale paper reports.

File format, one row (CSV) or object (JSON list) per client, clients numbered 0..N-1 in any order:

    client,seconds_per_step,download_mbps,upload_mbps,available_from,available_for
    0,0.012,25.0,6.0,28800,43200

- ``seconds_per_step``: one local SGD step on that device (added to the real step as a pause in real time);
- ``download_mbps`` / ``upload_mbps``: link speeds in megabits per second;
- ``available_from`` / ``available_for``: seconds into the day the client comes online, and for how long (a window
  may wrap past midnight; ``available_for`` >= DAY_SECONDS: always online).

Every client has exactly one row; every value is a number >= 0 (link speeds at least 1e-6 Mbps, a step at most a
day). A file whose name does not end in .csv (in any case) is read as JSON.

``generate_traces`` follows FedScale (Lai et al., ICML 2022): compute speeds with a long tail (log-normal, the
slowest devices several times the median), link speeds log-normal around a mobile median, and diurnal
availability: each client is online for a stretch of 2 to 18 hours starting at a random time of day.
"""

from __future__ import annotations

import codecs
import csv
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpar.meant import closest, did_you_mean

DAY_SECONDS = 86_400.0
COLUMNS = ("client", "seconds_per_step", "download_mbps", "upload_mbps", "available_from", "available_for")


@dataclass
class Traces:
    """Every client's trace, as columns (float32 arrays indexed by client number)."""

    seconds_per_step: np.ndarray
    download_mbps: np.ndarray
    upload_mbps: np.ndarray
    available_from: np.ndarray
    available_for: np.ndarray

    def __len__(self) -> int:
        return len(self.seconds_per_step)

    def available(self, day_seconds: float, clients: np.ndarray | None = None) -> np.ndarray:
        """Which clients (all, or those numbered ``clients``) are online ``day_seconds`` into the trace's day."""
        idx = slice(None) if clients is None else clients
        return online(day_seconds, self.available_from[idx], self.available_for[idx])

    def save(self, path: str | Path) -> None:
        """Write the traces as CSV (.csv) or JSON (anything else)."""
        rows = [dict(zip(COLUMNS, (i, *(float(c[i]) for c in self._columns())))) for i in range(len(self))]
        path = Path(path)
        if is_csv(path):
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
        else:
            path.write_text(json.dumps(rows))

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.seconds_per_step, self.download_mbps, self.upload_mbps, self.available_from, self.available_for)


def online(day_seconds: float, available_from: np.ndarray, available_for: np.ndarray) -> np.ndarray:
    """Whether each window (start, length; wrapping past midnight) holds the time ``day_seconds`` into the day."""
    return seconds_left_online(day_seconds, available_from, available_for) > 0


def seconds_left_online(day_seconds: float, available_from: np.ndarray, available_for: np.ndarray) -> np.ndarray:
    """How long each window (start, length) stays open from ``day_seconds`` into the day: 0 when closed then,
    infinite when always open."""
    since = np.mod(day_seconds - available_from, DAY_SECONDS)
    left = np.where(since < available_for, available_for - since, 0.0)
    return np.where(available_for >= DAY_SECONDS, np.inf, left)


class AvailabilityEvents:
    """The times of day each window opens and closes, sorted, so that the members whose availability may have
    changed between two times are found by a search, not a pass over every member (a host polls often)."""

    SLACK = 1.0  # seconds either side: the state itself is computed in float32 by online()

    def __init__(self, available_from: np.ndarray, available_for: np.ndarray):
        self.available_from, self.available_for = available_from, available_for
        windowed = np.flatnonzero(available_for < DAY_SECONDS)  # the always-online never change
        start = np.mod(available_from[windowed].astype(np.float64), DAY_SECONDS)
        end = np.mod(start + available_for[windowed], DAY_SECONDS)
        times = np.concatenate([start, end])
        order = np.argsort(times, kind="stable")
        self.times, self.members = times[order], np.concatenate([windowed, windowed])[order]
        self.windowed = windowed

    def between(self, since: float, until: float) -> np.ndarray:
        """The members (indices) whose window opens or closes in (since, until] seconds into the trace (times
        beyond a day wrap; all that have a window when the span is a day or more, or runs backwards)."""
        if until < since or until - since + 2 * self.SLACK >= DAY_SECONDS:
            return self.windowed
        lo, hi = np.mod(since - self.SLACK, DAY_SECONDS), np.mod(until + self.SLACK, DAY_SECONDS)
        a, b = np.searchsorted(self.times, [lo, hi], side="right")
        picked = self.members[a:b] if lo <= hi else np.concatenate([self.members[a:], self.members[:b]])
        return np.unique(picked)


def generate_traces(clients: int, seed: int = 0, median_seconds_per_step: float = 0.01) -> Traces:
    """FedScale-shaped traces for ``clients`` clients (see the module docstring)."""
    rng = np.random.default_rng([seed, 11])
    speed = median_seconds_per_step * rng.lognormal(0.0, 0.8, clients)
    down = rng.lognormal(np.log(20.0), 0.9, clients)
    up = down / rng.uniform(2.0, 8.0, clients)  # uplinks are a fraction of downlinks
    start = rng.uniform(0.0, DAY_SECONDS, clients)
    hours = rng.uniform(2.0, 18.0, clients)
    return Traces(*(np.asarray(c, np.float32) for c in (speed, down, up, start, hours * 3600.0)))


BUILT_IN = ("fedscale",)  # --trace names that are no file: generated traces
ROW_BYTES = 1024  # far more than one client's row or object takes: a larger file is not N clients' traces
MOST_SECONDS_PER_STEP = DAY_SECONDS  # a step slept on the real clock; sleep() overflows at 1e30 (as --slow-step-delay)
MOST_VALUE = float(np.finfo(np.float32).max)  # the columns are kept as float32
LEAST_MBPS = 1e-6  # a bit a second: a link divides the model's bits, and 1e-50 is 0 in float32
# --trace-day-seconds given to a run on the virtual clock: simulate refuses it at once, a simulate-workers host once its
# coordinator says it runs that clock
VIRTUAL_DAY = ("--trace-day-seconds: under --clock virtual a trace's days pass in simulated time, not in real "
               "seconds; drop it (or use --clock real)")
# a host reads its trace's clock when it polls, about every 2 s (host_population's poll_seconds): a shorter day's
# hours pass between two reads, and its availability is noise (1e-300 overflowed it to NaN: every member away)
LEAST_DAY_SECONDS = 2.0


def check_day_seconds(day_seconds: float) -> None:
    """ValueError, one line, for a ``--trace-day-seconds`` too short for the hosts to see a day pass."""
    if not day_seconds >= LEAST_DAY_SECONDS:  # NaN too
        raise ValueError(f"--trace-day-seconds {day_seconds:g}: a trace day must last at least {LEAST_DAY_SECONDS:g} "
                         f"real seconds (hosts read the trace's clock about every {LEAST_DAY_SECONDS:g} s, so a "
                         "shorter day passes unseen); give a longer one")


def is_csv(path: Path) -> bool:
    """Whether a trace file is CSV by its name: .csv in any case (a spreadsheet on Windows writes T.CSV)."""
    return path.suffix.lower() == ".csv"


def load_traces(path: str | Path, clients: int) -> Traces:
    """The traces of ``clients`` clients from a CSV or JSON file; a ValueError names what is wrong."""
    path = Path(path)
    try:
        if not path.is_file():
            meant = "" if path.exists() else did_you_mean([closest(str(path), BUILT_IN)])
            raise ValueError(f"the trace file {path} " + ("is a folder" if path.is_dir() else "does not exist" if not
                             path.exists() else "is not a regular file") + f"{meant}; give a CSV or JSON file")
        if path.stat().st_size > clients * ROW_BYTES + (1 << 16):  # a 1 GB file would fill the memory first
            raise ValueError(f"the trace file {path} holds {path.stat().st_size / 2**20:,.0f} MiB, more than "
                             f"{clients:,} clients' rows can (--clients {clients}); give one row per client")
        if is_csv(path):
            plain = _plain_csv_table(path, clients)
            return plain if plain is not None else _table_of(path, _csv_rows(path), clients)
        text = path.read_text(encoding="utf-8-sig")  # not UTF-8: said below as what it is, not as bad JSON
        try:
            rows = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
            header = {name.strip() for name in text.partition("\n")[0].split(",")}
            if header >= set(COLUMNS):
                raise ValueError(f"{path} is a CSV (its first line names the columns), read as JSON as a file not "
                                 "named .csv is; name it .csv") from None
            raise ValueError(f"cannot read the traces in {path} as JSON (a file not named .csv is read as JSON): "
                             f"{exc}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: traces must be a CSV with a header row or a JSON list of objects")
        return _table_of(path, rows, clients)
    except OSError as exc:  # its strerror: not "[Errno 21] Is a directory: 'PATH'"
        raise ValueError(f"cannot read the traces in {path}: {exc.strerror or exc}; give a CSV or JSON file") from None
    except UnicodeDecodeError:
        with open(path, "rb") as f:  # a spreadsheet's "Unicode text" is UTF-16: text, but not the UTF-8 read here
            utf16 = f.read(2) in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
        said = "it is UTF-16 text; save it as UTF-8" if utf16 else "it is not a text file; give a CSV or JSON file"
        raise ValueError(f"cannot read the traces in {path}: {said}") from None
    except csv.Error as exc:  # e.g. a field past csv's size limit
        raise ValueError(f"cannot read the traces in {path} as CSV: {exc}") from None


def _plain_csv_table(path: Path, clients: int) -> Traces | None:
    """The traces of a CSV of plain numbers whose rows are all right, read by numpy (a million clients' file: about a
    second, against ten row by row); None for any other file, which the row-by-row reader then reads or says what is
    wrong with, row by row."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = f.readline().rstrip("\r\n").split(",")
        if sorted(header) != sorted(COLUMNS):
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an empty body is a warning to loadtxt
                data = np.loadtxt(f, delimiter=",", dtype=np.float64, ndmin=2, comments=None)
        except (ValueError, UserWarning):
            return None
    if data.shape != (clients, len(COLUMNS)):
        return None
    data = data[:, [header.index(c) for c in COLUMNS]]
    client, values = data[:, 0], data[:, 1:]
    if not np.array_equal(np.sort(client), np.arange(clients)):  # whole numbers 0..N-1, each once
        return None
    with np.errstate(invalid="ignore"):  # NaN fails every test below, as it should
        fits = ((values >= 0) & (values <= MOST_VALUE)).all() and (values[:, 1:3] >= LEAST_MBPS).all() \
            and (values[:, 0] <= MOST_SECONDS_PER_STEP).all()
    if not fits:
        return None
    table = np.empty_like(values)
    table[client.astype(np.int64)] = values
    return Traces(*(table[:, k].astype(np.float32) for k in range(table.shape[1])))


def _csv_rows(path: Path):
    """The rows of a CSV trace file as dicts, read one at a time (utf-8-sig: a spreadsheet's BOM is no column; a space
    after a comma, as a file written by hand has, is none of the name or value)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            header = ",".join(reader.fieldnames) if reader.fieldnames else "no header row (the file is empty)"
            raise ValueError(f"{path} has {header}; its first line must name the columns {','.join(COLUMNS)}")
        for n, row in enumerate(reader, start=1):
            if None in row:  # DictReader keeps the values past the header's columns under None
                raise ValueError(f"{path}, entry {n}: {len(row) - 1 + len(row[None])} values for the header's "
                                 f"{len(row) - 1} columns")
            yield row


def _number(value, whole: bool = False) -> float | int:
    """A CSV cell or JSON value as a number (an int when ``whole``); ValueError for anything else (JSON true is 1 to
    float(), and 1.5 is 1 to int(): neither is taken)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    number = float(value)
    if whole and not float(number).is_integer():
        raise ValueError(value)
    return int(number) if whole else number


def _table_of(path: Path, rows, clients: int) -> Traces:
    """The traces of ``rows`` (dicts by column name), one per client numbered 0..clients-1."""
    table = np.full((clients, len(COLUMNS) - 1), np.nan, np.float64)
    entry = np.zeros(clients, np.int64)  # each client's entry number, to name a second one
    for n, row in enumerate(rows, start=1):
        try:
            client = _number(row["client"], whole=True)
            values = [_number(row[c]) for c in COLUMNS[1:]]
        except (KeyError, ValueError, OverflowError):
            raise ValueError(f"{path}, entry {n}: needs the columns {', '.join(COLUMNS)}, all numbers (client a "
                             "whole one)") from None
        if not 0 <= client < clients:
            raise ValueError(f"{path}, entry {n}: client {client} is outside 0..{clients - 1} (--clients {clients})")
        if entry[client]:
            raise ValueError(f"{path}, entries {entry[client]} and {n} are both client {client}; give one row per "
                             "client")
        if not all(0 <= v <= MOST_VALUE for v in values) or min(values[1:3]) < LEAST_MBPS \
                or values[0] > MOST_SECONDS_PER_STEP:
            raise ValueError(f"{path}, entry {n}: values must be numbers >= 0 (at most {MOST_VALUE:.3g}), link "
                             f"speeds > 0 (at least {LEAST_MBPS:g} Mbps), seconds_per_step at most "
                             f"{MOST_SECONDS_PER_STEP:g} (a day)")
        table[client], entry[client] = values, n
    missing = np.flatnonzero(entry == 0)
    if len(missing):
        raise ValueError(f"{path} has no trace for {len(missing)} of the {clients} clients (e.g. client "
                         f"{missing[0]}); give every client a row")
    return Traces(*(table[:, k].astype(np.float32) for k in range(table.shape[1])))


def traces_for(spec: str | None, clients: int, seed: int) -> Traces | None:
    """``--trace``: None, "fedscale" (generated) or a CSV/JSON file."""
    if not spec:
        return None
    traces = generate_traces(clients, seed) if spec in BUILT_IN else load_traces(spec, clients)
    if not np.any(traces.available_for > 0):  # no round could ever sample anyone: the run would wait for ever
        raise ValueError(f"no client of --trace {spec} is ever online (every available_for is 0); give a trace in "
                         "which some clients are")
    return traces
