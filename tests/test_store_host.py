"""When rank 0, the rendezvous store's host, dies, the others say so in one line: a read or write of
a store whose host has gone makes torch's C++ client log a stack trace before it raises, so acco asks
first whether anything still listens there (progress.store_listening). At the end of a run rank 0
leaves last (process_group.leave_the_store)."""

import subprocess
import sys

import pytest
from distributed import clean_env, free_port, write_script

# Rank 0, the store's host, exits once both ranks have marked; rank 1 then publishes its progress,
# fails a collective and waits on the store for work of rank 0's.
STORE_HOST_GONE = """
    import os, select, sys
    import torch.distributed as dist
    from pathlib import Path
    from acco.engine import progress
    from acco.launch import init_distributed, process_group, wait_on_store

    out = Path(sys.argv[1])
    rank, _, _, _ = init_distributed(timeout_s=30)
    progress.mark("update 1")
    # Nothing of rank 1's may be on its way to the store as rank 0 exits. The beat looks before it
    # writes, but a host that exits between the look and the write still gets torch's trace logged
    # (CI saw it: the first beat, started by init_distributed, racing the barrier below). The
    # heartbeat's own test covers its silent stop.
    progress.publish()  # now, in this thread: the publisher is left nothing to write
    process_group.stop_heartbeat()
    (out / f"pid{rank}").write_text(str(os.getpid()))
    dist.barrier()
    if rank == 0:
        os._exit(0)
    select.select([os.pidfd_open(int((out / "pid0").read_text()))], [], [])  # rank 0 has exited
    progress.PROBE_EVERY_S = 0  # the publisher looks at every write (at most once a second in a run)
    progress.mark("update 2")
    try:
        progress.publish()  # what the publisher thread does after a mark
    except ConnectionError as e:
        (out / "publish.txt").write_text(str(e))

    @progress.names_lost_ranks
    def collective():
        raise RuntimeError("Connection reset by peer")

    try:
        collective()
    except progress.LostWorkerError as e:
        (out / "lost.txt").write_text(str(e))
    try:
        wait_on_store(["acco/never"], "rank 0's tokenized data")
    except progress.LostWorkerError as e:
        (out / "wait.txt").write_text(str(e))
    os._exit(0)
"""


def test_a_rank_whose_store_host_exited_says_so_in_one_line_without_torch_s_trace(tmp_path):
    """Reading or writing the progress record on a store whose host has gone makes torch's C++
    client log a stack trace before it raises; acco finds the host gone first and says so alone."""
    script = write_script(tmp_path, "gone.py", STORE_HOST_GONE)
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path)], stderr=subprocess.PIPE, text=True,
                              env=clean_env({**env, "RANK": str(r), "LOCAL_RANK": str(r)})) for r in range(2)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    assert (tmp_path / "lost.txt").read_text().endswith("the progress record on the rendezvous store "
                                                        "cannot be read, its host has exited)")
    assert (tmp_path / "publish.txt").read_text() == "the store's host has exited"
    assert (tmp_path / "wait.txt").read_text() == (
        "the rendezvous store's host (rank 0, unless torchrun hosts the store) exited while the workers "
        "waited for rank 0's tokenized data")
    assert "TCPStore" not in errs[1] and "frame #" not in errs[1], errs[1]


def _beat_with_the_store(rank, world, listening):
    import torch.distributed as dist

    from acco.launch import process_group

    store, key = dist.distributed_c10d._get_default_store(), process_group._ALIVE.format(rank)
    process_group.store_listening = lambda s: listening
    before = store.add(key, 0)
    process_group.start_heartbeat(30.0)  # a beat at once, then every 5 s
    _, thread = process_group._heartbeat["stop"]
    if listening:  # its first beat lands, however busy the machine
        while store.add(key, 0) == before:
            thread.join(timeout=0.01)
    thread.join(timeout=0 if listening else 30)  # one that does not beat ends on its own
    beating = thread.is_alive()
    process_group.stop_heartbeat()
    return store.add(key, 0) - before, beating


@pytest.mark.parametrize("listening", [True, False])
def test_the_heartbeat_stops_without_a_word_once_its_store_s_host_has_gone(listening):
    """A beat sent to a store whose host has exited fails after torch's C++ client has logged a
    stack trace: the beat asks whether anything still listens there first (store_listening)."""
    from distributed import run_distributed

    results = run_distributed(_beat_with_the_store, 2, listening)
    assert results == ([(1, True)] * 2 if listening else [(0, False)] * 2)


def _leave(rank, world):
    import os
    import time

    import torch.distributed as dist

    from acco.engine import progress
    from acco.launch import process_group

    def kept() -> int:
        return sum(key[0] == os.getpid() for key in progress._probes)

    assert progress.store_listening(dist.distributed_c10d._get_default_store()) and kept() == 1
    if rank == 1:
        time.sleep(1.5)  # a rank slower to finish its run (freeing its model, say)
    start = time.monotonic()
    process_group.leave_the_store()
    return time.monotonic() - start, kept()


def test_rank0_the_store_s_host_leaves_after_every_other_rank():
    """A successful 4-worker run at 125M ended with exit 1 and torch's trace: rank 0 had saved the
    model and exited while the others still polled the store for it. Rank 0 now waits for every
    rank's last store operation before it may exit; the others do not wait. Then each closes the
    connection it kept open to watch the store's host."""
    from distributed import run_distributed

    (waited0, kept0), (waited1, kept1) = run_distributed(_leave, 2)
    assert waited0 >= 1.0 and waited1 < 1.0, (waited0, waited1)
    assert kept0 == kept1 == 0


def _connections_waiting(listener) -> list:
    """Accept every connection made to `listener` so far (the kernel completes them without us)."""
    listener.setblocking(False)
    accepted = []
    while True:
        try:
            accepted.append(listener.accept()[0])
        except BlockingIOError:
            return accepted


def test_the_store_s_host_is_watched_through_one_connection_kept_open():
    """Each look at the store's host used to open a connection, and the store's server looks up
    every new client's name: a reverse DNS query on the thread serving every rank, which held them
    all for 5 s when the resolver did not answer (one look in 60 on the VM; a checkpoint's shards
    then waited 5 s). Now a process keeps one connection open and reads the host's exit from it;
    a server started again on the address is found through one fresh connection."""
    import socket

    from distributed import free_port

    from acco.engine.progress import host_listening

    port = free_port()  # outside the ephemeral range: no connection takes it before the restart below
    listener = socket.create_server(("127.0.0.1", port))
    assert all(host_listening("127.0.0.1", port) for _ in range(50))
    kept = _connections_waiting(listener)
    assert len(kept) == 1  # one connection for 50 looks
    assert host_listening("127.0.0.1", port) and _connections_waiting(listener) == []
    listener.close()
    kept[0].close()  # the host exits: its end of the kept connection closes, and nothing listens
    assert not host_listening("127.0.0.1", port)
    again = socket.create_server(("127.0.0.1", port))  # a store started again where it was
    assert host_listening("127.0.0.1", port) and host_listening("127.0.0.1", port)
    assert len(_connections_waiting(again)) == 1
    again.close()
