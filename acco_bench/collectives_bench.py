"""Gloo's flat collectives against acco's ring ones, between emulated hosts.

    python -m acco_bench.collectives_bench --bandwidth 100mbit          # 2 hosts, 1.33M elements
    python -m acco_bench.collectives_bench --bandwidth none             # unshaped veth links
    python -m acco_bench.collectives_bench --loopback                   # no namespaces, 127.0.0.1

Each host of an :class:`~acco_bench.network.EmulatedCluster` runs one worker; every operation is
timed ``--reps`` times after ``--warmup`` calls, each timing the slowest rank's, preceded by a
barrier, and the median is reported with the bandwidth bound (bytes one rank must send through its
shaped link / bandwidth). Where namespaces are not available (not root, no iproute2) it falls back
to loopback and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OPS = ("all_reduce", "reduce_scatter_tensor", "ring_reduce_scatter", "all_gather_into_tensor",
       "ring_all_gather")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


# ---------------------------------------------------------------------------------------- worker


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from acco.engine.collectives import all_gather, reduce_scatter

    torch.set_num_threads(1)  # one core per emulated host
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    native_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    native_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = args.numel // world * world
    results = {}
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, DTYPES[dname])
        full = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dtype)
        shard = torch.empty(n // world, dtype=dtype)
        gathered = torch.empty(n, dtype=dtype)
        work = full.clone()
        ops = {
            "all_reduce": lambda work=work, full=full: (work.copy_(full), dist.all_reduce(work)),
            "reduce_scatter_tensor": lambda shard=shard, full=full: native_rs(shard, full),
            "ring_reduce_scatter": lambda shard=shard, full=full: reduce_scatter(shard, full),
            "all_gather_into_tensor": lambda g=gathered, shard=shard: native_ag(g, shard),
            "ring_all_gather": lambda g=gathered, shard=shard: all_gather(g, shard),
        }
        # the ring must agree with gloo before its time means anything
        ref = torch.empty_like(shard)
        native_rs(ref, full)
        reduce_scatter(shard, full)
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        ok_rs = torch.allclose(shard.float(), ref.float(), rtol=tol, atol=tol)
        g_ref = torch.empty_like(gathered)
        native_ag(g_ref, shard)
        all_gather(gathered, shard)
        ok_ag = torch.equal(gathered, g_ref)
        for op in OPS:
            times = []
            for i in range(args.warmup + args.reps):
                dist.barrier()
                t0 = time.perf_counter()
                ops[op]()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if i >= args.warmup:
                    times.append(float(dt))
            results[f"{dname}/{op}"] = {"median_s": statistics.median(times), "min_s": min(times),
                                        "times_s": times}
        results[f"{dname}/ring_matches_gloo"] = bool(ok_rs and ok_ag)
        results[f"{dname}/bytes"] = n * full.element_size()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- driver


def _report(res: dict, args, world: int, where: str) -> None:
    from acco_bench.network import parse_rate

    rate = parse_rate(args.bandwidth) if args.bandwidth else None
    print(f"\n{world} hosts, {where}, {args.numel:,} elements, median of {args.reps} "
          f"(slowest rank per call)")
    print(f"{'dtype':5} {'op':24} {'median s':>9} {'bound s':>8} {'vs bound':>8}")
    for dname in args.dtypes.split(","):
        nbytes = res[f"{dname}/bytes"]
        # bytes each rank sends (ring-optimal) through its own link
        sent = {"all_reduce": 2 * (world - 1) / world * nbytes}
        sent.update({op: (world - 1) / world * nbytes for op in OPS if op != "all_reduce"})
        for op in OPS:
            med = res[f"{dname}/{op}"]["median_s"]
            if rate:
                bound = sent[op] * 8 / rate
                print(f"{dname:5} {op:24} {med:9.3f} {bound:8.3f} {med / bound:7.2f}x")
            else:
                print(f"{dname:5} {op:24} {med:9.4f} {'-':>8} {'-':>8}")
        rs = (
            res[f"{dname}/reduce_scatter_tensor"]["median_s"]
            / res[f"{dname}/ring_reduce_scatter"]["median_s"]
        )
        ag = res[f"{dname}/all_gather_into_tensor"]["median_s"] / res[f"{dname}/ring_all_gather"]["median_s"]
        print(f"{dname:5} ring speed-up: reduce-scatter {rs:.2f}x, all-gather {ag:.2f}x; "
              f"ring == gloo: {res[f'{dname}/ring_matches_gloo']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", default="100mbit", help="tc rate per host link, or 'none'")
    ap.add_argument("--latency", default="1ms", help="added delay per link (needs netem), or 'none'")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1_330_000)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--loopback", action="store_true", help="no namespaces: processes on 127.0.0.1")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    for k in ("bandwidth", "latency"):
        if str(getattr(args, k)).lower() in ("none", "off", "0", ""):
            setattr(args, k, None)

    from acco_bench.network import EmulatedCluster, netns_unavailable_reason

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
           "WORLD_SIZE": str(args.hosts), "MASTER_PORT": "29531"}
    cmd = [sys.executable, "-m", "acco_bench.collectives_bench", "--worker", "--numel", str(args.numel),
           "--dtypes", args.dtypes, "--reps", str(args.reps), "--warmup", str(args.warmup)]
    reason = None if args.loopback else netns_unavailable_reason()
    cluster = None
    try:
        if args.loopback or reason is not None:
            if reason:
                print(f"network namespaces unavailable ({reason}); falling back to loopback, unshaped")
            args.bandwidth = None
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                env["MASTER_PORT"] = str(s.getsockname()[1])
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(i)}, stdout=subprocess.PIPE, text=True)
                     for i in range(args.hosts)]
            where = "loopback (unshaped)"
        else:
            cluster = EmulatedCluster(args.hosts, bandwidth=args.bandwidth, latency=args.latency)
            env["MASTER_ADDR"] = cluster.addr(0)
            procs = [cluster.popen(i, cmd, env={**env, "RANK": str(i)}, stdout=subprocess.PIPE, text=True)
                     for i in range(args.hosts)]
            lat = args.latency if cluster.latency_emulated else "none"
            shaping = f"shaped with {cluster.shaper} to {args.bandwidth}" if args.bandwidth else "unshaped"
            where = f"namespaces {shaping}, latency {lat}"
        outs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=args.timeout)
                outs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode != 0 for p in procs):
            print(f"worker failed: exit codes {[p.returncode for p in procs]}", file=sys.stderr)
            return 1
    finally:
        if cluster is not None:
            cluster.close()
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    _report(res, args, args.hosts, where)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "where": where, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
