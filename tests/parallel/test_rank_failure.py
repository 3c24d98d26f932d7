"""parallel/rank_failure.py: what torch's spawn raises for a failed rank, said in one line."""

import signal

import pytest
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from fedpar.parallel.rank_failure import RankFailed, rank_failure, ranks_said_in_one_line
from fedpar.task import TaskError


def _raised(last_line: str, rank: int = 1) -> ProcessRaisedException:
    trace = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
             f'  File "x.py", line 1, in f\n    g()\n{last_line}\n')
    return ProcessRaisedException(trace, rank, 42)


def test_a_raised_rank_is_named_with_the_line_it_ended_on_and_fedpars_own_errors_without_their_class():
    said = rank_failure(_raised("RuntimeError: CUDA error: invalid device ordinal"))
    assert isinstance(said, RankFailed) and (said.rank, said.what) == (1, "failed: RuntimeError: CUDA error: "
                                                                           "invalid device ordinal")
    assert str(said) == "rank 1 failed: RuntimeError: CUDA error: invalid device ordinal"
    assert str(rank_failure(_raised("fedpar.parallel.trainer.Other: the data ran out"))) == \
        "rank 1 failed: the data ran out"


def test_a_kind_passed_through_is_made_again_from_its_message():
    said = rank_failure(_raised("fedpar.task.TaskError: labels must be integers", 0), passes=(TaskError,))
    assert type(said) is TaskError and str(said) == "labels must be integers"


def test_a_killed_or_exited_rank_says_how():
    killed = ProcessExitedException("x", 2, 42, exit_code=-signal.SIGKILL, signal_name="SIGKILL")
    assert str(rank_failure(killed)) == "rank 2 was killed by SIGKILL (out of memory, or stopped from outside)"
    assert str(rank_failure(ProcessExitedException("x", 0, 42, exit_code=3))) == "rank 0 ended with exit code 3"


def test_the_guard_raises_the_one_line_and_with_debug_torchs_exception():
    with pytest.raises(RankFailed, match="^rank 1 failed: ValueError: bad$"):
        with ranks_said_in_one_line(debug=False):
            raise _raised("ValueError: bad")
    with pytest.raises(ProcessRaisedException):
        with ranks_said_in_one_line(debug=True):
            raise _raised("ValueError: bad")
