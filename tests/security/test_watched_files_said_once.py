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
        assert _said(caplog) == []  # a new deployment's normal state (it was a line before every service's banner)
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


def test_a_missing_revocation_list_is_said_at_debug_level_and_its_removal_and_damage_clearly(tmp_path, caplog):
    path = tmp_path / "revoked.txt"
    with caplog.at_level("DEBUG", logger="fedpar.security"):
        revocations = RevocationList(path)
    assert [r.levelname for r in caplog.records if "does not exist (yet)" in r.getMessage()] == ["DEBUG"]
    caplog.clear()
    with caplog.at_level("INFO", logger="fedpar.security"):
        append_revocation(path, agent_id="bob")
        assert revocations.refresh() and revocations.is_revoked("bob")
        path.unlink()  # what it revoked no longer applies: said
        assert not revocations.refresh()[0]
        assert _said(caplog) == [f"read {path}", f"{path} does not exist (yet): nothing in it applies"]
        path.mkdir()  # there, and unreadable: an error, the previous contents kept
        revocations.refresh()
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname == "ERROR"] == \
        [("ERROR", f"cannot use {path}: Is a directory; keeping its previous contents")]
    with pytest.raises(ValueError, match="Is a directory"):
        RevocationList(path)  # at a start: refused
