"""Submit, list, follow, stop and download the runs of a long-lived coordinator service (`fedpar serve --state`),
over its control port with an operator certificate: 'fedpar run submit run.toml', 'fedpar run ls',
'fedpar run logs ID -f', 'fedpar run stop ID', 'fedpar run get ID --out DIR'."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from fedpar.cli.config import ConfigError, ignored_given
from fedpar.cli.declared import add_declared, section
from fedpar.cli.tlsopts import TlsFileOptions
from fedpar.cli.user_errors import UserError, check_folder_writable, check_output_folder, quiet_exit_for_pipe
from fedpar.meant import closest, did_you_mean
from fedpar.sections import Output
from fedpar.settings import setting

LOG_LEVEL = None
ACTIONS = ("submit", "ls", "logs", "stop", "get")
# the words other tools use for an action, which a typo's similarity would not find
ACTION_SYNONYMS = {"list": "ls", "ps": "ls", "status": "ls", "log": "logs", "cancel": "stop", "kill": "stop",
                   "start": "submit", "run": "submit", "fetch": "get", "download": "get", "pull": "get"}
UNFINISHED = ("failed", "stopped")  # how a run can end other than finished: 'run logs -f' then exits 1
# the options each action uses, besides those that reach the service (--control, --operator, --certs): any other is
# refused, as it would do nothing
ACTION_OPTIONS = {"submit": ("name", "follow"), "ls": (), "logs": ("follow",), "stop": (), "get": ("out",)}
MAX_RUN_ID = 2 ** 63 - 1  # run ids travel as int64 (protocol/fedpar.proto)


@dataclass
class RunCommand:
    """How ``fedpar run`` reaches the service, and the options of its actions."""

    control: str = setting("127.0.0.1:50052", check="address", group="connection", metavar="HOST:PORT",
                           help="the service's control API (fedpar serve --state ... --control-port)")
    operator: str | None = setting(None, group="tls", metavar="NAME",
                                   help="whose certificate of --certs to present: DIR/operators/NAME.pem and .key "
                                        "(fedpar certs --operators NAME)")
    name: str | None = setting(None, group="connection",
                               help="with submit: the run's name (default: the run file's name)")
    follow: bool = setting(False, group="connection", help="with logs or submit (also -f): keep following the run's "
                                                          "log until it ends; exit 0 if it finished, 1 if it failed "
                                                          "or was stopped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar run``: an action word, then its argument (a run file or a run id)."""
    section(p, "connection")
    p.add_argument("words", nargs="+", metavar="ACTION [FILE|ID]", help=f"one of {', '.join(ACTIONS)}, then a run "
                                                                      "file (submit) or a run id")
    follow = add_declared(p, RunCommand)["follow"]
    follow.option_strings.insert(0, "-f")  # 'fedpar run logs ID -f', as tail -f
    p._option_string_actions["-f"] = follow
    add_declared(p, TlsFileOptions, only=("certs",))
    add_declared(p, Output)


def _stub(args: argparse.Namespace):
    import grpc

    from fedpar.protocol import fedpar_pb2_grpc as pb_grpc
    from fedpar.security.tls import channel_credentials

    # A connection attempt, TLS handshake included, gives up after CONNECT_SECONDS (gRPC's default is 20 s): a
    # stopped service is said within about CONNECT_SECONDS + SILENT_SECONDS, not 23 s
    channel = grpc.secure_channel(args.control, channel_credentials(_operator_files(args)),
                                  options=[("grpc.min_reconnect_backoff_ms", int(CONNECT_SECONDS * 1000))])
    return pb_grpc.RunControlStub(channel)


CONNECT_SECONDS = 5.0  # a control channel's connection attempt: a handshake on a live service takes milliseconds


def _operator_files(args: argparse.Namespace):
    """The CA, certificate and key of the operator in --certs (TlsFiles); ValueError says what is missing."""
    from fedpar.security.certs import CertPaths
    from fedpar.security.tls import TlsFiles

    if not args.certs or not args.operator:
        raise ValueError("the control API needs mutual TLS: give --certs DIR and --operator NAME")
    paths = CertPaths(Path(args.certs))
    if not paths.ca_cert.exists():
        raise ValueError(f"{args.certs} holds no CA certificate ({paths.ca_cert}): give --certs the folder "
                         "'fedpar certs' made for the service and its operators")
    if not paths.operator_cert(args.operator).exists():
        raise ValueError(f"{args.certs} holds no certificate of operator {args.operator!r} "
                         f"({paths.operator_cert(args.operator)}): make one with 'fedpar certs --out {args.certs} "
                         f"--operators {args.operator}' (the CA that signed the service's certificate must sign it)")
    _check_issued_by_ca(paths.operator_cert(args.operator), paths.ca_cert, args)
    return TlsFiles(paths.operator_cert(args.operator), paths.operator_key(args.operator), paths.ca_cert)


def _check_issued_by_ca(cert_path: Path, ca_path: Path, args: argparse.Namespace) -> None:
    """ValueError unless the CA of --certs issued the operator's certificate: the service (which trusts that CA)
    would hang up on it after the handshake, which reads as a service that is not there."""
    from cryptography import x509

    reading = ca_path
    try:
        cas = x509.load_pem_x509_certificates(ca_path.read_bytes())
        reading = cert_path
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError:
        raise ValueError(f"{reading} is not a PEM certificate: give --certs the folder 'fedpar certs' made") from None
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except Exception:  # noqa: BLE001 - another issuer, or a signature that does not verify: try the next
            continue
    raise ValueError(f"{cert_path} was not issued by the CA in {ca_path}, so the service refuses it: make the "
                     f"operator's certificate with that CA ('fedpar certs --out {args.certs} --operators "
                     f"{args.operator}')")


def _run_id(words: list[str], action: str) -> int:
    """The one run id of ``words``: a whole number from 1 to MAX_RUN_ID; ValueError otherwise."""
    if len(words) != 1 or not re.fullmatch(r"[0-9]+", words[0]) or not 1 <= int(words[0]) <= MAX_RUN_ID:
        raise ValueError(f"'fedpar run {action}' takes one run id (a whole number from 1 to {MAX_RUN_ID}; "
                         "'fedpar run ls' lists them)")
    return int(words[0])


def _check_words(args: argparse.Namespace) -> None:
    """ValueError for a mistake in the command line itself (an unknown action, a missing run file or id, an option
    the action does not use), said before the certificates are read: they were asked for first."""
    words = list(args.words)
    action = words.pop(0)
    if action not in ACTIONS:
        meant = did_you_mean([ACTION_SYNONYMS.get(action.lower()) or closest(action.lower(), ACTIONS, cutoff=0.6)])
        raise ValueError(f"unknown action {action!r}{meant}: use one of {', '.join(ACTIONS)}")
    _refuse_unused(args, action)
    if action == "submit" and len(words) != 1:
        raise ValueError("'fedpar run submit' takes one run file (TOML)")
    if action in ("logs", "stop", "get"):
        _run_id(words, action)
    if action == "get" and not args.out:
        raise ValueError("'fedpar run get' needs --out DIR")


def _refuse_unused(args: argparse.Namespace, action: str) -> None:
    """ValueError naming an option the user typed that ``action`` does not use (one a --config file sets is for the
    actions that use it: 'follow = true' in [run] follows 'fedpar run logs'; 'fedpar run ls' says it in a note)."""
    users = {dest: [a for a, used in ACTION_OPTIONS.items() if dest in used]
             for dest in sorted({d for used in ACTION_OPTIONS.values() for d in used} - set(ACTION_OPTIONS[action]))}
    why = {dest: f"only {' and '.join(them)} {'uses' if len(them) == 1 else 'use'} it" for dest, them in users.items()}
    for dest in ignored_given(args, why):
        them = users[dest]
        raise ValueError(f"'fedpar run {action}' does not use --{dest} (only {' and '.join(them)} "
                         f"{'does' if len(them) == 1 else 'do'}): leave it out")


def _row_line(row: dict) -> str:
    keys = ("round", "status", "reported", "test_accuracy", "test_loss", "train_loss")
    return "  ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                     for k in keys if k in row)


def _submit(stub, request, path: str):
    """Submit ``request`` (run file ``path``); a run the service refuses is a ValueError naming the file and its
    keys, as a mistake the file's own checks find is said."""
    import grpc

    from fedpar.cli.run_settings import said_with_keys

    try:
        return stub.Submit(request, timeout=120)
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise ValueError(f"{path}: {said_with_keys(err.details() or '')}") from None


def _do(args: argparse.Namespace, stub) -> int:
    """Do the action of ``args.words``; the exit code."""
    words = list(args.words)
    action = words.pop(0)
    if action == "submit":
        return _submit_file(args, stub, words)
    if action == "ls":
        return _ls(stub, words)
    if action == "logs":
        return _logs(stub, _run_id(words, "logs"), args.follow)
    if action == "stop":
        return _stop(stub, _run_id(words, "stop"))
    return _get(args, stub, _run_id(words, "get"))


def _submit_file(args: argparse.Namespace, stub, words: list[str]) -> int:
    """Submit the run file of ``words``, print its run id; with --follow, then follow its log."""
    from fedpar.cli.run_settings import read_run_file
    from fedpar.protocol import fedpar_pb2 as pb
    from fedpar.server.run_control import check_run_name

    name = check_run_name(args.name or Path(words[0]).stem)
    settings = read_run_file(words[0])
    reply = _submit(stub, pb.RunSubmit(name=name, settings_json=json.dumps(settings)), words[0])
    if reply.warning:
        print(f"fedpar run: warning: {reply.warning}", file=sys.stderr)
    print(reply.run_id, flush=True)
    if not args.follow and sys.stdout.isatty():  # a person, not a script reading the id: what comes next
        print(f"run {reply.run_id} is submitted: follow it with 'fedpar run logs {reply.run_id} -f' and fetch its "
              f"model with 'fedpar run get {reply.run_id} --out DIR' (with the same --control, --certs and --operator)",
              file=sys.stderr)
    return _logs(stub, reply.run_id, True) if args.follow else 0


def every_run(stub) -> list[dict]:
    """Every run of the service, oldest first, as List gives them a page at a time."""
    from fedpar.protocol import fedpar_pb2 as pb

    runs: list[dict] = []
    while True:
        page = stub.List(pb.RunQuery(after_id=runs[-1]["id"] if runs else 0), timeout=30)
        runs += json.loads(page.runs_json)
        if not page.more:
            return runs


def _ls(stub, words: list[str]) -> int:
    """Print every run of the service, a line each (names and reasons escaped: they are the submitters' text)."""
    from fedpar.server.run_control import printable

    if words:
        raise ValueError(f"'fedpar run ls' takes no argument (got {' '.join(words)!r}); 'fedpar run logs ID' "
                         "shows one run")
    runs = every_run(stub)
    print(f"{'ID':>4}  {'NAME':<16} {'STATUS':<9} {'ROUND':>5}  LAST METRICS")
    for run in runs:
        print(f"{run['id']:>4}  {printable(run['name'])[:16]:<16} {run['status']:<9} {run['round']:>5}  "
              f"{_row_line(run['last_metrics'])}" + (f"  ({printable(run['reason'])})" if run["reason"] else ""))
    return 0


def _logs(stub, run_id: int, follow: bool) -> int:
    """Print run ``run_id``'s log lines and rounds (with ``follow``, until it ends): 1 if it followed a run that
    failed or was stopped."""
    from fedpar.parallel.stopping import exit_code, signal_name

    try:
        status = _print_logs(stub, run_id, follow)
    except KeyboardInterrupt as exc:
        if not follow:
            raise
        # the follower stops, not the run: one-shot serve's Ctrl-C ends its run, so say which this was
        print(f"fedpar run: stopped following run {run_id}, which goes on at the service ('fedpar run stop {run_id}' "
              f"stops it; 'fedpar run logs {run_id} -f' follows it again)", file=sys.stderr)
        return exit_code(signal_name(exc))
    return 1 if follow and status in UNFINISHED else 0  # a script that waits on the run learns how it ended


def _print_logs(stub, run_id: int, follow: bool) -> str:
    """Print run ``run_id``'s log lines and rounds as they come; the status it ended with ("" if not told)."""
    from fedpar.protocol import fedpar_pb2 as pb
    from fedpar.server.run_control import printable

    status = ""
    for message in stub.Logs(pb.RunLogsRequest(run_id=run_id, follow=follow), timeout=None):
        if message.line:
            print(printable(message.line), flush=True)  # a line may quote a run's name, stored by an older service
        elif message.metrics_json:
            print(_row_line(json.loads(message.metrics_json)), flush=True)
        else:
            status = message.status
            print(f"run {run_id} is {status}")
    return status


def _stop(stub, run_id: int) -> int:
    """Ask run ``run_id`` to stop (a failed one that could not resume too: else it is tried at each start); 1, with
    one line, when it had already ended (nothing to do)."""
    from fedpar.protocol import fedpar_pb2 as pb
    from fedpar.server.run_store import CANNOT_RESUME, ENDED

    run = json.loads(stub.Stop(pb.RunRef(run_id=run_id), timeout=30).runs_json)[0]
    if run["status"] == "failed" and run["reason"].startswith(CANNOT_RESUME):  # stopped now: else tried at each start
        print(f"run {run['id']} had failed (it could not resume): stopped, so the service no longer tries it again "
              "when it starts")
        return 0
    if run["status"] in ENDED:
        print(f"fedpar run: run {run['id']} already ended ({run['status']}): nothing to stop", file=sys.stderr)
        return 1
    print(f"run {run['id']} was {run['status']}: " + ("stopped" if run["status"] == "queued"
                                                     else "it stops at its next check"))
    return 0


def _get(args: argparse.Namespace, stub, run_id: int) -> int:
    """Download run ``run_id``'s model and metrics files into --out; written only once all came and the model
    parses, else nothing is left behind."""
    from fedpar.protocol import fedpar_pb2 as pb
    from fedpar.server.run_control import MODEL_FILE, RUN_FILES
    from fedpar.simulations.run_outputs import check_run_files

    check_output_folder(args.out)
    check_folder_writable(args.out, "--out")  # was said as the first file failed, after the download began, exit 1
    check_run_files(args.out, RUN_FILES)  # a folder in a file's place: was exit 1 after the download, .part files left
    out = Path(args.out)
    made = not out.exists()
    names: list[str] = []
    try:
        _receive(stub.Get(pb.RunRef(run_id=run_id), timeout=600), out, names)
        if MODEL_FILE not in names:  # stopped or failed before a round completed: as a run stopped while queued
            raise ValueError(_no_model_line(stub, run_id))
        _check_model(out / f"{MODEL_FILE}.part", run_id)
    except BaseException:
        for name in names:
            (out / f"{name}.part").unlink(missing_ok=True)
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    for name in names:
        (out / f"{name}.part").replace(out / name)
    print(f"wrote {out}/{', '.join(names)}")
    return 0


def _receive(chunks, out: Path, names: list[str]) -> None:
    """Write the files of ``chunks`` (a Get stream) as NAME.part in ``out``, appending each name to ``names``."""
    handles: dict[str, object] = {}
    try:
        for chunk in chunks:
            name = Path(chunk.name).name  # a file name, never a path out of --out
            if name not in handles:
                out.mkdir(parents=True, exist_ok=True)
                names.append(name)
                handles[name] = (out / f"{name}.part").open("wb")
            handles[name].write(chunk.data)
    finally:
        for handle in handles.values():
            handle.close()


def _check_model(path: Path, run_id: int) -> None:
    """ValueError unless ``path`` is a whole safetensors file (its header parses and covers the file's bytes)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "numpy"):
            pass
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"the model of run {run_id} on the service is damaged (global.safetensors: {exc}); nothing "
                         "was written: see the service's log") from None


def _no_model_line(stub, run_id: int) -> str:
    """Why ``run_id`` has no model to get, as the service refuses a get of a run stopped while queued: its status
    and reason (as 'run ls' shows them), and where to see what it did."""
    from fedpar.server.run_control import printable

    run = next((r for r in every_run(stub) if r["id"] == run_id), {})
    status, reason = run.get("status", "ended"), printable(run.get("reason", ""))
    why = "its model was not written" if run.get("round") else "no round of it completed"
    return (f"run {run_id} is {status} with no model to get: {why}"
            + (f" ({reason})" if reason else "") + f"; 'fedpar run logs {run_id}' shows what it did")


def run(args: argparse.Namespace) -> int:
    """Do the action; a refusal or a mistake is one line and a non-zero exit."""
    import grpc

    try:
        _check_words(args)
        code = _do(args, _stub(args))
        sys.stdout.flush()  # here, where a reader that left is handled
        return code
    except BrokenPipeError:  # 'fedpar run ls | head -1': the reader left; say nothing, as Unix tools do
        return quiet_exit_for_pipe()
    except (ValueError, ConfigError, UserError) as exc:
        print(f"fedpar run: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(f"fedpar run: {_refusal_line(err, args)}", file=sys.stderr)
        if args.debug:  # gRPC's own words, which the line above reads for the operator
            print(f"fedpar run: gRPC said {err.code().name}: {err.details()}", file=sys.stderr)
        return 1 if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                   grpc.StatusCode.DEADLINE_EXCEEDED) else 2


def _refusal_line(err, args: argparse.Namespace) -> str:
    """What a failed control call means for the operator: the service's own refusal as it said it, else what the
    transport's words point to (no service, a host name that cannot be looked up, the wrong port, a plaintext one,
    a failed TLS handshake, a service that went away, one that takes connections and never answers, stopped or
    overloaded, or an address where nothing takes them)."""
    import grpc

    from fedpar.security.handshake import (NO_ANSWER, NO_CONNECTION, OPERATOR, answers_another_protocol,
                                           answers_http1, diagnose_handshake, lookup_trouble, silence_at, speaks_tls)
    from fedpar.server.run_control import SERVICE_STOPPING

    control, code, details = args.control, err.code(), err.details() or ""
    said = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and details == SERVICE_STOPPING:
        return (f"the service at {control} stopped (a run it was executing resumes when it starts again on the same "
                "--state); follow the run again then")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"{control} answers, but has no control API (is it the agents' port?): give --control the service's "
                "--control-port")
    if code == grpc.StatusCode.UNAVAILABLE and "connection refused" in said:  # was gRPC's 'failed to connect to all
        # addresses; last error: UNKNOWN: ipv4:...: Failed to connect to remote host: Connection refused'
        return (f"nothing listens at {control} (connection refused): is 'fedpar serve --state' running there, and is "
                f"{control.rpartition(':')[2]} its --control-port?")
    lookup = lookup_trouble(control, "--control", said) if code == grpc.StatusCode.UNAVAILABLE else None
    if lookup is not None:  # a command asks once: a lookup that fails for now is said too
        return lookup[0]
    silence = silence_at(control, SILENT_SECONDS) if code == grpc.StatusCode.UNAVAILABLE else None
    if silence == NO_ANSWER:
        # gRPC calls a handshake the server never answered 'Handshake read failed (Endpoint closing)' after its
        # connect timeout: no certificate was ever looked at, so the certificates are not to blame
        return (f"the service at {control} takes connections but does not answer (it said nothing for "
                f"{CONNECT_SECONDS + SILENT_SECONDS:.0f} s: is it running? stopped, e.g. with SIGSTOP? overloaded?); "
                "try again, and see its log")
    if silence == NO_CONNECTION:
        waited = CONNECT_SECONDS + SILENT_SECONDS
        return (f"nothing at {control} took the connection within {waited:.0f} s (a host that "
                "is down, a wrong address, or a firewall dropping the packets); check --control")
    if code == grpc.StatusCode.UNAVAILABLE and speaks_tls(control) is False:  # was 'TLS handshake ... failed:
        # WRONG_VERSION_NUMBER; check --certs DIR ...': no certificate helps
        return (f"{control} speaks plaintext gRPC (an --insecure coordinator's agents' port?), not the control API's "
                "mutual TLS: give --control the --control-port of a 'fedpar serve --state' service")
    if code == grpc.StatusCode.UNAVAILABLE:  # was 'TLS handshake ... failed: WRONG_VERSION_NUMBER; check --certs DIR':
        # the port is wrong, not the certificates
        other = answers_http1(control, SILENT_SECONDS, OPERATOR) or answers_another_protocol(control, SILENT_SECONDS,
                                                                                             OPERATOR)
        if other is not None:
            return other
    if code == grpc.StatusCode.UNAVAILABLE:  # gRPC's words for a failed handshake are cut and vary: ask TLS itself
        problem = diagnose_handshake(control, _operator_files(args), who=OPERATOR)
        if problem is not None:
            return problem
    if code == grpc.StatusCode.UNAVAILABLE and any(w in said for w in ("ssl", "handshake", "certificate", "tls")):
        return (f"the TLS handshake with {control} failed: --certs must hold the CA that signed the service's "
                "certificate, and the operator's certificate must come from that CA (--debug shows gRPC's words)")
    if code == grpc.StatusCode.CANCELLED or (code == grpc.StatusCode.UNAVAILABLE and (
            "cancel" in said or "stream removed" in said or "socket closed" in said)):  # a kill -9 mid-call
        return (f"the service at {control} went away (it stopped or crashed, or the connection broke): a run it was "
                "executing resumes when it starts again on the same --state; try again then")
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{details} at {control}; is 'fedpar serve --state' running there?"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the service at {control} did not answer in time (busy, or stuck); try again, and see its log"
    return details


SILENT_SECONDS = 3.0  # how long a failed call's probe waits for the service's first byte (silence_at)
