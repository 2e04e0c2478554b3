"""The machine's side of the emulated clusters of :mod:`acco_bench.network.emulated`: the ``ip`` commands,
whether network namespaces and a shaping qdisc can be used here (:func:`netns_unavailable_reason`,
:func:`available_shapers`), link rates, and the clean-up of namespaces.

Clean-up: :func:`cleanup_stale` removes what a crashed (SIGKILLed) run left behind, recognised by
the ``{prefix}{pid}-`` of its names (see :mod:`acco_bench.network.emulated`); every open cluster of this
process is :func:`register`-ed, so that it is closed on SIGTERM/SIGINT/SIGHUP and at interpreter
exit. Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CMD_TIMEOUT",
    "DEFAULT_PREFIX",
    "available_shapers",
    "cleanup_stale",
    "delete_namespace",
    "list_namespaces",
    "netns_unavailable_reason",
    "next_id",
    "parse_rate",
    "register",
    "run_command",
    "tbf_args",
    "unregister",
]

DEFAULT_PREFIX = "acco-"
CMD_TIMEOUT = 30.0  # seconds, for every ip/tc command (and the delay line's start)

_seq = itertools.count()
_lock = threading.RLock()
_live: dict[int, Any] = {}  # id -> EmulatedCluster (emulated.py), clusters not yet closed
_prev_handlers: dict[int, object] = {}  # signal number -> handler we replaced
_atexit_registered = False


# --------------------------------------------------------------------------------------------
# helpers


def next_id() -> int:
    """A number not given before in this process (the ``{seq}`` of a cluster's names, probes)."""
    return next(_seq)


def run_command(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command (output captured, :data:`CMD_TIMEOUT`); with ``check``, a
    non-zero exit raises RuntimeError with its stderr."""
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def list_namespaces(prefix: str = "") -> list[str]:
    """Names of the network namespaces (``ip netns list``) starting with ``prefix``."""
    proc = run_command(["ip", "netns", "list"], check=False)
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
    proc = run_command(["ip", "netns", "pids", ns], check=False)
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


def delete_namespace(ns: str) -> None:
    """Kill what still runs in namespace ``ns``, then delete it (and its interfaces)."""
    _kill_pids_in(ns)
    # Deleting a namespace destroys its interfaces; a veth pair goes with either end.
    run_command(["ip", "netns", "delete", ns], check=False)


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
    probe = f"{DEFAULT_PREFIX}{os.getpid()}-probe{next_id()}"
    shapers = []
    try:
        proc = run_command(["ip", "netns", "add", probe], check=False)
        if proc.returncode != 0:
            return f"'ip netns add' failed: {proc.stderr.strip() or 'unknown error'}.", ()
        proc = run_command(["ip", "-n", probe, "link", "add", "vprobe", "type", "veth", "peer", "name",
                     "pprobe"], check=False)
        if proc.returncode != 0:
            return f"veth pairs cannot be created: {proc.stderr.strip() or 'unknown error'}.", ()
        tc = ["ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "vprobe", "root"]
        if run_command([*tc, "netem", "rate", "100mbit", "delay", "1ms"], check=False).returncode == 0:
            shapers.append("netem")
        if run_command([*tc, *tbf_args("100mbit")], check=False).returncode == 0:
            shapers.append("tbf")
        if "tbf" in shapers and os.access("/dev/net/tun", os.R_OK | os.W_OK):
            shapers.append("tbf+delayline")
        if not shapers:
            return ("Neither the netem nor the tbf qdisc is available in this kernel "
                    "(CONFIG_NET_SCH_NETEM / CONFIG_NET_SCH_TBF), so links cannot be shaped."), ()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"Running 'ip netns' failed: {exc}.", ()
    finally:
        run_command(["ip", "netns", "delete", probe], check=False)
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
    tbf+delayline adds the latency with TUN devices and :mod:`acco_bench.network.delayline`.
    """
    return _probe()[1]


def tbf_args(bandwidth: str) -> list[str]:
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
        delete_namespace(ns)
        removed.append(ns)
    return removed


# --------------------------------------------------------------------------------------------
# signal / atexit cleanup


def _close_all_owned() -> None:
    with _lock:
        clusters = list(_live.values())
    for c in clusters:
        if c.owner_pid == os.getpid():  # not in a forked child that inherited the registry
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


def register(cluster) -> None:
    """Track an open cluster (closed on a signal or at exit) and install the handlers."""
    with _lock:
        _live[id(cluster)] = cluster
        _install_handlers()


def unregister(cluster) -> None:
    """Forget a closed cluster; once none is open, the replaced signal handlers come back."""
    with _lock:
        _live.pop(id(cluster), None)
        if not _live:
            _restore_handlers()
