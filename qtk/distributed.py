"""Data-parallel calibration: several processes (ranks) each run their share of the calibration
batches through every block, and add up or max what the methods gather before any of them uses it.

    rank r of N runs the global batches r, r + N, r + 2N, ...          shard
    GPTQ's Hessians, AWQ's statistics and candidate losses             summed over the ranks   sum_
    GPTQ's solves                                                      dealt out, then shared  deal, share_layers
    static activation, SmoothQuant and KV-cache ranges                 the max over the ranks  max_
    the quantized block                                                rank 0's, on every rank same_block
    the checkpoint                                                     written by rank 0       writes

Every statistic is a sum over tokens or a max over them, so N ranks reach one process's figures up
to the order of the float sums, and the same decisions. Started by torchrun (RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment) or by `qtk quantize --nproc N` (launch); gloo on
CPU, NCCL on CUDA (each rank on the GPU of its LOCAL_RANK). Without those variables there is one
process, a world of one, and every function here is a no-op.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from .errors import InputError

log = logging.getLogger(__name__)

# a rank waits at a collective while another is slower (rank 0 writing the checkpoint at the end)
TIMEOUT = datetime.timedelta(hours=6)
# one-byte dtypes gloo does not carry, sent as their bytes
BYTES = (torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
GRACE_S = 10  # after one process fails, how long the others have to end on their own before they are stopped


def setup(device: str) -> str:
    """Join the process group the environment describes (once); returns the calibration device this
    rank uses: `device`, or on CUDA the GPU of its LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    cuda = device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    return device


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def size() -> int:
    return dist.get_world_size() if active() else 1


def writes() -> bool:
    """Whether this process writes files (rank 0)."""
    return rank() == 0


def shard(ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, list[int], int]:
    """This rank's calibration samples (its batches: r, r + N, ... of every rank's), the index of each
    of its batches' first sample among all samples, and how many batches there are in all."""
    starts = list(range(0, len(ids), batch_size))
    if len(starts) < size():
        raise InputError(f"{len(starts)} calibration batches of {batch_size} cannot be shared by {size()} processes: "
                         "give each process a batch at least (more --num-samples, a smaller --batch-size or "
                         "fewer processes)")
    mine = starts[rank()::size()]
    ids = torch.cat([ids[s:s + batch_size] for s in mine]) if active() else ids
    return ids, mine, len(starts)


def sum_(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks, in place."""
    if active():
        dist.all_reduce(t, dist.ReduceOp.SUM)
    return t


def max_(t: torch.Tensor) -> torch.Tensor:
    """t's elementwise max over the ranks, in place."""
    if active():
        dist.all_reduce(t, dist.ReduceOp.MAX)
    return t


def sum_floats(*values: float) -> list[float]:
    """Each value summed over the ranks (in float64)."""
    if not active():
        return list(values)
    return sum_(torch.tensor(values, dtype=torch.float64)).tolist()


def gathered(obj) -> list:
    """Every rank's `obj` (small picklable things: which layers a rank saw), in rank order."""
    if not active():
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def from_writer(obj):
    """Rank 0's `obj` on every rank (e.g. the calibration ids, read or written once)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def deal(costs: list[float]) -> list[int]:
    """The rank that does each of several jobs of these costs: the costliest first, each to the least
    loaded rank (every rank deals the same)."""
    load, owner = [0.0] * size(), [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):
        owner[j] = min(range(size()), key=lambda r: (load[r], r))
        load[owner[j]] += costs[j]
    return owner


def share_layers(block, names, src: int) -> None:
    """The named layers of `block` (their tensors) and their reported errors set to rank src's."""
    if not active():
        return
    _broadcast([t for n in names for t in (*block.linear(n).parameters(), *block.linear(n).buffers())], src)
    errors = torch.tensor([block.errors.get(n, 0.0) for n in names], dtype=torch.float64)
    dist.broadcast(errors, src=src)
    block.errors.update(zip(names, errors.tolist()))


def same_block(module: torch.nn.Module) -> None:
    """Every tensor of `module` (a quantized block) set to rank 0's: each rank goes on from the very
    same block whatever its last bits of float arithmetic did."""
    if active():
        _broadcast([*module.parameters(), *module.buffers()], 0)


def _broadcast(tensors: list[torch.Tensor], src: int) -> None:
    for t in tensors:
        data = t.data.view(torch.uint8) if t.dtype in BYTES else t.data
        if data.is_contiguous():
            dist.broadcast(data, src=src)
        else:
            whole = data.contiguous()
            dist.broadcast(whole, src=src)
            data.copy_(whole)


def finish() -> None:
    """Wait for every rank (rank 0 may still be writing), then leave the process group."""
    if active():
        dist.barrier()
        dist.destroy_process_group()


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m qtk ARGV` in nproc processes on this machine as ranks 0..nproc-1 (what torchrun
    does, without its agent), each with its share of the CPU cores; returns 0, or once one fails the
    lowest rank's failing exit code (the others, waiting at a collective, are stopped)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    log.info("%d processes, %s threads each", nproc, env["OMP_NUM_THREADS"])
    procs = [subprocess.Popen([sys.executable, "-m", "qtk", *argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]
    try:
        while not any(p.poll() for p in procs) and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        deadline = time.monotonic() + GRACE_S  # one failed: the others (rank 0 with its error line) may follow
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        return next((c for c in codes if c), 0)  # rank 0's first
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
