"""fedpar's own settings that a run of a Flower App (``simulate --flower-app``, ``serve --flower-app``) cannot apply,
each refused in one line saying what to do instead: where its ServerApp drives (no --strategy), fedpar's local
training and strategy options, which its Messages do not carry; in either mode, --target-accuracy, which nothing
could reach."""

from __future__ import annotations

import argparse

from fedpar.cli.config import ignored_given
from fedpar.cli.task_options import check_nothing_replaced, check_task_options

# fedpar scores a model centrally on a test set of its own data or task; a Flower App's ClientApps load their own data
# and evaluate it themselves (server/assembly.py for_flower_app, and a ServerApp's evaluation is its own), so
# summary.json's final_test_accuracy and rounds_to_target stay null
NO_CENTRAL_EVALUATION = ("--target-accuracy: fedpar has no central evaluation of a Flower App's model (its ClientApps "
                         "evaluate on their own data), so no round could reach the target; drop it")
# The local training fedpar's tasks carry (with --strategy, in each train Message's config: client/flower_app_member.py)
LOCAL_TRAINING = ("learning_rate", "local_epochs", "batch_size", "client_eval_every")


def flower_app_refusal(args: argparse.Namespace, server_app_drives: bool) -> str | None:
    """One line refusing what the user typed that a run of ``args.flower_app`` would ignore (``server_app_drives``:
    its ServerApp drives the rounds), and what to do instead; None when there is none (or no Flower App). A --config
    file's are said in a note (cli/config.py ignored_given)."""
    from fedpar.protocol.task_settings import LocalTraining
    from fedpar.settings import flag_of

    if not getattr(args, "flower_app", None):
        return None
    try:  # --dataset, --model: the app's ClientApps load their own data and build their own model
        check_nothing_replaced(args)
        check_task_options(args)  # --task-option KEY=VALUE, a Flower user's run-config override: ignored
    except ValueError as exc:
        return str(exc)
    if getattr(args, "target_accuracy", None) is not None:
        return NO_CENTRAL_EVALUATION
    if not server_app_drives:
        return None
    decides = "the Flower App's ServerApp decides"
    typed = ignored_given(args, {"strategy_options": f"{decides} its aggregation",
                                 **dict.fromkeys(LOCAL_TRAINING, f"{decides} local training")})
    if "strategy_options" in typed:
        return ("--strategy-option: the Flower App's ServerApp aggregates with its own strategy, so fedpar cannot "
                "apply it; drop it, or add --strategy NAME to let that fedpar strategy (with its options) drive the "
                "app's ClientApps")
    given = [flag_of(LocalTraining, name) for name in typed]
    if not given:
        return None
    it = "it" if len(given) == 1 else "them"
    return (f"{', '.join(given)}: the Flower App's ServerApp decides local training (the config of the Messages it "
            f"sends), so fedpar cannot apply {it}; drop {it}, or set {it} in the app's run config (--run-config "
            f"'KEY=VALUE', for the keys its apps read), or add --strategy NAME to let fedpar drive the app's "
            f"ClientApps (each train Message's config then carries --lr, --local-epochs and --batch-size)")
