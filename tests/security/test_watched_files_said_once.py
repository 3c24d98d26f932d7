"""A service reads its revocation list (and tokens file) in several places (the start-up check, the control API, the
agents' port, each run's coordinator, each aggregator rank): each reading is said once per change of the file."""

from __future__ import annotations

import pytest

from fedpar.cli.main import build_parser
from fedpar.cli.tlsopts import server_security
from fedpar.security.admission import RevocationList, append_revocation
from fedpar.security.certs import CertPaths

SAID = ("does not exist (yet)", "read ")


@pytest.fixture
def certs(tmp_path):
    """A folder made by the real command, without a revocation file yet."""
    from fedpar.cli.main import main

    assert main(["certs", "--out", str(tmp_path / "certs"), "--agents", "alice,bob"]) == 0
    return tmp_path / "certs"


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fedpar.security" and
            any(words in r.getMessage() for words in SAID)]


def test_a_services_readings_of_its_revocation_list_are_said_once_per_change(certs, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = build_parser().parse_args(["serve", "--certs", str(certs)])
    with caplog.at_level("INFO", logger="fedpar.security"):
        lists = [server_security(args).admission.revocations for _ in range(3)]  # start, agents' port, a run
        assert _said(caplog) == [f"{CertPaths(certs).revoked} does not exist (yet): nothing in it applies"]
        caplog.clear()
        append_revocation(CertPaths(certs).revoked, agent_id="bob")
        assert all(revocations.refresh() and revocations.is_revoked("bob") for revocations in lists)
        server_security(args)  # the next run
        assert _said(caplog) == [f"read {CertPaths(certs).revoked}"]


@pytest.mark.parametrize("launcher_warned, rank, said_first, said_change",
                         [(True, "0", False, True), (True, "1", False, False), (False, "1", False, False)])
def test_aggregator_ranks_leave_the_first_reading_to_their_launcher_and_changes_to_rank_0(
        certs, caplog, monkeypatch, launcher_warned, rank, said_first, said_change):
    monkeypatch.setenv("RANK", rank)
    args = build_parser().parse_args(["serve", "--certs", str(certs)])
    args.launcher_warned = launcher_warned
    with caplog.at_level("INFO", logger="fedpar.security"):
        revocations = server_security(args, warn=not launcher_warned).admission.revocations
        server_security(args)  # a service's rank 0 checks it again as it starts its control API
        assert bool(_said(caplog)) == said_first
        append_revocation(CertPaths(certs).revoked, agent_id="bob")
        assert revocations.refresh() and revocations.is_revoked("bob")
        assert bool(_said(caplog)) == said_change


def test_a_watched_file_is_shared_by_path_and_separate_lists_stay_separate(tmp_path):
    path = tmp_path / "revoked.txt"
    assert RevocationList.watching(path) is RevocationList.watching(tmp_path / "." / "revoked.txt")
    assert RevocationList(path) is not RevocationList.watching(path)  # a list made directly is its own
