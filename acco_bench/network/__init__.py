"""The emulated network the benchmarks run on, in one place; import from here.

- :class:`Network`: where a benchmark's workers start, the hosts of an emulated cluster or local
  processes on 127.0.0.1 (``--loopback``) (``hosts.py``);
- :class:`EmulatedCluster`: N network namespaces on one machine whose links are shaped with
  ``tc`` (netem, or tbf plus a user-space delay line where the kernel has no netem)
  (``emulated.py``, ``delayline.py``);
- the machine's side (``namespaces.py``): whether namespaces can be used here
  (:func:`netns_unavailable_reason`, :func:`available_shapers`), ``tc`` rates and times
  (:func:`parse_rate`, :func:`parse_time`), and the clean-up of what a crashed run left
  (:func:`cleanup_stale`, :func:`list_namespaces`).

Needs root and iproute2 (``ip``, ``tc``).
"""

from acco_bench.network.delayline import parse_time
from acco_bench.network.emulated import EmulatedCluster
from acco_bench.network.hosts import Network
from acco_bench.network.namespaces import (
    DEFAULT_PREFIX,
    available_shapers,
    cleanup_stale,
    list_namespaces,
    netns_unavailable_reason,
    parse_rate,
)

__all__ = [
    "DEFAULT_PREFIX",
    "EmulatedCluster",
    "Network",
    "available_shapers",
    "cleanup_stale",
    "list_namespaces",
    "netns_unavailable_reason",
    "parse_rate",
    "parse_time",
]
