"""An emulated cluster on one Linux machine: network namespaces joined by a bridge, with ``tc netem``.

Where the kernel has no ``netem`` (many minimal VM kernels), the rate is shaped with ``tbf`` and,
when a latency is asked for, the hosts are joined by :mod:`acco.bench.delayline` (TUN devices and
a user-space delay line) instead of the bridge: :attr:`EmulatedCluster.shaper` says which.

Each host ``h{i}`` is a network namespace with one veth interface; the other end of every veth
lives in a separate bridge namespace, where all of them are enslaved to one bridge. ``tc netem``
shapes the egress of every host's interface to ``bandwidth`` and adds ``latency``, so traffic
between two hosts crosses two shaped links (one per direction), like a switched full-duplex
network. Nothing is created in the caller's own network namespace: the veth pairs are created
inside the host namespaces directly, so no interface name can collide with the machine's, and the
addresses (``10.77.N.0/24``) exist only inside the namespaces this module made.

Everything is removed by :meth:`EmulatedCluster.close` (idempotent), which also runs on leaving
the ``with`` block, on SIGTERM/SIGINT/SIGHUP and at interpreter exit. :func:`cleanup_stale` removes what
a crashed (SIGKILLed) run left behind. Needs root and iproute2 (``ip``, ``tc``);
:func:`netns_unavailable_reason` says why it cannot run here.

Names: ``{prefix}{pid}-{seq}-h{i}`` and ``{prefix}{pid}-{seq}-br`` (default prefix ``acco-``), so
two runs, or a run and a stale leftover, never collide, and leftovers can be attributed to a
(dead) pid.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence

from acco.bench import delayline

__all__ = [
    "DEFAULT_PREFIX",
    "EmulatedCluster",
    "cleanup_stale",
    "list_namespaces",
    "available_shapers",
    "netns_unavailable_reason",
    "parse_rate",
]

DEFAULT_PREFIX = "acco-"
_CMD_TIMEOUT = 30.0

_seq = itertools.count()
_lock = threading.RLock()
_live: dict[int, EmulatedCluster] = {}  # id -> cluster, clusters not yet closed
_prev_handlers: dict[int, object] = {}  # signal number -> handler we replaced
_atexit_registered = False


# --------------------------------------------------------------------------------------------
# helpers


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def list_namespaces(prefix: str = "") -> list[str]:
    """Names of the network namespaces (``ip netns list``) starting with ``prefix``."""
    proc = _run(["ip", "netns", "list"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split()
        if parts and parts[0].startswith(prefix):
            names.append(parts[0])
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pids_in(ns: str) -> None:
    """SIGKILL every process still running inside namespace ``ns`` (they would keep it alive)."""
    proc = _run(["ip", "netns", "pids", ns], check=False)
    for tok in proc.stdout.split():
        try:
            pid = int(tok)
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _delete_namespace(ns: str) -> None:
    _kill_pids_in(ns)
    # Deleting a namespace destroys its interfaces; a veth pair goes with either end.
    _run(["ip", "netns", "delete", ns], check=False)


_RATE_UNITS = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibit": 1024.0, "mibit": 1024.0**2, "gibit": 1024.0**3,
}


def parse_rate(rate: str) -> float:
    """A ``tc`` rate such as ``"100mbit"`` or ``"12.5mbps"`` in bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
    if not m:
        raise ValueError(f"cannot parse rate {rate!r}")
    unit = m.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"unknown rate unit in {rate!r}")
    return float(m.group(1)) * _RATE_UNITS[unit]


# --------------------------------------------------------------------------------------------
# availability and stale cleanup


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str | None, tuple[str, ...]]:
    """(reason why namespaces cannot be used or None, qdiscs usable for shaping)."""
    if os.name != "posix" or not hasattr(os, "geteuid") or not os.path.isdir("/proc/self/ns"):
        return "Network namespaces need Linux.", ()
    if os.geteuid() != 0:
        return "Network namespaces need root (this process is not running as uid 0).", ()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"The '{tool}' command (iproute2) is not installed.", ()
    probe = f"{DEFAULT_PREFIX}{os.getpid()}-probe{next(_seq)}"
    shapers = []
    try:
        proc = _run(["ip", "netns", "add", probe], check=False)
        if proc.returncode != 0:
            return f"'ip netns add' failed: {proc.stderr.strip() or 'unknown error'}.", ()
        proc = _run(["ip", "-n", probe, "link", "add", "vprobe", "type", "veth", "peer", "name",
                     "pprobe"], check=False)
        if proc.returncode != 0:
            return f"veth pairs cannot be created: {proc.stderr.strip() or 'unknown error'}.", ()
        tc = ["ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "vprobe", "root"]
        if _run([*tc, "netem", "rate", "100mbit", "delay", "1ms"], check=False).returncode == 0:
            shapers.append("netem")
        if _run([*tc, *_tbf_args("100mbit")], check=False).returncode == 0:
            shapers.append("tbf")
        if "tbf" in shapers and os.access("/dev/net/tun", os.R_OK | os.W_OK):
            shapers.append("tbf+delayline")
        if not shapers:
            return ("Neither the netem nor the tbf qdisc is available in this kernel "
                    "(CONFIG_NET_SCH_NETEM / CONFIG_NET_SCH_TBF), so links cannot be shaped."), ()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"Running 'ip netns' failed: {exc}.", ()
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return None, tuple(shapers)


def netns_unavailable_reason() -> str | None:
    """None when an :class:`EmulatedCluster` can be built here, else one sentence saying why not.

    Checks root, ``ip``/``tc``, that ``ip netns add`` and veth pairs work and that a shaping
    qdisc (netem, else tbf) exists. Probed once per process.
    """
    return _probe()[0]


def available_shapers() -> tuple[str, ...]:
    """The shapers this machine offers, in order of preference: ``netem``, ``tbf``,
    ``tbf+delayline``.

    netem emulates rate and latency; tbf only the rate (many minimal kernels lack netem);
    tbf+delayline adds the latency with TUN devices and :mod:`acco.bench.delayline`.
    """
    return _probe()[1]


def _tbf_args(bandwidth: str) -> list[str]:
    """A token bucket at ``bandwidth``: bucket of ~2 ms of traffic (at least 64 KiB, one GSO
    super-packet), queue of ~50 ms (at least 4 buckets)."""
    bytes_per_s = parse_rate(bandwidth) / 8.0
    burst = max(64 * 1024, int(bytes_per_s * 0.002))
    limit = max(4 * burst, int(bytes_per_s * 0.05))
    return ["tbf", "rate", str(bandwidth), "burst", str(burst), "limit", str(limit)]


_NAME_RE = re.compile(r"(\d+)-")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, include_live: bool = False) -> list[str]:
    """Remove namespaces named ``{prefix}{pid}-...`` left by runs whose process is gone.

    Namespaces of a live process (another run going on right now) are kept unless
    ``include_live``; namespaces of this process's open clusters are always kept. Returns the
    names removed.
    """
    with _lock:
        mine = {ns for c in _live.values() for ns in c.namespaces}
    removed = []
    for ns in list_namespaces(prefix):
        if ns in mine:
            continue
        m = _NAME_RE.match(ns[len(prefix):])
        if m is None:
            continue  # not one of ours
        pid = int(m.group(1))
        if not include_live and pid != os.getpid() and _pid_alive(pid):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


# --------------------------------------------------------------------------------------------
# signal / atexit cleanup


def _close_all_owned() -> None:
    with _lock:
        clusters = list(_live.values())
    for c in clusters:
        if c._owner_pid == os.getpid():  # not in a forked child that inherited the registry
            c.close()


def _on_signal(signum, frame):
    # read before closing: closing the last cluster restores (and forgets) the old handlers
    prev = _prev_handlers.get(signum, signal.SIG_DFL)
    _close_all_owned()
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    # default action: restore it and re-deliver, so the exit status says "killed by signal"
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_close_all_owned)
        _atexit_registered = True
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers exit
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if sig in _prev_handlers:
            continue
        try:
            _prev_handlers[sig] = signal.signal(sig, _on_signal)
        except (ValueError, OSError):
            pass


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_prev_handlers.items()):
        try:
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, prev)
        except (ValueError, OSError, TypeError):
            pass
        del _prev_handlers[sig]


# --------------------------------------------------------------------------------------------
# the cluster


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
        self._owner_pid = os.getpid()
        #: prefix of every namespace of this run (unique per process and per cluster)
        self.run_prefix = f"{prefix}{os.getpid()}-{next(_seq)}-"
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
        with _lock:
            _live[id(self)] = self
            _install_handlers()
        try:
            self._build(limit)
        except BaseException:
            self.close()
            raise

    # ---- construction ---------------------------------------------------------------------

    def _add_ns(self, name: str) -> None:
        self._created.append(name)  # first, so a signal right after the add cannot leak it
        _run(["ip", "netns", "add", name])

    def _build(self, limit: int | None) -> None:
        if self.shaper == "tbf+delayline":
            self._build_delayline()
            return
        br = self.bridge_ns
        self._add_ns(br)
        _run(["ip", "-n", br, "link", "add", "b0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "b0", "up"])
        for i, ns in enumerate(self.host_ns):
            self._add_ns(ns)
            dev, peer = self.ifname(i), f"p{i}"
            # created inside the host namespace, peer moved straight into the bridge namespace
            _run(["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", br])
            _run(["ip", "-n", br, "link", "set", peer, "master", "b0"])
            _run(["ip", "-n", br, "link", "set", peer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            qdisc = self._qdisc_args(limit)
            if qdisc:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *qdisc])

    def _build_delayline(self) -> None:
        """Host i's interface is the TUN device ``v{i}``, served by a delay line that runs in the
        (otherwise empty) bridge namespace; tbf shapes each device's egress."""
        self._add_ns(self.bridge_ns)
        for ns in self.host_ns:
            self._add_ns(ns)
        links = [f"{self.ifname(i)}={ns}" for i, ns in enumerate(self.host_ns)]
        self.delay_proc = subprocess.Popen(
            ["ip", "netns", "exec", self.bridge_ns, sys.executable, "-m", "acco.bench.delayline",
             "--delay", str(self.latency), "--subnet", f"10.77.{self.subnet}", *links],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._procs.append(self.delay_proc)
        ready, _, _ = select.select([self.delay_proc.stdout], [], [], _CMD_TIMEOUT)
        line = self.delay_proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            self.delay_proc.kill()
            err = self.delay_proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"the delay line did not start: {err[-1] if err else 'no answer in time'}")
        for i, ns in enumerate(self.host_ns):
            dev = self.ifname(i)
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(delayline.MTU), "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.bandwidth is not None:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                      *_tbf_args(self.bandwidth)])

    def _qdisc_args(self, limit: int | None) -> list[str]:
        if self.shaper == "tbf":
            return _tbf_args(self.bandwidth) if self.bandwidth is not None else []
        netem = []
        if self.bandwidth is not None:
            netem += ["rate", str(self.bandwidth)]
        if self.latency is not None:
            netem += ["delay", str(self.latency)]
        if limit is not None:
            netem += ["limit", str(int(limit))]
        return ["netem", *netem] if netem else []

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
                _delete_namespace(ns)
                if ns in self._created:
                    self._created.remove(ns)
            self._done = True
            with _lock:
                _live.pop(id(self), None)
                if not _live:
                    _restore_handlers()

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self._done and self._owner_pid == os.getpid():
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._done else "open"
        return (f"EmulatedCluster(n_hosts={self.n_hosts}, bandwidth={self.bandwidth!r}, "
                f"latency={self.latency!r}, run_prefix={self.run_prefix!r}, {state})")
