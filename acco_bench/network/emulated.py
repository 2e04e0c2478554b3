"""An emulated cluster on one Linux machine: network namespaces joined by a bridge, with ``tc netem``.

Where the kernel has no ``netem`` (many minimal VM kernels), the rate is shaped with ``tbf`` and,
when a latency is asked for, the hosts are joined by :mod:`acco_bench.network.delayline` (TUN devices and
a user-space delay line) instead of the bridge: :attr:`EmulatedCluster.shaper` says which.

Each host ``h{i}`` is a network namespace with one veth interface; the other end of every veth
lives in a separate bridge namespace, where all of them are enslaved to one bridge. ``tc netem``
shapes the egress of every host's interface to ``bandwidth`` and adds ``latency``, so traffic
between two hosts crosses two shaped links (one per direction), like a switched full-duplex
network. Nothing is created in the caller's own network namespace: the veth pairs are created
inside the host namespaces directly, so no interface name can collide with the machine's, and the
addresses (``10.77.N.0/24``) exist only inside the namespaces this module made.

Everything is removed by :meth:`EmulatedCluster.close` (idempotent), which also runs on leaving
the ``with`` block, on SIGTERM/SIGINT/SIGHUP and at interpreter exit.
:func:`~acco_bench.network.namespaces.cleanup_stale` removes what a crashed (SIGKILLed) run left behind.
Needs root and iproute2 (``ip``, ``tc``); :func:`~acco_bench.network.namespaces.netns_unavailable_reason`
says why it cannot run here. That machine-wide side (the ``ip`` commands, the probe, the stale
clean-up and the signal handlers) is :mod:`acco_bench.network.namespaces`.

Names: ``{prefix}{pid}-{seq}-h{i}`` and ``{prefix}{pid}-{seq}-br`` (default prefix ``acco-``), so
two runs, or a run and a stale leftover, never collide, and leftovers can be attributed to a
(dead) pid.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence

from acco_bench.network import delayline
from acco_bench.network.namespaces import (
    CMD_TIMEOUT,
    DEFAULT_PREFIX,
    available_shapers,
    delete_namespace,
    netns_unavailable_reason,
    next_id,
    parse_rate,
    register,
    run_command,
    tbf_args,
    unregister,
)

__all__ = ["EmulatedCluster"]


class EmulatedCluster:
    """``n_hosts`` network namespaces on one shaped bridge.

    ``bandwidth`` and ``latency`` are ``tc`` values (``"100mbit"``, ``"1ms"``) applied to the
    egress of every host's link; ``bandwidth=None`` leaves the rate unshaped and ``latency=None``
    adds no delay.

    ``shaper``: ``"netem"`` (``tc qdisc ... netem rate BW delay LAT``; ``limit`` sets its queue
    length in packets), ``"tbf"`` (a token bucket: rate only, the latency is NOT emulated),
    ``"tbf+delayline"`` (tbf for the rate, TUN devices and a user-space delay line instead of
    the bridge for the latency) or ``"auto"`` (netem where the kernel has it, else
    tbf+delayline when a latency is asked for, else tbf, with a warning when the latency cannot
    be emulated). :attr:`shaper` and :attr:`latency_emulated` say what was used.

    >>> with EmulatedCluster(2, bandwidth="100mbit") as c:      # doctest: +SKIP
    ...     p = c.popen(0, ["python", "worker.py"], env={"MASTER_ADDR": c.addr(0), ...})
    """

    def __init__(
        self,
        n_hosts: int,
        bandwidth: str | None = "100mbit",
        latency: str | None = "1ms",
        *,
        prefix: str = DEFAULT_PREFIX,
        subnet: int | None = None,
        limit: int | None = None,
        shaper: str = "auto",
    ):
        if n_hosts < 1 or n_hosts > 250:
            raise ValueError("n_hosts must be in 1..250")
        if "/" in prefix or any(ch.isspace() for ch in prefix):
            raise ValueError(f"bad namespace prefix {prefix!r}")
        reason = netns_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        shapers = available_shapers()
        if shaper == "auto":
            shaper = shapers[0]
            if shaper == "tbf" and latency is not None and "tbf+delayline" in shapers:
                shaper = "tbf+delayline"
        elif shaper not in ("netem", "tbf", "tbf+delayline"):
            raise ValueError(f"unknown shaper {shaper!r} (netem, tbf, tbf+delayline or auto)")
        elif shaper not in shapers:
            raise RuntimeError(f"the {shaper} qdisc is not available in this kernel (have: {shapers})")
        if bandwidth is not None:
            parse_rate(bandwidth)  # fail early on a typo
        if latency is not None:
            delayline.parse_time(latency)
        if shaper == "tbf+delayline" and latency is None:
            shaper = "tbf"  # nothing to delay: the bridge is cheaper
        #: "netem", "tbf" or "tbf+delayline"
        self.shaper = shaper
        #: whether ``latency`` is really added (tbf alone cannot delay packets)
        self.latency_emulated = latency is not None and shaper in ("netem", "tbf+delayline")
        if latency is not None and not self.latency_emulated:
            warnings.warn(
                f"EmulatedCluster: the netem qdisc is not available, links are shaped with tbf to "
                f"{bandwidth} but latency={latency!r} is not emulated", RuntimeWarning, stacklevel=2)
        self.n_hosts = n_hosts
        self.bandwidth = bandwidth
        self.latency = latency
        self.prefix = prefix
        #: the process that built it (a forked child must not tear it down)
        self.owner_pid = os.getpid()
        #: prefix of every namespace of this run (unique per process and per cluster)
        self.run_prefix = f"{prefix}{os.getpid()}-{next_id()}-"
        self.bridge_ns = f"{self.run_prefix}br"
        self.host_ns = [f"{self.run_prefix}h{i}" for i in range(n_hosts)]
        # The subnet exists only inside this run's namespaces, so collisions between runs are
        # harmless; it still varies with the pid to keep captured traces distinguishable.
        self.subnet = (os.getpid() % 200) + 20 if subnet is None else int(subnet)
        if not 0 <= self.subnet <= 255:
            raise ValueError("subnet must be in 0..255")
        self._procs: list[subprocess.Popen] = []
        #: the delay line's process (shaper tbf+delayline), else None
        self.delay_proc: subprocess.Popen | None = None
        self._created: list[str] = []
        self._closed = False  # no more popen()
        self._done = False  # teardown finished
        self._close_lock = threading.RLock()
        register(self)
        try:
            self._build(limit)
        except BaseException:
            self.close()
            raise

    # ---- construction ---------------------------------------------------------------------

    def _add_ns(self, name: str) -> None:
        self._created.append(name)  # first, so a signal right after the add cannot leak it
        run_command(["ip", "netns", "add", name])

    def _build(self, limit: int | None) -> None:
        if self.shaper == "tbf+delayline":
            self._build_delayline()
            return
        br = self.bridge_ns
        self._add_ns(br)
        run_command(["ip", "-n", br, "link", "add", "b0", "type", "bridge"])
        run_command(["ip", "-n", br, "link", "set", "b0", "up"])
        for i, ns in enumerate(self.host_ns):
            self._add_ns(ns)
            dev, peer = self.ifname(i), f"p{i}"
            # created inside the host namespace, peer moved straight into the bridge namespace
            run_command(
                ["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", br]
            )
            run_command(["ip", "-n", br, "link", "set", peer, "master", "b0"])
            run_command(["ip", "-n", br, "link", "set", peer, "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev])
            run_command(["ip", "-n", ns, "link", "set", dev, "up"])
            run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
            qdisc = self._qdisc_args(limit)
            if qdisc:
                run_command(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *qdisc])

    def _build_delayline(self) -> None:
        """Host i's interface is the TUN device ``v{i}``, served by a delay line that runs in the
        (otherwise empty) bridge namespace; tbf shapes each device's egress."""
        self._add_ns(self.bridge_ns)
        for ns in self.host_ns:
            self._add_ns(ns)
        links = [f"{self.ifname(i)}={ns}" for i, ns in enumerate(self.host_ns)]
        self.delay_proc = subprocess.Popen(
            ["ip", "netns", "exec", self.bridge_ns, sys.executable, "-m", "acco_bench.network.delayline",
             "--delay", str(self.latency), "--subnet", f"10.77.{self.subnet}", *links],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._procs.append(self.delay_proc)
        ready, _, _ = select.select([self.delay_proc.stdout], [], [], CMD_TIMEOUT)
        line = self.delay_proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            self.delay_proc.kill()
            err = self.delay_proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"the delay line did not start: {err[-1] if err else 'no answer in time'}")
        for i, ns in enumerate(self.host_ns):
            dev = self.ifname(i)
            run_command(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev])
            run_command(["ip", "-n", ns, "link", "set", dev, "mtu", str(delayline.MTU), "up"])
            run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.bandwidth is not None:
                run_command(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                      *tbf_args(self.bandwidth)])

    def _qdisc_args(self, limit: int | None) -> list[str]:
        if self.shaper == "tbf":
            return tbf_args(self.bandwidth) if self.bandwidth is not None else []
        netem = []
        if self.bandwidth is not None:
            netem += ["rate", str(self.bandwidth)]
        if self.latency is not None:
            netem += ["delay", str(self.latency)]
        if limit is not None:
            netem += ["limit", str(int(limit))]
        return ["netem", *netem] if netem else []

    def set_bandwidth(self, bandwidth: str | None) -> None:
        """Shape every host's link to ``bandwidth`` from now on (None: unshaped), the latency kept:
        how ``--comm-share`` measures unshaped, then sets the rate it computed, on one cluster."""
        if bandwidth is not None:
            parse_rate(bandwidth)
        self.bandwidth = bandwidth
        for i, ns in enumerate(self.host_ns):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
            if self.shaper == "netem":
                qdisc = self._qdisc_args(None)
            else:
                qdisc = tbf_args(bandwidth) if bandwidth is not None else []
            if qdisc:
                run_command([*tc, "replace", "dev", self.ifname(i), "root", *qdisc])
            else:  # nothing to shape: no root qdisc (the delete fails when there is none)
                run_command([*tc, "del", "dev", self.ifname(i), "root"], check=False)

    # ---- accessors ------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster (hosts, then the bridge)."""
        return [*self.host_ns, self.bridge_ns]

    def netns(self, i: int) -> str:
        return self.host_ns[i]

    def addr(self, i: int) -> str:
        """IPv4 address of host ``i``."""
        if not 0 <= i < self.n_hosts:
            raise IndexError(i)
        return f"10.77.{self.subnet}.{i + 1}"

    def ifname(self, i: int) -> str:
        """Name of host ``i``'s interface (inside its namespace)."""
        if not 0 <= i < self.n_hosts:
            raise IndexError(i)
        return f"v{i}"

    def tx_bytes(self) -> list[int]:
        """The tx byte counter of every host's interface: the bytes each host has sent."""
        counts = []
        for i, ns in enumerate(self.host_ns):
            proc = run_command(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", self.ifname(i)])
            counts.append(int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"]))
        return counts

    def exec_prefix(self, i: int) -> list[str]:
        """``["ip", "netns", "exec", name]``: prepend to a command to run it on host ``i``."""
        return ["ip", "netns", "exec", self.host_ns[i]]

    def popen(self, i: int, argv: Sequence[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on host ``i``; ``GLOO_SOCKET_IFNAME`` is set to the host's interface.

        ``env`` defaults to this process's environment. The process is killed by :meth:`close`
        if it is still running then.
        """
        if self._closed:
            raise RuntimeError("cluster is closed")
        full_env = dict(os.environ if env is None else env)
        full_env["GLOO_SOCKET_IFNAME"] = self.ifname(i)
        proc = subprocess.Popen([*self.exec_prefix(i), *argv], env=full_env, **kw)
        self._procs.append(proc)
        return proc

    # ---- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the processes started with :meth:`popen` and delete every namespace (idempotent).

        Re-entrant: a SIGTERM/SIGINT arriving while ``close`` runs finishes the teardown from
        the signal handler before the signal's usual action.
        """
        with self._close_lock:
            if self._done:
                return
            self._closed = True  # no new processes
            for p in list(self._procs):
                if p.poll() is None:
                    try:
                        p.terminate()
                        p.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(timeout=10)
                    except OSError:
                        pass
            for ns in list(reversed(self._created)):
                delete_namespace(ns)
                if ns in self._created:
                    self._created.remove(ns)
            self._done = True
            unregister(self)

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self._done and self.owner_pid == os.getpid():
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._done else "open"
        return (f"EmulatedCluster(n_hosts={self.n_hosts}, bandwidth={self.bandwidth!r}, "
                f"latency={self.latency!r}, run_prefix={self.run_prefix!r}, {state})")
