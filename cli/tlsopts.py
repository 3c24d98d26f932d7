"""TLS and admission options shared by ``fedpar serve`` and ``fedpar client``: secure by default, plaintext
only with ``--insecure`` (and a warning)."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedpar.cli.declared import add_declared
from fedpar.protocol.small_files import read_small_file
from fedpar.security.admission import Admission, RevocationList, TokenList
from fedpar.security.certs import CertPaths
from fedpar.security.sslcontext import client_ssl_context, server_ssl_context
from fedpar.security.tls import (HOW_TO_FIX, TlsFiles, TlsSetupError, certificate_common_name,
                                 channel_credentials, client_tls_files, foreign_server_certificate, server_credentials,
                                 server_tls_files)
from fedpar.settings import setting

log = logging.getLogger("fedpar.security")
PLAINTEXT_WARNING = ("--insecure: plaintext gRPC; anyone on the network can read the model and updates "
                     "and impersonate agents. Use TLS ('fedpar certs', then --certs) outside a trusted network.")


@dataclass
class TlsFileOptions:
    """This endpoint's TLS material (serve and client), or --insecure."""

    certs: Path | None = setting(None, group="tls", metavar="DIR",
                                 help="folder made by 'fedpar certs': uses DIR/ca.pem and this side's certificate "
                                      "and key, DIR/server.pem and server.key (serve), DIR/AGENT_ID.pem and "
                                      "AGENT_ID.key (client), or the operator's DIR/operators/NAME.pem and NAME.key "
                                      "of --operator NAME (run): mutual TLS")
    tls_cert: Path | None = setting(None, group="tls", metavar="PEM",
                                    help="this endpoint's certificate (overrides --certs)")
    tls_key: Path | None = setting(None, group="tls", metavar="PEM",
                                   help="this endpoint's private key (overrides --certs)")
    tls_ca: Path | None = setting(None, group="tls", metavar="PEM",
                                  help="CA certificate that signed the other side's certificate (overrides --certs); "
                                       "a coordinator with no CA at all (no --certs either) admits agents without "
                                       "certificates, by --enrollment-tokens, which it then needs")
    insecure: bool = setting(False, group="tls",
                             help="plaintext gRPC without TLS (a warning is logged); only on a network you trust")


@dataclass
class AdmissionOptions:
    """Whom the coordinator admits, besides what the CA certified (serve)."""

    allow_agents: list[str] | None = setting(
        None, append=True, check="id_list", group="tls", metavar="ID[,ID...]",
        help="admit only these agent ids (default: any agent the CA certified or a token enrolled)")
    enrollment_tokens: Path | None = setting(
        None, group="tls", metavar="FILE",
        help="admit agents by a token whose SHA-256 is listed here ('AGENT_ID HEX' lines, made by 'fedpar certs "
             "--mint-token'); the agents' port then asks for no client certificate (server-only TLS; a CA given "
             "serves only serve --state's control port)")
    revoked: Path | None = setting(
        None, group="tls", metavar="FILE",
        help="revocation list (agent ids and 'serial:HEX' lines), re-read whenever it changes; default with --certs: "
             "DIR/revoked.txt ('fedpar certs --revoke ID' appends to it)")


@dataclass
class AgentTlsOptions:
    """How an agent checks the coordinator's name and proves its own identity without a certificate (client)."""

    tls_server_name: str | None = setting(
        None, group="tls", metavar="NAME",
        help="name to check the coordinator's certificate for when --server uses another name")
    enrollment_token_file: Path | None = setting(
        None, group="tls", metavar="FILE",
        help="file holding this agent's enrollment token (for coordinators that admit by token)")


def add_tls_arguments(p: argparse.ArgumentParser, role: str) -> None:
    """``--certs``, ``--tls-*`` and ``--insecure`` (plus admission options for the coordinator)."""
    add_declared(p, TlsFileOptions)
    add_declared(p, AdmissionOptions if role == "serve" else AgentTlsOptions)


def _wants_tls(args: argparse.Namespace) -> bool:
    return bool(args.certs or args.tls_cert or args.tls_key or args.tls_ca)


def warn_if_exposed(key: Path | None, whose: str) -> None:
    """Log a warning when private key ``key`` is readable by other users of this machine (they could pose as
    ``whose``); not an error, as mounted secrets are often mode 0644."""
    try:
        mode = stat.S_IMODE(key.stat().st_mode) if key is not None else 0
    except OSError:  # said by the credentials that read it
        return
    if mode & 0o044:
        log.warning("private key %s is readable by other users of this machine (mode %o): any of them can pose as "
                    "%s; make it readable by its owner only: chmod 600 %s", key, mode, whose, key)


@dataclass
class ServerSecurity:
    """What ``fedpar serve`` needs: credentials (None: plaintext) and the admission policy."""

    credentials: grpc.ServerCredentials | None
    admission: Admission
    description: str
    client_hint: str  # the TLS options agents of this coordinator need
    data_tls: ssl.SSLContext | None = None  # the same certificate for the bulk data plane
    files: TlsFiles | None = None  # the PEM files of the credentials (aggregator ranks' control channel)


def _check_mode(args: argparse.Namespace) -> None:
    """Exactly one of TLS options or --insecure."""
    if args.insecure and _wants_tls(args):
        raise TlsSetupError("--insecure cannot be combined with --certs/--tls-*; choose one")
    if not args.insecure and not _wants_tls(args):
        raise TlsSetupError(f"TLS is required: {HOW_TO_FIX}")
    certs = getattr(args, "certs", None)
    if certs is not None and certs.exists() and not certs.is_dir():  # said 'cannot stat FILE/revoked.txt: ...'
        raise TlsSetupError(f"--certs {certs} is a file; give the folder 'fedpar certs --out DIR' made")


def _foreign_server_certificate(args: argparse.Namespace, files: TlsFiles) -> None:
    """Say that the coordinator's certificate is not from the CA it checks agents with: an error for one --certs
    folder (every agent of it would refuse the coordinator), a warning when --tls-* name files (two CAs may be
    meant)."""
    what = (f"{files.cert} was not issued by the CA in {files.ca}: agents that check this coordinator with that "
            "ca.pem (as --certs DIR does) will refuse it")
    if not (args.tls_cert or args.tls_ca):
        raise TlsSetupError(f"{what}; re-issue it from that CA with 'fedpar certs --out {args.certs} --server-name "
                            "NAME' (one per name agents dial)")
    log.warning("%s; give the server.pem and ca.pem of one 'fedpar certs' folder", what)


def server_security(args: argparse.Namespace, warn: bool = True) -> ServerSecurity:
    """Build the coordinator's TLS credentials and admission policy; TlsSetupError says what is missing. ``warn``:
    say what plaintext exposes (an aggregator rank whose launcher said it already does not say it again)."""
    _check_mode(args)
    files = None if args.insecure else server_tls_files(args.certs, args.tls_cert, args.tls_key, args.tls_ca)
    agent_files = files
    if files is not None and args.enrollment_tokens:
        # agents are admitted by token, so the agents' port asks for no certificate: gRPC cannot make one optional.
        # The CA still serves `serve --state`'s control port (operators' certificates) and the ranks' control channel.
        agent_files = TlsFiles(files.cert, files.key, None)
        # said only where a CA was given (tls.md's own --tls-cert/--tls-key/--enrollment-tokens names none)
        if (warn and files.ca is not None and getattr(args, "state", None) is None
                and not getattr(args, "launcher_warned", False)):
            log.warning("--enrollment-tokens: agents are admitted by token, so the agents' port asks for no client "
                        "certificate and the CA of --certs/--tls-ca is not used (agents with certificates only need "
                        "a token too)")
    # before the lists, whose reading is logged
    credentials = server_credentials(agent_files) if agent_files is not None else None
    if files is not None and files.ca is not None and foreign_server_certificate(files):
        _foreign_server_certificate(args, files)
    # Said by one process: a rank's launcher says the first reading, the other ranks leave each to rank 0
    said, quiet = not warn or getattr(args, "launcher_warned", False), os.environ.get("RANK", "0") != "0"
    revoked = args.revoked or (CertPaths(args.certs).revoked if args.certs else None)
    try:
        tokens = TokenList.watching(args.enrollment_tokens, said, quiet) if args.enrollment_tokens else None
        revocations = RevocationList.watching(revoked, said, quiet) if revoked else None
    except ValueError as exc:
        raise TlsSetupError(str(exc)) from None
    mutual, data_tls = False, None
    if agent_files is not None:
        mutual = agent_files.ca is not None
        data_tls = server_ssl_context(agent_files)
        warn_if_exposed(agent_files.key, "this coordinator")
        if not mutual and tokens is None:
            raise TlsSetupError("without --tls-ca (server-only TLS) agents have no certificate to prove who they "
                                "are: pass --enrollment-tokens FILE, or --certs DIR for mutual TLS")
        description = "mutual TLS" if mutual else "server TLS + enrollment tokens"
        if mutual:
            hint = f"--certs {args.certs}" if args.certs else "--tls-ca CA.pem --tls-cert ID.pem --tls-key ID.key"
        else:
            hint = f"--tls-ca {CertPaths(args.certs).ca_cert if args.certs else 'CA.pem'} --enrollment-token-file F"
    else:
        if warn:
            log.warning(PLAINTEXT_WARNING)
        if tokens is None and warn:
            log.warning("--insecure without --enrollment-tokens: any agent that can reach this port may join")
        description = "PLAINTEXT (--insecure)" + (" + enrollment tokens" if tokens is not None else "")
        hint = "--insecure" + (" --enrollment-token-file F" if tokens is not None else "")
    admission = Admission(allowed_ids=args.allow_agents, token_hashes=tokens, revocations=revocations,
                          require_certificate=mutual)
    return ServerSecurity(credentials, admission, description, hint, data_tls, files)


@dataclass
class ClientSecurity:
    """What ``fedpar client`` needs: credentials (None: plaintext), server-name override, enrollment token."""

    credentials: grpc.ChannelCredentials | None
    server_name: str | None
    enrollment_token: str
    data_tls: ssl.SSLContext | None = None  # the same certificate for the bulk data plane
    files: TlsFiles | None = None  # the PEM files of the credentials (to diagnose a failing handshake)


def client_security(args: argparse.Namespace, host_id: str | None = None) -> ClientSecurity:
    """Build the agent's TLS credentials (``host_id``: a simulation host's, whose certificate bears its host id);
    TlsSetupError says what is missing or inconsistent."""
    _check_mode(args)
    token = ""
    if args.enrollment_token_file:
        try:
            token = read_small_file(args.enrollment_token_file, "--enrollment-token-file").decode("utf-8").strip()
        except OSError as exc:
            raise TlsSetupError(f"cannot read --enrollment-token-file {args.enrollment_token_file}: "
                                f"{exc.strerror}") from None
        except UnicodeDecodeError:  # said "'utf-8' codec can't decode byte 0xcf ...", naming no file
            raise TlsSetupError(f"--enrollment-token-file {args.enrollment_token_file} is not a text file; give the "
                                "token file 'fedpar certs --mint-token ID' wrote") from None
        except ValueError as exc:  # not a regular file (/dev/zero was read until memory ran out), or far too large
            raise TlsSetupError(f"{exc}; give the token file 'fedpar certs --mint-token ID' wrote") from None
        if not token:  # else every Join is refused as 'missing enrollment token', after dialling
            raise TlsSetupError(f"--enrollment-token-file {args.enrollment_token_file} is empty; give the token file "
                                "'fedpar certs --mint-token ID' wrote")
    if args.insecure:
        log.warning(PLAINTEXT_WARNING)
        return ClientSecurity(None, None, token)
    identity = host_id or args.agent_id
    _check_token_agent_certs(args, token, identity)
    try:
        files = client_tls_files(identity, args.certs, args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:  # an agent id that cannot name certificate files
        raise TlsSetupError(str(exc)) from None
    credentials = channel_credentials(files)
    warn_if_exposed(files.key, f"agent {identity!r}")
    if files.cert is not None:
        cn = certificate_common_name(files.cert)
        if cn != identity:
            whose = f"simulation host {identity!r}" if host_id else f"--agent-id {identity!r}"
            raise TlsSetupError(f"{files.cert} is the certificate of agent {cn!r}, not of {whose}; the coordinator "
                                f"would refuse it")
    return ClientSecurity(credentials, args.tls_server_name, token, client_ssl_context(files), files)


def _check_token_agent_certs(args: argparse.Namespace, token: str, identity: str) -> None:
    """TlsSetupError saying to pass the CA alone when an agent given a token names a --certs folder that holds no
    certificate of its own (it was told to make certificates, which an agent admitted by token has none of)."""
    if not token or not args.certs or args.tls_cert or args.tls_key:
        return
    paths = CertPaths(args.certs)
    try:
        own = paths.agent_cert(identity)
    except ValueError:  # an id that cannot name a file: said as client_tls_files says it
        return
    if not own.exists():
        raise TlsSetupError(f"--certs {args.certs} holds no {own.name}: an agent admitted by --enrollment-token-file "
                            f"has no certificate of its own; pass --tls-ca {paths.ca_cert} instead of --certs")
