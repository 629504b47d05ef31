"""Multi-process tests on CPU: WORLD gloo processes, forked (no re-import of torch and timm)."""
import socket

import pytest
import torch.multiprocessing as mp

if "fork" not in mp.get_all_start_methods():
    pytest.skip("the processes are forked (no re-import of torch and timm)", allow_module_level=True)

WORLD = 2


def fork_processes(fn, *args):
    mp.start_processes(fn, args=args, nprocs=WORLD, start_method="fork")


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
