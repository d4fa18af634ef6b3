"""One rank of a training job's checkpointing, run by torchrun from the multi-mount tests
(tests/test_live_writers.py, tests/test_glusterfs_live.py): 4 ranks, two per ckptfs mount
(each mount stands for a node), a DCP save into step_N every step, rank 0 deleting step_N-2
for every node, one rank killed once after step KILL_AT, and after torchrun restarts the
group every rank reloading the newest step through its own mount and checking it bit for bit.

argv: MOUNT_A MOUNT_B STEPS KILL_AT OUT_DIR. Each rank writes OUT_DIR/rank<r>-<attempt>.json.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"rank{rank}": {"w": torch.randn(512, 256, generator=g),
                            "b": torch.randn(3000, generator=g).to(torch.bfloat16),
                            "step": torch.tensor(step, dtype=torch.int64)}}


def blank(x):
    if isinstance(x, dict):
        return {k: blank(v) for k, v in x.items()}
    return torch.zeros_like(x)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        (a.reshape(-1).view(torch.uint8) == b.reshape(-1).view(torch.uint8)).all())


def sync(mount: str) -> None:
    """ckptfs sync: what this mount wrote is durable, and what the others made durable before
    is seen here."""
    os.getxattr(mount, "user.ckptfs.sync")


def steps_in(root: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_")
                  and os.path.exists(os.path.join(root, n, ".metadata")))


def main() -> None:
    mounts = sys.argv[1:3]
    steps, kill_at, out = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    master = os.environ["MASTER_ADDR"]
    addrs = {ai[4][0] for ai in socket.getaddrinfo(master, None)}
    report = {"rank": rank, "attempt": attempt, "master": master, "addrs": sorted(addrs),
              "loopback": all(ipaddress.ip_address(a) in LOOPBACK or
                              ipaddress.ip_address(a).is_loopback for a in addrs)}
    if not report["loopback"]:
        raise SystemExit(f"rendezvous address {master} resolves to {addrs}, not loopback")
    # Each attempt in a store prefix of its own: torchrun's store keeps the previous
    # attempt's gloo addresses, which a restarted rank may otherwise read before the new ones
    # are there (and fail, connection refused).
    base = dist.TCPStore(master, int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", base),
                            rank=rank, world_size=world)
    mount = mounts[rank * len(mounts) // world]  # two ranks per mount
    root = os.path.join(mount, "ckpt")
    os.makedirs(root, exist_ok=True)
    warnings.simplefilter("ignore")
    start = 1
    if attempt > 0:  # restarted: the newest step, through this rank's own mount
        sync(mount)
        newest = [max(steps_in(root)) if rank == 0 else None]
        dist.broadcast_object_list(newest, 0)
        sd = blank(state(newest[0], rank))
        dcp.load(sd, checkpoint_id=os.path.join(root, f"step_{newest[0]}"))
        report.update(loaded=newest[0], exact=same(sd, state(newest[0], rank)))
        start = newest[0] + 1
    for step in range(start, steps + 1):
        path = os.path.join(root, f"step_{step}")
        os.makedirs(path, exist_ok=True)
        dcp.save(state(step, rank), checkpoint_id=path)
        sync(mount)
        dist.barrier()
        if rank == 0 and step > 2:
            sync(mount)
            shutil.rmtree(os.path.join(root, f"step_{step - 2}"))  # every node's shards
            sync(mount)
        dist.barrier()
        if attempt == 0 and step == kill_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # torchrun restarts the group
    sync(mount)
    report["steps_seen"] = steps_in(root)
    with open(os.path.join(out, f"rank{rank}-{attempt}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
