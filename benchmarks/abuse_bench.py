"""Honest round time under attack: undisturbed, and under each attack, as ratios measured in the same run.

One command: ``.venv/bin/python benchmarks/abuse_bench.py`` (``--json PATH`` for where the figures go, default
benchmarks/results/abuse_bench.json). Each attack is one run of tests/support/abuse.py: a coordinator at its default
limits (except where an attack needs the data plane or mutual TLS), real agents (client/agent.py) training a tiny model
for ``--train`` seconds per round, and the attacker in its own process, started after the undisturbed rounds:
1. pre-auth stream flood: silent UploadUpdate streams (no certificate, no session) from the agents' own address;
2. silent-request flood: Join calls that never send their request, from the same address;
3. revoked-certificate flood: silent UploadUpdate streams under mutual TLS with a revoked client certificate;
4. idle data-plane sockets: TCP connections to the data plane that never send a byte;
5. slow uploads: ``--tricklers`` sampled agents of the attacker's that answer every task with an upload of 4 bytes
   every 0.3 s (at the defaults, and at a 1 s idle limit), holding staging slots until their pace is refused;
6. inflated weight: one sampled agent of the attacker's that declares the most examples it may and answers every
   task at once with weights of 1000, under --max-agent-share 0.25 (tests/server/test_bounded_influence.py shows
   the model moves by at most that share).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from cryptography import x509

from fedpar.aggregation import build_strategy
from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.models import get_weights, weight_specs
from fedpar.security.admission import Admission, RevocationList, append_revocation
from fedpar.security.certs import CertPaths, ensure_certs
from fedpar.security.tls import channel_credentials, client_tls_files, server_credentials, server_tls_files
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support; the attackers inherit it
from support.abuse import (idle_sockets, inflated_updates, run_under_attack, silent_requests,  # noqa: E402
                           silent_streams, tiny_model, trickling_uploads)

from results import write_results  # noqa: E402  (benchmarks/, this script's folder)


def server_for(rounds: int, agents: int, credentials=None, admission=None, **overrides) -> CoordinatorServer:
    """A coordinator of the tiny model at default limits (plus ``overrides``), not started."""
    model = tiny_model()
    config = CoordinatorConfig(**{**dict(rounds=rounds, clients_per_round=agents, min_available=agents, overselect=1.0,
                                         heartbeat_seconds=1.0, liveness_timeout_seconds=10.0, local_epochs=1,
                                         batch_size=32, learning_rate=0.05), **overrides})
    coordinator = Coordinator(config, [n for n, _, _ in weight_specs(model)], get_weights(model),
                              build_strategy("fedavg"), admission=admission)
    return CoordinatorServer(coordinator, credentials=credentials)


def main(argv: list[str] | None = None) -> int:
    """Run every attack and print a table of ratios; write the figures as JSON."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--before", type=int, default=5, help="rounds before the attack (the first warms up)")
    p.add_argument("--during", type=int, default=5, help="rounds measured under attack")
    p.add_argument("--train", type=float, default=0.3, help="seconds each agent trains per round")
    p.add_argument("--streams", type=int, default=2000, help="silent streams the flood keeps open")
    p.add_argument("--sockets", type=int, default=300, help="idle data-plane connections held open")
    p.add_argument("--tricklers", type=int, default=2, help="sampled attacker agents trickling their uploads")
    p.add_argument("--only", default="", help="run only the attacks whose name contains this")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/abuse_bench.json"))
    a = p.parse_args(argv)
    rounds = a.before + 1 + a.during
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ids = [f"honest-{i}" for i in range(a.agents)]
        ensure_certs(Path(tmp), [*ids, "mallory"])
        paths = CertPaths(Path(tmp))
        serial = x509.load_pem_x509_certificate(paths.agent_cert("mallory").read_bytes()).serial_number
        append_revocation(paths.revoked, serial=serial)
        revoked_tls = {"cert": str(paths.agent_cert("mallory")), "key": str(paths.agent_key("mallory")),
                       "ca": str(paths.ca_cert)}
        attacks = {
            "pre-auth stream flood": (server_for(rounds, a.agents),
                                      lambda s, *ev: (silent_streams, (s.address, a.streams, None, *ev)), None),
            "silent-request flood": (server_for(rounds, a.agents),
                                     lambda s, *ev: (silent_requests, (s.address, a.streams, *ev)), None),
            "revoked-cert flood": (server_for(rounds, a.agents, server_credentials(server_tls_files(tmp)),
                                              Admission(revocations=RevocationList(paths.revoked),
                                                        require_certificate=True)),
                                   lambda s, *ev: (silent_streams, (s.address, a.streams, revoked_tls, *ev)),
                                   lambda i: {"credentials": channel_credentials(client_tls_files(ids[i], tmp))}),
            "idle data-plane sockets": (server_for(rounds, a.agents, data_plane=True),
                                        lambda s, *ev: (idle_sockets, ("127.0.0.1", s.coordinator.data_port,
                                                                       a.sockets, *ev)), None),
        }
        tricklers = [f"trickler-{i}" for i in range(a.tricklers)]
        everyone = dict(min_available=a.agents + a.tricklers, overselect=(a.agents + a.tricklers) / a.agents)
        specs = weight_specs(tiny_model())
        for label, pace in (("slow uploads, defaults", {}),
                            ("slow uploads, idle 1 s", dict(upload_idle_seconds=1.0, upload_min_bytes_per_second=4096))):
            attacks[label] = (server_for(rounds, a.agents, max_concurrent_uploads=a.tricklers, **everyone, **pace),
                              lambda s, *ev: (trickling_uploads, (s.address, tricklers, specs, *ev)), None)
        attacks["inflated weight"] = (
            server_for(rounds, a.agents, max_agent_share=0.25, min_available=a.agents + 1,
                       overselect=(a.agents + 1) / a.agents),
            lambda s, *ev: (inflated_updates, (s.address, ["inflater"], specs, 10_000_000, *ev)), None)
        print(f"{'attack':<26}{'undisturbed s':>15}{'attacked s':>12}{'ratio':>8}  attacker's calls ended as")
        for name, (server, attack, kwargs) in attacks.items():
            if a.only not in name:
                continue
            run = run_under_attack(server, attack, a.agents, a.before, a.during, a.train, kwargs)
            ok = all(r["status"] == "ok" and r["reported"] == a.agents for r in run.rows)
            before, during = statistics.median(run.before), statistics.median(run.during)
            top = ", ".join(f"{k[:70]} x{v}" for k, v in run.attacker.most_common(2))
            print(f"{name:<26}{before:>15.3f}{during:>12.3f}{run.ratio:>8.2f}  {top}"
                  + ("" if ok else "  (SOME ROUNDS FAILED)"), flush=True)
            results[name] = {"undisturbed_seconds": run.before, "attacked_seconds": run.during,
                             "ratio": run.ratio, "all_rounds_ok": ok, "attacker": dict(run.attacker)}
    write_results(a.json, [{"what": f"honest round time under: {name}", "ratio": r["ratio"],
                            "against": "the undisturbed rounds of the same run"} for name, r in results.items()],
                  results)
    print(f"wrote {a.json}")
    return 0 if all(r["all_rounds_ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
