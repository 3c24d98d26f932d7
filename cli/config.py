"""TOML configuration files for the command line: file values become defaults, flags override.

A subcommand's table may hold nested tables, e.g. ``[train.parallel]``: their keys are options of the
subcommand like the table's own (``tp = 2`` there means ``--tp 2``), unless the subcommand has an option
named after the table, which then receives the whole table as a dict (``[train.model_kwargs]``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedpar.cli.argtypes import key_value_list
from fedpar.cli.declared import Needs
from fedpar.cli.renamed import AliasOption, RenamedOption, RetiredFlag, note_renamed
from fedpar.cli.subcommands import SUBCOMMANDS
from fedpar.meant import closest
from fedpar.protocol.small_files import read_toml_file


class ConfigError(ValueError):
    """A configuration file that cannot be used, with a message that says what to change."""


def _key(name: str) -> str:
    return name.replace("-", "_")


def _flatten(table: dict[str, Any], where: str, dict_options: set[str], skip: set[str],
             out: dict[str, Any], origin: dict[str, str], names: dict[str, str], prefix: str = "") -> None:
    label = f"[{where}]" if where else "the top level"
    for raw, value in table.items():
        key = _key(raw)
        if isinstance(value, dict) and key not in dict_options:
            if raw not in skip:
                _flatten(value, f"{where}.{raw}" if where else raw, dict_options, set(), out, origin, names,
                         f"{prefix}{raw}.")
            continue
        if key in out and origin[key] == label:  # learning-rate beside learning_rate: was 'in [serve] and in [serve]'
            said = f"in {label}" if where else "at the top level"
            raise ConfigError(f"{names[key]} and {prefix}{raw} {said} are the same option; keep {prefix}{key}")
        if key in out:
            raise ConfigError(f"option {key} is set twice, in {origin[key]} and in {label}; keep one of them")
        out[key], origin[key], names[key] = value, label, f"{prefix}{raw}"


def load_toml_section(path: str | Path, section: str, dict_options: set[str] | frozenset[str] = frozenset()
                      ) -> dict[str, Any]:
    """Read ``path`` and return the options of ``section`` (its table, or the top level when there is none).

    Nested tables are flattened into the options (an option in ``dict_options`` takes its table as a dict);
    at the top level, tables named after other subcommands are left to those subcommands.
    """
    return _load(path, section, dict_options)[0]


def load_toml_section_and_file(path: str | Path, section: str, dict_options: set[str] | frozenset[str]
                               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load_toml_section`'s options, and the whole file as read (for checks of its layout: read once)."""
    values, _, doc = _load(path, section, dict_options)
    return values, doc


def _load(path: str | Path, section: str, dict_options: set[str] | frozenset[str]
          ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """:func:`load_toml_section`, each option's key as written in the file (``parallel.tp``), and the whole file."""
    path = Path(path)
    try:
        doc = read_toml_file(path, "config file")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    own = section in doc
    table = doc[section] if own else doc
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] in {path} must be a table")
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    try:
        _flatten(table, section if own else "", set(dict_options), set() if own else set(SUBCOMMANDS),
                 values, {}, names)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return values, names, doc


_FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
_LISTS = (argparse._AppendAction, argparse._ExtendAction)
_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", Path: "a path (a string)"}


def typed_value(action: argparse.Action, value: Any) -> Any:
    """``value`` from a TOML file as the option's flag would make it; ValueError saying what was expected."""
    if isinstance(action, RenamedOption):
        raise ValueError(action.toml_message)
    if isinstance(action, RetiredFlag):
        action.tell_toml()
        return value
    if isinstance(action, _FLAGS):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if isinstance(action, _LISTS):
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"expected a string or a list of strings, got {value!r}")
        try:  # an item's range or form (cli/argtypes.py): was a traceback
            converted = [action.type(item) if action.type else item for item in items]
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        if isinstance(action, argparse._ExtendAction):
            converted = [part for item in converted for part in (item if isinstance(item, list) else [item])]
        return converted
    if not isinstance(action, argparse._StoreAction):
        return value  # options with actions of their own (--strategy-option) check their values themselves
    if action.choices is not None:
        values = getattr(action, "choice_values", {})
        if value in action.choices or any(value is v or (value == v and type(value) is type(v))
                                          for v in values.values()):
            return value
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    kind = getattr(action.type, "kind", action.type) or str
    if kind in _KIND_WORDS:
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = numeric and (kind is float or isinstance(value, int)) if kind in (int, float) else isinstance(value, str)
        if not ok:
            raise ValueError(f"expected {_KIND_WORDS[kind]}, got {value!r}")
        if kind is float:
            value = float(value)
    elif not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    if action.type is None:
        return value
    try:
        return action.type(value if isinstance(value, str) else str(value))  # range checks (cli/argtypes.py)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def apply_config_defaults(parser: argparse.ArgumentParser, argv: list[str], section: str) -> frozenset[str]:
    """If ``--config FILE`` is among ``argv``, make the file's values the parser's defaults; returns the settings
    (dests) the file set."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--config")
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # --config without its file: the command's own parser says so, in its one line
        return frozenset()
    if not known.config:  # none, or an empty one ("$CONFIG" unset): the command's parser refuses the latter
        return frozenset()
    # Options without a flag (set with parser.set_defaults) can be set from the file too; --help, --config and the
    # command's words (run's action, export's source) cannot: a file's config or help went unread, its words = "ls"
    # was split into letters
    dests = ({a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
             | {k for k in parser._defaults if not k.startswith("_")})
    dict_options = {k for k in dests if isinstance(parser.get_default(k), dict)}
    values, names, doc = _load(known.config, section, dict_options)
    _refuse_misnamed_tables(doc, known.config, dict_options)
    if not values:  # a file of other commands' tables only would be ignored in silence
        _refuse_if_for_others(doc, known.config, section)
    _refuse_beside_own_table(doc, known.config, section)
    aliases = {a.old_key: a for a in parser._actions if isinstance(a, AliasOption)}
    for old in [key for key in values if key in aliases]:  # an option's old name still works, with a note
        written = names[old]
        rename_key(values, names, old, aliases[old].dest, known.config)
        aliases[old].note(f"fedpar {section}", f"{written} in {known.config}", aliases[old].dest)
    for key, dest in negated_key_dests(parser).items():  # no_central_eval = true: central_eval = false
        if key in values:
            _read_negated(values, names, key, dest, known.config, section)
    flag_keys = flag_key_dests(parser)
    for key in [key for key in values if key in flag_keys]:  # the flag's own name: deadline for deadline_seconds
        rename_key(values, names, key, flag_keys[key], known.config)
    unknown = sorted(set(values) - dests)
    if unknown:
        raise ConfigError(
            f"{known.config}: unknown option(s) for '{section}': "
            f"{_unknown_said(unknown, names, dict_options, dests)}; "
            f"run 'fedpar {section} --help' for the valid ones"
        )
    actions = {a.dest: a for a in parser._actions}
    for key, value in values.items():
        if key in dict_options and not _table_like(value, key in actions):  # was a traceback, or a line naming no file
            table = f"{section}.{names[key]}" if section in doc else names[key]
            raise ConfigError(f"{known.config}: {names[key]}: expected a table ([{table}] with a KEY = VALUE line "
                              f"each), got {value!r}")
        if key in actions:
            try:
                values[key] = typed_value(actions[key], value)
            except ValueError as exc:
                raise ConfigError(f"{known.config}: {names[key]}: {exc}") from None
    typed = given_settings(parser, argv, frozenset())
    for key in [key for key in values if key in typed and isinstance(actions.get(key), _LISTS)]:
        del values[key]  # the flag's items replace the file's list: argparse would add them to it
    parser.set_defaults(**values, _file_keys={key: names[key] for key in values})  # as the file spells them
    for action in parser._actions:
        if action.required and action.dest in values:  # argparse checks a required option's flag, never its default
            action.required = False
    return frozenset(values)


def _table_like(value: Any, flagged: bool) -> bool:
    """Whether ``value`` can be a table option's: a TOML table, or for one with a KEY=VALUE flag (``flagged``:
    --strategy-option) also a list of "KEY=VALUE" strings, as the flag repeated."""
    return isinstance(value, dict) or (flagged and key_value_list(value))


def flag_key_dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's key spelled as its flag (``lr``, ``deadline``) -> the option's own (``learning_rate``,
    ``deadline_seconds``), for the options whose two differ: a file may use either."""
    return {a.flag_key: a.dest for a in parser._actions if getattr(a, "flag_key", None)}


def negated_key_dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each old key of a true/false setting once declared negatively (``no_central_eval``) -> the option it became
    (``central_eval``), which holds the opposite value (cli/renamed.py add_negated_key)."""
    return {a.negated_key: a.dest for a in parser._actions if getattr(a, "negated_key", None)}


def _read_negated(values: dict[str, Any], names: dict[str, str], key: str, dest: str, path: str,
                  section: str) -> None:
    """Move the file's ``key`` (``no_central_eval = true``) to the option ``dest`` it became, with the opposite
    value (``central_eval = false``), and say so in one line."""
    value = values[key]
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: {names[key]}: expected true or false, got {value!r}")
    written = names[key]
    rename_key(values, names, key, dest, path)
    values[dest] = not value
    new = written[:len(written) - len(key)] + dest  # in the file's own table: data.central_eval
    note_renamed(f"fedpar {section}", f"{written} = {_toml_bool(value)} in {path}", f"{new} = {_toml_bool(not value)}")


def _toml_bool(value: bool) -> str:
    return "true" if value else "false"


def rename_key(values: dict[str, Any], names: dict[str, str], key: str, dest: str, path: str) -> None:
    """Move the file's ``key`` to the option ``dest`` it names; ConfigError when the file sets ``dest`` too."""
    if dest in values:
        raise ConfigError(f"{path}: {names[key]} and {names[dest]} are the same option; keep {names[dest]}")
    values[dest], names[dest] = values.pop(key), names.pop(key)


def _unknown_said(unknown: list[str], names: dict[str, str], dict_options: set[str], known: set[str]) -> str:
    """The ``unknown`` options, each as the file writes it (``parallel.fdsp``) with the ``known`` one it likely
    misspells; those of a nested table named close to an option that takes a table are said as that table, with the
    option: a misspelled ``[train.task_option]`` was flattened, and only its ``csv`` said."""
    said, tables = [], {}
    for key in unknown:
        table, _, leaf = names[key].rpartition(".")
        meant = closest(_key(table.rpartition(".")[2]), sorted(dict_options), cutoff=0.6) if table else None
        if meant:
            tables.setdefault((table, meant), []).append(leaf)
        elif option := closest(key, sorted(known - dict_options)):
            said.append(f"{names[key]} (did you mean {table + '.' if table else ''}{option}?)")
        elif option := closest(key, sorted(dict_options)):  # task_option = "csv=..." as the flag is spelled
            said.append(f"{names[key]} (did you mean {option}, a table with a KEY = VALUE line each?)")
        else:
            said.append(names[key])
    said += [f"{table} (a table holding {', '.join(leaves)}; did you mean {meant}?)"
             for (table, meant), leaves in tables.items()]
    return ", ".join(said)


def _refuse_if_for_others(doc: dict[str, Any], path: str, section: str) -> None:
    """ConfigError when ``doc``, the file at ``path``, holds tables of other subcommands only, none of ``section``'s."""
    others = [key for key in doc if key in SUBCOMMANDS]
    if others and section not in doc:
        raise ConfigError(f"config file {path} has nothing for '{section}': no [{section}] table and no option at its "
                          f"top level, only {', '.join(f'[{key}]' for key in others)}; add a [{section}] table")


def _refuse_misnamed_tables(doc: dict[str, Any], path: str, dict_options: set[str]) -> None:
    """ConfigError for a top-level table of ``doc``, the file at ``path``, named like a command but not one
    (``[simulat]``, ``[server]``): read as a group of the command's options, a ``[serv]`` table's keys were taken by
    'fedpar simulate'."""
    for key, value in doc.items():
        meant = closest(key, sorted(SUBCOMMANDS)) if isinstance(value, dict) and key not in SUBCOMMANDS else None
        if meant and _key(key) not in dict_options:
            raise ConfigError(f"{path}: [{key}] is no command's table (did you mean [{meant}]?); rename it")


def _refuse_beside_own_table(doc: dict[str, Any], path: str, section: str) -> None:
    """ConfigError naming the top-level keys of ``doc``, the file at ``path``, beside its [``section``] table: the
    command reads only that table then (the top level is for a file with no table of the command's), so they would
    be ignored in silence. Other commands' tables are theirs."""
    if not isinstance(doc.get(section), dict):
        return
    beside = [f"[{key}]" if isinstance(value, dict) else key for key, value in doc.items()
              if key != section and not (key in SUBCOMMANDS and isinstance(value, dict))]
    if beside:
        them, are = ("it", "it is") if len(beside) == 1 else ("them", "they are")
        raise ConfigError(f"{path}: {', '.join(beside)} at the top level would be ignored: with a [{section}] table "
                          f"'fedpar {section}' reads only that table; move {them} into [{section}] (or into the table "
                          f"of the command {are} for)")


def given_settings(parser: argparse.ArgumentParser, argv: list[str], from_file: frozenset[str]) -> frozenset[str]:
    """The settings (dests) the user chose: the options typed in ``argv`` and those a --config file set
    (``from_file``), as opposed to the ones left at their defaults."""
    typed = set()
    for token in argv:
        if token == "--":
            break
        action = parser._option_string_actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is not None:
            typed.add(action.dest)
    return frozenset(typed) | from_file


def chose(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user set ``dest`` (typed or in a --config file) for this command, rather than left its default
    (``args`` parsed by fedpar.cli.main; a namespace built another way chose nothing)."""
    return dest in getattr(args, "_given", frozenset())


def typed(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user typed ``dest``'s flag on this command's line, not only set it in a --config file (a file's
    table is shared by all of a command's uses: a key one of them ignores is no mistake there)."""
    return dest in getattr(args, "_typed", frozenset())


def ignored_given(args: argparse.Namespace, ignored: dict[str, str]) -> list[str]:
    """Of ``ignored`` (setting -> why this use of the command leaves it unused: 'it needs --optimizer sgd'), the
    settings to refuse: those the user typed. One only a --config file set is no mistake (a file's table is shared by
    all of a command's uses: momentum = 0.9 is for its runs with --optimizer sgd), so it is said in one note line,
    unless a typed one is refused (the refusal is then the one line)."""
    refused = [dest for dest in ignored if typed(args, dest)]
    if not refused:
        note_ignored(args, {dest: why for dest, why in ignored.items() if chose(args, dest)})
    return refused


def note_ignored(args: argparse.Namespace, from_file: dict[str, str]) -> None:
    """One note line naming each setting of ``from_file`` (setting -> why it is unused) as the --config file's key;
    each is said once, though the checks run again (a run's settings, an aggregator rank's: ``args._noted``)."""
    noted = getattr(args, "_noted", frozenset())
    new = {dest: why for dest, why in from_file.items() if dest not in noted}
    if new:
        args._noted = noted | set(new)
        written = getattr(args, "_file_keys", {})
        said = ", ".join(f"{written.get(dest, dest)} ({why})" for dest, why in new.items())
        print(f"fedpar {args.command}: note: ignored from {args.config}: {said}", file=sys.stderr)


def refuse_unswitched(args: argparse.Namespace, settings: list[tuple[str, str, Any, Needs]]) -> None:
    """ConfigError for the first of ``settings`` (cli/declared.py switched_options or switched_settings) that the user
    typed, or that holds another value than its default without a --config file setting it (a service's run file),
    while its switch leaves its feature off; those only a --config file set are said in a note
    (:func:`ignored_given`)."""
    ignored = {}
    for dest, flag, default, needs in settings:
        switch = getattr(args, needs.switch, None)
        if hasattr(args, dest) and not needs.applies(switch) and not any(getattr(args, d, None) for d in needs.unless):
            if typed(args, dest) or not chose(args, dest) and getattr(args, dest) != default:
                raise ConfigError(needs.refusal(flag, switch))
            ignored.setdefault(dest, f"it needs {needs.words}")
    ignored_given(args, ignored)
