"""revoked.txt and tokens.txt are edited by hand (a revocation is undone by removing its line), and an editor may save
them as UTF-16. A service then said 'cannot use revoked.txt: it is not a text file; keeping its previous contents' at
every call that checked it, 4 lines every few seconds for as long as the file stayed so, and `fedpar certs` wrote the
certificates asked for and then exited 2 with the codec's words ('utf-8' codec can't decode byte 0xff in position
0), naming no file (or appended a revocation a coordinator could never read). Now the service says it once per change
of the file, and `fedpar certs` refuses before it writes anything, naming the file and what to do. A file saved with a
byte-order mark revokes its first line's agent too. The real watcher, and the command's main in this process."""

from __future__ import annotations

import logging

import pytest

from fedpar.security.admission import RevocationList
from fedpar.security.certs import ensure_certs
from support.in_process import run_main

UTF16 = "utf-16"  # as Windows Notepad's 'Unicode' saves it: a byte-order mark 0xff 0xfe, then two bytes a character


def _unusable(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fedpar.security" and "cannot use" in r.getMessage()]


def test_a_revocation_list_saved_as_utf16_is_said_once_per_change_and_its_revocations_kept(tmp_path, caplog):
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("alice\n")
    watcher = RevocationList(revoked)
    caplog.set_level(logging.INFO, logger="fedpar.security")
    revoked.write_text("alice\nbob\n", encoding=UTF16)
    for _ in range(5):  # each call that checks an agent refreshes it
        assert watcher.refresh()[0] == {"alice"}  # kept: alice stays revoked
    said = _unusable(caplog)
    assert said == [f"cannot use {revoked}: it is not UTF-8 text: byte 0xff at line 1, column 1 (saved as UTF-16 or "
                    "Latin-1?); save it as UTF-8; keeping its previous contents"], said
    revoked.write_text("alice\nbob\n")  # saved again as UTF-8: read
    assert watcher.refresh()[0] == {"alice", "bob"}
    revoked.write_text("carol\n", encoding=UTF16)  # a new change is said again, once
    for _ in range(3):
        assert watcher.refresh()[0] == {"alice", "bob"}
    assert len(_unusable(caplog)) == 2


@pytest.mark.parametrize("listed,args", [("revoked.txt", ["--agents", "carol"]),
                                         ("revoked.txt", ["--revoke", "alice"]),
                                         ("tokens.txt", ["--mint-token", "dave"]),
                                         ("tokens.txt", ["--revoke", "alice"])])
def test_certs_with_a_list_saved_as_utf16_refuses_before_writing_naming_the_file(tmp_path, capfd, listed, args):
    certs = tmp_path / "certs"
    ensure_certs(certs, ["alice"])
    (certs / listed).write_text("bob\n" if listed == "revoked.txt" else "", encoding=UTF16)
    before = {p.name: p.read_bytes() for p in certs.iterdir() if p.is_file()}
    done = run_main(["certs", "--out", str(certs), *args], capfd)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        f"fedpar certs: cannot use {certs / listed}: it is not UTF-8 text: byte 0xff at line 1, column 1 (saved as "
        "UTF-16 or Latin-1?); save it as UTF-8"], done.stderr
    assert {p.name: p.read_bytes() for p in certs.iterdir() if p.is_file()} == before  # nothing written


def test_a_revocation_list_saved_with_a_byte_order_mark_revokes_its_first_agent(tmp_path):
    # 'UTF-8 with BOM' (an editor's choice): the first line was read as '\ufeffalice', and alice was let in
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("alice\nbob\n", encoding="utf-8-sig")
    watcher = RevocationList(revoked)
    assert watcher.is_revoked("alice") and watcher.is_revoked("bob")


def test_a_new_token_replaces_the_earlier_one_in_a_tokens_file_saved_with_a_byte_order_mark(tmp_path, capfd):
    # the earlier line ('\ufeffalice HASH') was not found as alice's: a second line was appended beside it, and
    # 'replaced the earlier enrollment token' was not said
    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--mint-token", "alice,bob"], capfd).returncode == 0
    tokens = certs / "tokens.txt"
    tokens.write_text(tokens.read_text(), encoding="utf-8-sig")
    done = run_main(["certs", "--out", str(certs), "--mint-token", "alice"], capfd)
    assert done.returncode == 0 and "replaced the earlier enrollment token of agent alice" in done.stdout, done
    assert sorted(line.split()[0] for line in tokens.read_text(encoding="utf-8-sig").splitlines()) == ["alice", "bob"]


def test_the_agent_of_the_first_token_in_a_tokens_file_with_a_byte_order_mark_can_be_revoked(tmp_path, capfd):
    # it was refused: 'no certificate or enrollment token for agent 'alice'' (the line read as '\ufeffalice')
    certs = tmp_path / "certs"
    assert run_main(["certs", "--out", str(certs), "--mint-token", "alice"], capfd).returncode == 0
    tokens = certs / "tokens.txt"
    tokens.write_text(tokens.read_text(), encoding="utf-8-sig")
    done = run_main(["certs", "--out", str(certs), "--revoke", "alice"], capfd)
    assert done.returncode == 0 and done.stdout == f"revoked agent alice in {certs / 'revoked.txt'}\n", done
    assert RevocationList(certs / "revoked.txt").is_revoked("alice")


def test_a_run_starting_while_revoked_txt_is_unusable_keeps_its_revocations_and_starts(tmp_path, caplog,
                                                                                        monkeypatch):
    # each queued run that started then failed for good, 'cannot start: cannot use certs/revoked.txt: ...' (and a
    # submit was refused as the run file's mistake), one after another while the file stayed so
    from fedpar.cli.main import build_parser
    from fedpar.cli.tlsopts import server_security

    monkeypatch.delenv("RANK", raising=False)
    certs = tmp_path / "certs"
    ensure_certs(certs, ["alice"])
    (certs / "revoked.txt").write_text("alice\n")
    args = build_parser().parse_args(["serve", "--certs", str(certs)])
    assert server_security(args).admission.revocations.is_revoked("alice")  # the service's start: read
    (certs / "revoked.txt").write_text("alice\nbob\n", encoding=UTF16)
    caplog.set_level(logging.INFO, logger="fedpar.security")
    for _ in range(3):  # a submit's check and each run's start, as the agents' port goes on
        assert server_security(args).admission.revocations.is_revoked("alice")
    assert len(_unusable(caplog)) == 1, _unusable(caplog)
