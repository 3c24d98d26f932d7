"""--task REF and the repeatable --task-option KEY=VALUE of `fedpar serve|client|simulate|train` (or a TOML
``task = "..."`` and a ``[COMMAND.task_options]`` table): the task a command runs instead of --model/--dataset.
Both are declared once, in ``fedpar.task.TaskReference``."""

from __future__ import annotations

import argparse
from pathlib import PurePath
from typing import Any

from fedpar.cli.argtypes import as_mapping
from fedpar.cli.config import chose, ignored_given

# the zoo's settings that a task (or a Flower App) replaces with its own model and data: given beside it, each would
# be ignored
REPLACED_BY_TASK = ("dataset", "model", "data_dir", "data_path", "model_arg")


def task_options(args: argparse.Namespace) -> dict[str, Any]:
    """The --task-option pairs (or the config file's table) as a dict."""
    return as_mapping(getattr(args, "task_options", None), "task_options")


def check_nothing_replaced(args: argparse.Namespace) -> None:
    """TaskError (a ValueError) naming the zoo's flags the user typed beside --task or --flower-app, which bring
    their own model and data (a --config file's are said in a note: cli/config.py ignored_given)."""
    from fedpar.task import TaskError

    by = "--task" if getattr(args, "task", None) else "--flower-app" if getattr(args, "flower_app", None) else None
    ignored = {dest: f"{by} brings its own model and data" for dest in REPLACED_BY_TASK} if by else {}
    given = [f"--{dest.replace('_', '-')}" for dest in ignored_given(args, ignored)]
    if given:
        own = "--task-option KEY=VALUE" if by == "--task" else "--run-config 'KEY=VALUE ...'"
        raise TaskError(f"{by} brings its own model and data, so {' and '.join(given)} would be ignored: drop "
                        f"{'it' if len(given) == 1 else 'them'} (its own settings are {own})")


def check_task_options(args: argparse.Namespace) -> None:
    """TaskError (a ValueError) for --task-option pairs without --task: every command that takes them (serve, client,
    train, simulate) refuses them alike; a --config file's table is said in a note (cli/config.py ignored_given)."""
    from fedpar.task import TaskError

    if getattr(args, "task", None) or not task_options(args):
        return
    if ignored_given(args, {"task_options": "it needs --task"}) or not chose(args, "task_options"):
        if getattr(args, "flower_app", None):  # a Flower user's run-config override, given the wrong way
            raise TaskError("--task-option needs --task; a Flower App's run config is overridden with "
                            "--run-config 'KEY=VALUE ...'")
        raise TaskError("--task-option needs --task")


def load_task_from_args(args: argparse.Namespace):
    """The task ``--task`` names, made with its options; TaskError (a ValueError) saying what is wrong. Options
    without --task are refused."""
    from fedpar.tasks.reference import load_task

    check_nothing_replaced(args)
    check_task_options(args)
    if not args.task:
        return None
    return load_task(args.task, task_options(args))


def names_a_file(value: Any) -> bool:
    """Whether a --task-option value is a path to a site's file or folder (absolute, './' or '../' or '~'
    relative, or with a folder part and a file extension), not a setting that happens to hold a '/' ('1/2')."""
    text = str(value)
    if "/" not in text:
        return False
    path = PurePath(text)
    return text.startswith(("/", "./", "../", "~")) or bool(path.suffix[1:].isalnum() and path.suffix[1:])


def task_label(args: argparse.Namespace) -> str:
    """The task ``args`` train, as agents declare it at Join and a service's run asks for it: 'MODEL on DATASET'
    for a built-in one, else the --task reference with its options; a file's folder is left out, the task file's
    and a data path option's alike (each site keeps its copy where it likes)."""
    if not args.task:
        kind, sep, where = str(args.dataset).partition(":")
        return f"{args.model} on {kind}{sep}{PurePath(where).name if sep else ''}"
    where, sep, factory = str(args.task).rpartition(":")
    reference = f"{PurePath(where).name if where.endswith('.py') else where}{sep}{factory}" if sep else args.task
    options = task_options(args)
    shown = {key: PurePath(str(value)).name if names_a_file(value) else value for key, value in options.items()}
    return (reference + "".join(f" {key}={shown[key]}" for key in sorted(shown)))[:256]  # Join's capability limit
