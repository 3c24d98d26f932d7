"""Make the TLS material of a federation in one folder: a CA, the coordinator's certificate and one client
certificate per agent (subject CN = agent id). Run it again with more --agents to add agents to the same CA,
with --revoke to revoke agents or operators, or with --mint-token for agents that enroll by token instead of a
certificate. Example: 'fedpar certs --out certs --agents alice,bob', then 'fedpar serve --certs certs ...' and
'fedpar client --certs certs --agent-id alice ...'. Private keys (*.key) and tokens (*.token) are written
readable by their owner only; give each agent only ca.pem and its own ID.pem and ID.key (or ID.token).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedpar.cli.declared import add_declared, section
from fedpar.cli.user_errors import check_folder_writable, check_output_folder
from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.file_lock import FileLock, LockHeld, hold
from fedpar.security.admission import append_revocation, has_token, mint_token, parse_revocations, \
    parse_token_hashes, read_edited_file
from fedpar.security.certs import DEFAULT_DAYS, DEFAULT_SERVER_NAMES, RESERVED_NAMES, CertPaths, check_agent_id, \
    common_name, ensure_certs, load_certificate, server_san
from fedpar.sections import Output
from fedpar.settings import setting


LOG_LEVEL = None  # --log-level: none unless asked for (Python shows warnings)


@dataclass
class CertsOptions(Output):
    """What ``fedpar certs`` makes, extends or revokes (``out``: the certificate folder)."""

    agents: list[str] = setting(default_factory=list, append=True, check="id_list", group="certificates",
                                metavar="ID[,ID...]",
                                help="agent ids to issue client certificates for (certificate subject CN = agent id)")
    operators: list[str] = setting(default_factory=list, append=True, check="id_list", group="certificates",
                                   metavar="NAME[,NAME...]",
                                   help="operator names to issue client certificates with the operator role for "
                                        "(OUT/operators/NAME.pem and .key): only these may submit, stop or "
                                        "download runs on a service's control port")
    server_name: list[str] | None = setting(
        None, append=True, group="certificates", metavar="NAME",
        help="DNS name or IP address agents dial the coordinator by (repeat for several); given, it re-issues "
             "server.pem. Default for a new folder: " + ", ".join(DEFAULT_SERVER_NAMES))
    days: int = setting(DEFAULT_DAYS, check="cert_days", group="certificates",
                        help="validity of new server and agent certificates")
    force: bool = setting(False, group="certificates", help="re-issue certificates of agents that already have one")
    revoke: list[str] = setting(default_factory=list, append=True, check="id_list", group="revocation",
                                metavar="ID[,ID...]",
                                help="append these agent ids or operator names to OUT/revoked.txt; a coordinator "
                                     "watching it refuses them (agents on its agents' port, operators on its control "
                                     "port)")
    revoke_cert: list[Path] = setting(default_factory=list, append=True, group="revocation", metavar="PEM",
                                      help="append this certificate's serial number to OUT/revoked.txt (revokes that "
                                           "certificate only, so the agent may get a new one)")
    mint_token: list[str] = setting(default_factory=list, append=True, check="id_list", group="revocation",
                                    metavar="ID[,ID...]",
                                    help="make an enrollment token per agent: OUT/ID.token (give it to the agent) and "
                                         "its SHA-256 in OUT/tokens.txt (for 'fedpar serve --enrollment-tokens'), "
                                         "in place of the agent's earlier token, which then enrolls no more")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar certs``."""
    for key in ("outputs", "certificates", "revocation"):
        section(p, key)
    add_declared(p, CertsOptions, required=("out",))


def _names_itself(pem: Path) -> bool:
    """Whether ``pem`` is a certificate whose subject CN is its file's name (ID.pem of agent ID)."""
    try:
        return common_name(load_certificate(pem)) == pem.stem
    except (OSError, ValueError):
        return False


def known_agents(paths: CertPaths) -> set[str]:
    """Agent ids with a certificate (ID.pem, its key here or already given to the agent) or an enrollment token in
    ``paths``."""
    certs = {p.stem for p in paths.root.glob("*.pem") if p.stem not in RESERVED_NAMES and _names_itself(p)}
    tokens = set(read_edited_file(paths.tokens, parse_token_hashes)) if paths.tokens.exists() else set()
    return certs | tokens


def known_operators(paths: CertPaths) -> set[str]:
    """Operator names with a certificate in ``paths`` (operators/NAME.pem)."""
    return {p.stem for p in (paths.root / "operators").glob("*.pem")}


def check_known_agent(paths: CertPaths, agent_id: str) -> str:
    """What ``agent_id`` names here, "agent" or "operator" (both: "agent and operator"); ValueError if neither has
    a certificate or token here: a typo must not leave the real agent or operator trusted."""
    if not paths.root.is_dir():  # else said as an unknown name, 'agents there: none', in a folder typed wrong
        raise ValueError(f"--revoke {agent_id}: {paths.root} does not exist; give --out the folder 'fedpar certs' "
                         "made (the one holding ca.pem and the agents' certificates)")
    kinds = [kind for kind, known in (("agent", known_agents(paths)), ("operator", known_operators(paths)))
             if agent_id in known]
    if not kinds:
        agents = ", ".join(sorted(known_agents(paths))) or "none"
        operators = ", ".join(sorted(known_operators(paths))) or "none"
        raise ValueError(f"--revoke {agent_id}: no certificate or enrollment token for agent {agent_id!r} "
                         f"and no operator of that name in {paths.root} (agents there: {agents}; "
                         f"operators: {operators}); check the "
                         "name, or use --revoke-cert PEM for a certificate kept elsewhere")
    return " and ".join(kinds)


def serial_to_revoke(paths: CertPaths, pem: Path) -> int:
    """The serial number of certificate ``pem``; ValueError unless it is an agent's or operator's that the CA of
    ``paths`` issued (revoking any other serial would revoke nothing, yet say it had)."""
    try:
        cert = load_certificate(pem)
    except IsADirectoryError:
        raise ValueError(f"--revoke-cert {pem} is a folder; give the .pem file of the certificate to revoke") from None
    except ValueError:  # cryptography's 'Unable to load PEM file. See https://... MalformedFraming'
        raise ValueError(f"--revoke-cert {pem} is not a PEM certificate; give the .pem file of the "
                         "certificate to revoke") from None
    ca = load_certificate(paths.ca_cert)
    if cert.serial_number == ca.serial_number or cert.subject == cert.issuer:
        raise ValueError(f"--revoke-cert {pem} is a CA certificate, whose serial no agent presents: to stop trusting "
                         "everything it issued, make a new folder ('fedpar certs --out NEW_DIR --agents ...') and give "
                         "it to the coordinator and the agents to keep")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        raise ValueError(f"--revoke-cert {pem} was not issued by the CA in {paths.ca_cert}, so coordinators of "
                         f"{paths.root} refuse it already; give the certificate made in {paths.root}") from None
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:  # a certificate without usages may serve either end
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        raise ValueError(f"--revoke-cert {pem} is the coordinator's certificate, which no agent presents, so revoking "
                         "it would revoke nothing (revoked.txt is checked of agents and operators); to replace it, "
                         f"re-issue it: 'fedpar certs --out {paths.root} --server-name NAME' (one per name agents "
                         "dial)")
    return cert.serial_number


def warn_revoked_names(paths: CertPaths, names: list[str]) -> None:
    """Say which of ``names`` are revoked by name: a certificate issued to them now is refused all the same."""
    revoked = read_edited_file(paths.revoked, parse_revocations)[0] if paths.revoked.exists() else set()
    for name in sorted(revoked.intersection(names)):
        print(f"fedpar certs: {name} is revoked by name in {paths.revoked}, so coordinators refuse its certificate "
              f"(a new one too) until its line is removed there", file=sys.stderr)


def _take_turn(paths: CertPaths, making: bool) -> FileLock | None:
    """The lock of the certificate folder, held while this command reads and writes in it (the folder made first when
    ``making``; None when it is not there): two `fedpar certs` at once each made a CA, one's ca.pem left beside what
    the other's signed (and a token or revocation of one could be lost). Another's turn is waited for."""
    deadline = time.monotonic() + TURN_SECONDS
    while True:
        if making:
            paths.root.mkdir(parents=True, exist_ok=True)
        elif not paths.root.is_dir():
            return None
        try:
            return hold(paths.root / LOCK_FILE)
        except FileNotFoundError:  # the folder, just made, was taken away by another's check that it can write there
            continue
        except LockHeld as held:
            if time.monotonic() > deadline:
                raise ValueError(f"another fedpar certs (pid {held.pid}) has been writing in {paths.root} for "
                                 f"{TURN_SECONDS:.0f} s; let it end, then run this again") from None
            time.sleep(0.05)


def _check_lists(paths: CertPaths) -> None:
    """ValueError naming revoked.txt or tokens.txt when either is there and a coordinator cannot read it (edited by
    hand, saved as UTF-16): said before anything is written, or a revocation appended to it would never apply."""
    for path, parse in ((paths.revoked, parse_revocations), (paths.tokens, parse_token_hashes)):
        if path.exists():
            read_edited_file(path, parse)


LOCK_FILE = ".fedpar-certs.lock"  # in the certificate folder while a `fedpar certs` writes there
TURN_SECONDS = 60.0  # how long one waits for another's turn (each takes well under a second)


def run(args: argparse.Namespace) -> int:
    """Create, extend or revoke, then say what to run next."""
    paths = CertPaths(Path(args.out))
    housekeeping = args.revoke or args.revoke_cert or args.mint_token
    lock = None
    try:
        if paths.root.exists() and not paths.root.is_dir():  # said as 'File exists: ca.pem in folder ...'
            raise ValueError(f"--out {paths.root} is a file; give the folder of the certificates (made if missing)")
        check_output_folder(paths.root)  # a file on its way was 'Not a directory ... (--debug shows ...)', exit 1
        check_folder_writable(paths.root, "--out")  # was '/proc/certs does not exist', or EPERM and exit 1
        for option, names in (("--agents", args.agents), ("--operators", args.operators), ("--revoke", args.revoke),
                              ("--mint-token", args.mint_token)):
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:  # it issued (or minted) the first, then said it 'kept' it or replaced it with the second
                raise ValueError(f"{option} names {', '.join(twice)} more than once; give each name once")
        for agent_id in [*args.agents, *args.revoke, *args.mint_token]:
            check_agent_id(agent_id)
        for name in args.operators:
            check_agent_id(name, "operator name")
        if args.server_name:
            server_san(args.server_name)  # a bad name is said before a CA is made for a certificate never issued
        issuing = bool(args.agents or args.operators or args.server_name or args.force or not housekeeping)
        lock = _take_turn(paths, making=issuing)
        _check_lists(paths)
        if issuing:
            report = ensure_certs(args.out, args.agents, args.server_name, args.days, args.force, args.operators)
            if report.created_ca:
                print(f"created a new CA in {paths.root}")
            for path in report.written:
                print(f"wrote {path}")
            for path in report.skipped:
                print(f"kept {path} (exists; --force re-issues it)")
            warn_revoked_names(paths, [*args.agents, *args.operators])
        kinds = {agent_id: check_known_agent(paths, agent_id) for agent_id in args.revoke}
        for agent_id in args.revoke:
            done = "revoked" if append_revocation(paths.revoked, agent_id=agent_id) else "already revoked:"
            print(f"{done} {kinds[agent_id]} {agent_id} in {paths.revoked}")
        for pem in args.revoke_cert:
            serial = serial_to_revoke(paths, pem)
            done = "revoked" if append_revocation(paths.revoked, serial=serial) else "already revoked:"
            print(f"{done} certificate {pem} (serial {serial:x}) in {paths.revoked}")
        for agent_id in args.mint_token:
            replaced = has_token(paths.tokens, agent_id)
            token = mint_token(paths.tokens, agent_id)
            if replaced:
                print(f"replaced the earlier enrollment token of agent {agent_id} in {paths.tokens}: it enrolls no "
                      "more (a coordinator re-reads the file)")
            token_path = paths.root / f"{agent_id}.token"
            atomic_write_bytes(token_path, [(token + "\n").encode()], mode=0o600)
            print(f"wrote {token_path} (give it to agent {agent_id}) and its hash to {paths.tokens}")
    except FileNotFoundError as exc:
        print(f"fedpar certs: {exc.filename} does not exist", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"fedpar certs: {exc}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            lock.release(remove=True)
    if not housekeeping:
        print(f"next: fedpar serve --certs {paths.root} ...   and on each agent:   "
              f"fedpar client --certs {paths.root} --agent-id ID ...")
    return 0
