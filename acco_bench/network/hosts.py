"""Where the benchmark's workers start: :class:`Network`, the hosts of an
:class:`~acco_bench.network.emulated.EmulatedCluster`, or local processes on 127.0.0.1 with
``--loopback``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from acco_bench import BenchError
from acco_bench.network import namespaces
from acco_bench.network.emulated import EmulatedCluster

__all__ = ["Network"]


class Network:
    """Where the workers run: an :class:`EmulatedCluster` or local processes on 127.0.0.1.

    ``workers_per_node`` workers share each host's namespace (rank r on host r // S): they talk
    to each other over the namespace's own address, hence its loopback, unshaped; only what
    crosses hosts goes through a host's shaped link."""

    def __init__(self, hosts: int, bandwidth: str | None, latency: str | None, loopback: bool,
                 workers_per_node: int = 1):
        self.hosts = hosts
        self.workers_per_node = workers_per_node
        self.cluster: EmulatedCluster | None = None
        self._port = 29500
        if loopback:
            self.kind = "loopback"
            self.note = "local processes on 127.0.0.1, unshaped (--loopback)"
            self.bandwidth, self.latency, self.latency_emulated, self.shaper = None, None, False, None
            return
        reason = namespaces.netns_unavailable_reason()
        if reason is not None:
            raise BenchError(
                f"cannot emulate a cluster here: {reason} Run as root with iproute2 (ip, tc), "
                "or pass --loopback to run the workers unshaped on 127.0.0.1."
            )
        namespaces.cleanup_stale()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said below, in the outputs
            self.cluster = EmulatedCluster(hosts, bandwidth=bandwidth, latency=latency)
        self.kind = "netns"
        self.bandwidth, self.latency = bandwidth, latency
        self.shaper = self.cluster.shaper
        self.latency_emulated = self.cluster.latency_emulated
        self.note = self._note()

    def set_bandwidth(self, bandwidth: str | None) -> None:
        """Shape every link to ``bandwidth`` from now on (None: unshaped); needs emulated hosts."""
        if self.cluster is None:
            raise BenchError("the link rate cannot be set on loopback: there is no link")
        self.cluster.set_bandwidth(bandwidth)
        self.bandwidth = bandwidth
        self.note = self._note()

    def _note(self) -> str:
        bandwidth, latency = self.bandwidth, self.latency
        per_node = self.workers_per_node
        hosts = f"{self.hosts} network namespaces" + (
            f" of {per_node} workers each (unshaped inside)" if per_node > 1 else "")
        joined = ("joined by TUN devices and a user-space delay line" if self.shaper == "tbf+delayline"
                  else "on a bridge")
        if bandwidth is None:
            self.note = f"{hosts} {joined}, unshaped links"
        else:
            self.note = f"{hosts} {joined}, each link shaped to {bandwidth} with tc tbf" \
                if self.shaper != "netem" else \
                f"{hosts} {joined}, each link shaped to {bandwidth} with tc netem"
        if self.shaper == "tbf+delayline":
            self.note += f", one-way latency {latency} (no netem in this kernel)"
        elif self.shaper == "netem" and latency is not None:
            self.note += f", latency {latency}"
        if latency is not None and not self.latency_emulated:
            self.note += f"; latency {latency} NOT emulated (this kernel has no netem, only tbf)"
        elif latency is None and self.shaper == "tbf":
            self.note += "; no latency emulated (this kernel has no netem)"
        return self.note

    def network_procs(self) -> list[subprocess.Popen]:
        """Processes that carry the emulated network (the delay line), if any."""
        proc = self.cluster.delay_proc if self.cluster is not None else None
        return [proc] if proc is not None else []

    def node_of(self, rank: int) -> int:
        """The host (namespace) worker ``rank`` runs on: ranked host by host."""
        if not 0 <= rank < self.hosts * self.workers_per_node:
            raise IndexError(f"rank {rank} is not one of the {self.hosts} x {self.workers_per_node} workers")
        return rank // self.workers_per_node

    def tx_bytes(self) -> list[int] | None:
        """Bytes each host has sent on its link so far, all its workers together (None on loopback)."""
        return None if self.cluster is None else self.cluster.tx_bytes()

    def describe(self) -> dict:
        return {"kind": self.kind, "hosts": self.hosts, "workers_per_node": self.workers_per_node,
                "bandwidth": self.bandwidth, "latency": self.latency,
                "latency_emulated": self.latency_emulated, "shaper": self.shaper, "note": self.note}

    def master(self) -> tuple[str, int]:
        if self.cluster is None:
            from acco.launch import free_port

            return "127.0.0.1", free_port()
        # Every namespace has its own port space; a fresh port per method avoids TIME_WAIT.
        self._port += 1
        return self.cluster.addr(0), self._port

    def popen(
        self, rank: int, argv: list[str], env: dict, log, sched_batch: bool = False
    ) -> subprocess.Popen:
        kw = dict(env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                  start_new_session=True, preexec_fn=_preexec(sched_batch))
        node = self.node_of(rank)
        if self.cluster is None:
            return subprocess.Popen(argv, **kw)
        return self.cluster.popen(node, argv, **kw)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _preexec(sched_batch: bool):
    """preexec_fn for a worker: the kernel SIGKILLs it if the harness dies (Linux), so no orphan
    keeps a namespace alive or a core busy; with ``sched_batch`` the worker (all its threads) runs
    under SCHED_BATCH, whose threads do not preempt a running thread when they wake up."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    batch = sched_batch and hasattr(os, "SCHED_BATCH")
    param = os.sched_param(0) if batch else None

    def setter() -> None:
        if prctl is not None:
            prctl(1, int(signal.SIGKILL))
        if batch:
            os.sched_setscheduler(0, os.SCHED_BATCH, param)

    return setter
