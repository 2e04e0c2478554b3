"""The emulated cluster: shaping is real, and nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from distributed import write_script

from acco_bench.network import (
    EmulatedCluster,
    available_shapers,
    cleanup_stale,
    list_namespaces,
    netns_unavailable_reason,
    parse_rate,
    parse_time,
)

REPO = Path(__file__).resolve().parents[1]
REASON = netns_unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")
# Where the kernel lacks netem the cluster shapes with tbf and warns that latency is not emulated.
quiet_latency = pytest.mark.filterwarnings("ignore:EmulatedCluster:RuntimeWarning")

WORKER = textwrap.dedent(
    """
    import json, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    warm = torch.ones(16)
    dist.all_reduce(warm)  # connections are set up here, not in the timed call
    x = torch.full((2_500_000,), float(rank + 1))
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    dt = time.perf_counter() - t0
    print(json.dumps({"rank": rank, "seconds": dt, "value": float(x[0]), "last": float(x[-1])}), flush=True)
    dist.destroy_process_group()
    """
)


def test_reason_is_none_or_sentence():
    assert REASON is None or (isinstance(REASON, str) and REASON)


def test_parse_rate():
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("12.5mbps") == 100e6
    with pytest.raises(ValueError):
        parse_rate("fast")


@needs_netns
@quiet_latency
def test_shaped_gloo_allreduce_and_cleanup():
    bandwidth, world, numel = "100mbit", 2, 2_500_000
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": "29500", "WORLD_SIZE": str(world)}
    with EmulatedCluster(world, bandwidth=bandwidth, latency="1ms") as cluster:
        prefix = cluster.run_prefix
        assert sorted(list_namespaces(prefix)) == sorted(cluster.namespaces)
        env["MASTER_ADDR"] = cluster.addr(0)
        procs = [
            cluster.popen(i, [sys.executable, "-c", WORKER], env={**env, "RANK": str(i)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(world)
        ]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    # ring all-reduce: every host sends 2 (n-1)/n of the tensor through its shaped link
    theory = 2 * (world - 1) / world * numel * 4 * 8 / parse_rate(bandwidth)
    seconds = max(o["seconds"] for o in outs)
    print(
        f"10 MB gloo all_reduce over {bandwidth} ({cluster.shaper}): {seconds:.3f} s, theory {theory:.3f} s"
    )
    assert all(o["value"] == 3.0 and o["last"] == 3.0 for o in outs)
    assert seconds >= 0.7 * theory, f"{seconds:.3f}s < 70% of {theory:.3f}s: the link is not shaped"
    assert list_namespaces(prefix) == []


def test_parse_time():
    assert parse_time("1ms") == pytest.approx(1e-3)
    assert parse_time("500us") == pytest.approx(5e-4)
    assert parse_time("0.2s") == pytest.approx(0.2)
    with pytest.raises(ValueError):
        parse_time("1 fortnight")


PING_PONG = textwrap.dedent(
    """
    import socket, sys, time
    role, addr = sys.argv[1], sys.argv[2]
    if role == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 5001)); s.listen(1); print("listening", flush=True)
        conn, _ = s.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (b := conn.recv(64)):
            conn.sendall(b)
    else:
        s = socket.create_connection((addr, 5001)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(10):
            t = time.perf_counter(); s.sendall(b"p"); s.recv(64); rtts.append(time.perf_counter() - t)
        print(min(rtts), flush=True)
    """
)


def _rtt(cluster: EmulatedCluster, src: int, dst: int) -> float:
    server = cluster.popen(dst, [sys.executable, "-c", PING_PONG, "server", cluster.addr(dst)],
                           stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    client = subprocess.run([*cluster.exec_prefix(src), sys.executable, "-c", PING_PONG, "client",
                             cluster.addr(dst)], capture_output=True, text=True, timeout=60)
    assert client.returncode == 0, client.stderr[-2000:]
    server.wait(timeout=10)
    return float(client.stdout.strip())


@needs_netns
@pytest.mark.skipif("netem" not in available_shapers() and "tbf+delayline" not in available_shapers(),
                    reason="neither netem nor TUN devices: latency cannot be emulated here")
def test_latency_is_emulated_between_every_pair():
    """Every packet crosses one delayed link, so a ping-pong's round trip takes twice the latency,
    between any two of three hosts; the delay line (where it is used) dies with the cluster. The
    fastest of 10 round trips at 50 ms: a busy machine only adds to a round trip (each of its four
    hops waits for a core; with two test suites side by side the fastest of 30 at 5 ms took 36 ms),
    so the latency is large enough that what load adds stays below the 100 ms that a second delayed
    link would add: 100 ms is one link, 200 ms two."""
    with EmulatedCluster(3, bandwidth="100mbit", latency="50ms") as cluster:
        assert cluster.latency_emulated
        prefix = cluster.run_prefix
        rtts = [_rtt(cluster, 0, 2), _rtt(cluster, 2, 1)]
        delay_proc = cluster.delay_proc
    print(f"{cluster.shaper}: round trips {[f'{r * 1e3:.2f} ms' for r in rtts]} for a 50 ms latency")
    assert all(0.095 <= r <= 0.16 for r in rtts), rtts
    assert list_namespaces(prefix) == []
    assert delay_proc is None or delay_proc.poll() is not None


@needs_netns
@quiet_latency
def test_close_on_error_and_idempotent():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(3, bandwidth=None, latency=None) as cluster:
            prefix = cluster.run_prefix
            assert len(list_namespaces(prefix)) == 4
            # a process still running in a namespace must not keep it (or its links) alive
            cluster.popen(1, [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
            raise RuntimeError("boom")
    assert list_namespaces(prefix) == []
    cluster.close()
    assert list_namespaces(prefix) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_namespaces(sig, tmp_path):
    script = write_script(tmp_path, "cluster.py", """
        import signal
        from signal_wait import wait_for_signal
        # A test run started in the background by a shell without job control hands SIGINT down
        # ignored; a user's interactive run has Python's own handler, which is what this checks.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from acco_bench.network import EmulatedCluster
        c = EmulatedCluster(2, bandwidth="50mbit", latency=None)
        print(c.run_prefix, flush=True)
        try:
            wait_for_signal()
        except KeyboardInterrupt:   # SIGINT: Python's own handler still runs after the cleanup
            print("KeyboardInterrupt", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    prefix = ""
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix and len(list_namespaces(prefix)) == 3
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=30)
        if sig == signal.SIGTERM:
            assert proc.returncode == -signal.SIGTERM  # still dies of the signal
        else:
            assert proc.returncode == 0 and "KeyboardInterrupt" in rest
        assert list_namespaces(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            cleanup_stale()  # the killed child's namespaces, should the test have failed
        proc.stdout.close()


@needs_netns
def test_cleanup_stale_removes_dead_runs_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"acco-{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with EmulatedCluster(1, bandwidth=None, latency=None) as live:
            removed = cleanup_stale()
            assert stale in removed
            assert not set(removed) & set(live.namespaces)
            assert sorted(list_namespaces(live.run_prefix)) == sorted(live.namespaces)
        assert list_namespaces(live.run_prefix) == []
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
