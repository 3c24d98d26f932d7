"""A simulation host's cost to build one pre-summed partial of its members' updates (client/host_partial.py), in one
process, against the way it was built before in the same run: each member's update encoded to bytes (by its seat)
and decoded again by the host before the sum. Now the host sums straight from the members' arrays: one by one
(``HostSum.add``: a seat's own trained arrays) or, for members trained together, the stack's rows with one op over
the stack (``HostSum.add_stacked``). Every member is still checked as the coordinator checks an upload.

Digits MLP (the steady-round cells' model), 10 and 50 members (a worker's share of 10 of 10 and 100 of 100 on 2
workers); median of ``--repeats`` builds each, alternated. Writes benchmarks/results/host_partial_bench.json
(``--json``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_results  # noqa: E402

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.client.host_partial import HostSum  # noqa: E402
from fedpar.client.transfer import SmallUpdate  # noqa: E402
from fedpar.models.for_data import build_model_for_data  # noqa: E402
from fedpar.protocol import fedpar_pb2 as pb  # noqa: E402
from fedpar.protocol.codec import ModelLayout, TensorAssembler, layout_to_pb, wire_bytes  # noqa: E402

MAX_BYTES = 4 << 20
METRICS = {"train_loss": 0.5, "train_seconds": 0.01}


def members(layout: ModelLayout, k: int) -> tuple[list[np.ndarray], list[pb.UploadHeader]]:
    """``k`` members' trained weights stacked (one (k, *shape) array per tensor) and their upload headers."""
    rng = np.random.default_rng(0)
    stacked = [rng.standard_normal((k, *t.shape)).astype(np.float32) for t in layout.tensors]
    headers = [pb.UploadHeader(auth=pb.AgentAuth(agent_id=f"m{j}"), round=1, task_id=f"t{j}", num_examples=13,
                               steps=1, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes,
                               metrics=METRICS) for j in range(k)]
    return stacked, headers


def decoded_again(layout: ModelLayout, stacked, headers) -> pb.HostPartial:
    """The way before: each member's update encoded by its seat, then decoded by the host and added."""
    partial = HostSum(layout, 1, sorted(METRICS))
    for j, header in enumerate(headers):
        message = pb.SmallUpload(header=header, data=wire_bytes([x[j] for x in stacked]))
        staging = TensorAssembler(layout, MAX_BYTES)
        staging.write(0, message.data)
        partial.add(header.auth.agent_id, header.task_id, staging.arrays, header.num_examples, header.steps,
                    header.metrics, (13, 1))
    return partial.message()


def from_arrays(layout: ModelLayout, stacked, headers) -> pb.HostPartial:
    """Now, one by one: each member's arrays as its seat hands them over, checked and added."""
    partial = HostSum(layout, 1, sorted(METRICS))
    for j, header in enumerate(headers):
        update = SmallUpdate(header, layout, [x[j] for x in stacked])
        partial.add(header.auth.agent_id, header.task_id, update.arrays, header.num_examples, header.steps,
                    header.metrics, (13, 1))
    return partial.message()


def from_stack(layout: ModelLayout, stacked, headers) -> pb.HostPartial:
    """Now, members trained together: each checked, the stack summed with one op."""
    partial = HostSum(layout, 1, sorted(METRICS))
    errors = partial.add_stacked([h.auth.agent_id for h in headers], [h.task_id for h in headers], stacked,
                                 [h.num_examples for h in headers], [h.steps for h in headers],
                                 [h.metrics for h in headers], [(13, 1)] * len(headers))
    assert not any(errors), errors
    return partial.message()


def main() -> int:
    p = FedparParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=50, help="builds of each kind, alternated")
    p.add_argument("--json", type=Path, default=HERE / "results" / "host_partial_bench.json", help="where it goes")
    a = p.parse_args()
    model = build_model_for_data("mlp", (1, 8, 8), 10)
    layout = ModelLayout([(n, "float32", tuple(t.shape)) for n, t in model.named_parameters()])
    ways = {"decoded_again": decoded_again, "from_arrays": from_arrays, "from_stack": from_stack}
    cells, ratios = [], []
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"digits MLP, {layout.total_bytes} bytes an update; load average {' '.join(load)}")
    print(f"{'members':>8}{'decoded ms':>11}{'arrays ms':>10}{'stack ms':>9}{'arrays x':>9}{'stack x':>8}")
    for k in (10, 50):
        stacked, headers = members(layout, k)
        means = [np.frombuffer(fn(layout, stacked, headers).data, np.float32) for fn in ways.values()]
        for mean in means[1:]:  # the same partial every way (up to the order of float sums)
            np.testing.assert_allclose(mean, means[0], rtol=1e-6, atol=1e-7)
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(a.repeats):
            for name, fn in ways.items():
                start = time.perf_counter()
                fn(layout, stacked, headers)
                seconds[name].append(time.perf_counter() - start)
        c = {"members": k, "update_bytes": layout.total_bytes, "load_average": load,
             **{f"{name}_ms": statistics.median(s) * 1e3 for name, s in seconds.items()}}
        c["from_arrays_vs_decoded_again"] = c["from_arrays_ms"] / c["decoded_again_ms"]
        c["from_stack_vs_decoded_again"] = c["from_stack_ms"] / c["decoded_again_ms"]
        cells.append(c)
        print(f"{k:>8}{c['decoded_again_ms']:>11.3f}{c['from_arrays_ms']:>10.3f}{c['from_stack_ms']:>9.3f}"
              f"{c['from_arrays_vs_decoded_again']:>9.2f}{c['from_stack_vs_decoded_again']:>8.2f}")
        for way in ("from_arrays", "from_stack"):
            ratios.append({"what": f"a host's partial of {k} digits-MLP updates, built {way.replace('_', ' ')} "
                                   f"(load {' '.join(load)})", "ratio": c[f"{way}_vs_decoded_again"],
                           "against": "each update encoded by its seat and decoded again by the host, same run"})
    path = write_results(a.json, ratios, {"repeats": a.repeats, "cells": cells})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
