"""Link latency where the kernel has no ``netem``: a user-space delay line between TUN devices.

Each emulated host's interface is a TUN device whose far side is this process. A packet a host
sends (after its ``tbf`` qdisc has shaped the rate) is read here, held for ``--delay``, then
written into the TUN device of the host its IPv4 destination names, where the kernel receives
it. So every packet crosses one shaped egress and one fixed delay, as with ``netem rate BW delay
LAT`` on every host's link: the round-trip time is twice the delay.

Run by :class:`acco_bench.network.EmulatedCluster` inside the cluster's own bridge namespace:

    python -m acco_bench.network.delayline --delay 1ms --subnet 10.77.42 v0=NS0 v1=NS1

creates the TUN devices ``v0``, ``v1`` there, moves each into its host namespace (the open file
descriptors keep working), prints ``ready`` and forwards until killed. The parent gives the
devices their addresses, MTU and qdisc. A large MTU (64 KB) keeps the packet rate, hence this
process's CPU use, low: about 200 packets/s per direction at 100 Mbit/s.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_PDEATHSIG = 1
MTU = 65000

_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_time(value: str) -> float:
    """A ``tc`` time such as ``"1ms"``, ``"500us"`` or ``"0.2s"`` in seconds (bare numbers: us)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or (m.group(2) and m.group(2).lower() not in _TIME_UNITS):
        raise ValueError(f"cannot parse time {value!r} (e.g. 1ms, 500us)")
    return float(m.group(1)) * _TIME_UNITS.get(m.group(2).lower(), 1e-6)


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def forward(fds: list[int], subnet: bytes, delay_s: float) -> None:
    """Forward forever: read every packet, deliver it ``delay_s`` later to the host whose address
    (``subnet``.(i+1)) is its IPv4 destination. The delay is the same for every packet, so one
    FIFO holds them in delivery order. Anything else (IPv6, other subnets) is dropped."""
    pending: collections.deque[tuple[float, int, bytes]] = collections.deque()
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    n = len(fds)
    while True:
        timeout_ms = None
        if pending:
            timeout_ms = max(0.0, (pending[0][0] - time.monotonic()) * 1000.0)
        ready = poller.poll(timeout_ms)
        now = time.monotonic()
        for fd, _ in ready:
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(pkt) >= 20 and pkt[0] >> 4 == 4 and pkt[16:19] == subnet and 1 <= pkt[19] <= n:
                    pending.append((now + delay_s, fds[pkt[19] - 1], pkt))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, fd, pkt = pending.popleft()
            try:
                os.write(fd, pkt)
            except OSError:
                pass  # receiver's backlog full: the packet is lost, as on a real link; TCP resends


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay", required=True, help="one-way delay per packet, a tc time (1ms, 500us)")
    p.add_argument("--subnet", required=True, help="first three octets of the hosts' addresses")
    p.add_argument("links", nargs="+", help="DEVICE=NAMESPACE, host i's device first for i = 0, 1, ...")
    args = p.parse_args(argv)
    # Die with the cluster that started us, whatever way it goes.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    delay_s = parse_time(args.delay)
    subnet = bytes(int(x) for x in args.subnet.split("."))
    fds = []
    for link in args.links:
        dev, ns = link.split("=", 1)
        fds.append(open_tun(dev))
        subprocess.run(["ip", "link", "set", dev, "netns", ns], check=True, capture_output=True, text=True)
    print("ready", flush=True)
    forward(fds, subnet, delay_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
