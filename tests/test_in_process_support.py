"""A command run by its main in a test's own process leaves torch as it found it (tests/support/in_process.py)."""

from __future__ import annotations

import torch

from support.in_process import flushes_denormals, torch_state_put_back


def test_a_commands_threads_and_denormal_flushing_are_put_back_after_it():
    """What a command sets for its own process (threads, flushing denormals) is undone, so later tests in the worker
    compute with denormals as before."""
    threads, flushing = torch.get_num_threads(), flushes_denormals()
    with torch_state_put_back():
        torch.set_num_threads(1)
        torch.set_flush_denormal(not flushing)
        assert flushes_denormals() is (not flushing)
    assert (torch.get_num_threads(), flushes_denormals()) == (threads, flushing)
