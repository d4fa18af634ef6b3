"""A small torch.distributed (gloo, CPU) training job that checkpoints rank-sharded state into a
directory with plain `torch.save`, one file per tensor - nothing ckptfs-specific. Point
--ckpt-dir at a ckptfs mount (/ckpt) and the many small files become a few large writes.

    torchrun --standalone --nproc-per-node 2 train_example.py --ckpt-dir /ckpt --steps 4
    python train_example.py --nproc 2 --ckpt-dir /ckpt           # same, without torchrun
    torchrun ... train_example.py --ckpt-dir /ckpt --restore     # load the latest, verify

Layout: CKPT/step_N/rank_R/{param.NAME.pt, exp_avg.NAME.pt, exp_avg_sq.NAME.pt, rng.pt},
CKPT/step_N/manifest.json (SHA-256 of every tensor, written by rank 0 once every rank's
files are durable). Parameters are sharded round-robin: rank R saves parameter i (and its Adam
state) when i % world == R. After saving, each rank fsyncs its directory (ckptfs: a barrier
for everything that rank wrote), so a manifest only exists for a complete checkpoint.
--restore: every rank loads all shards of the latest complete step, checks every tensor
against the manifest, rebuilds the model and optimizer, and runs one more step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()
                          if t.numel() else b"").hexdigest() + f":{t.dtype}:{list(t.shape)}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard(named: list[tuple[str, torch.nn.Parameter]], rank: int, world: int):
    return [(i, n, p) for i, (n, p) in enumerate(named) if i % world == rank]


def save(ckpt: str, step: int, model, opt, rank: int, world: int) -> dict:
    """Each rank torch.saves its shard, one file per tensor; returns {relpath: digest}."""
    d = os.path.join(ckpt, f"step_{step}", f"rank_{rank}")
    os.makedirs(d, exist_ok=True)
    named = list(model.named_parameters())
    digests = {}
    for _, name, p in shard(named, rank, world):
        tensors = {"param": p.data}
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                tensors[k] = st[k]
        for kind, t in tensors.items():
            rel = f"rank_{rank}/{kind}.{name}.pt"
            torch.save(t.clone(), os.path.join(ckpt, f"step_{step}", rel))
            digests[rel] = digest(t)
    torch.save({"step": step, "torch_rng": torch.get_rng_state()}, os.path.join(d, "rng.pt"))
    fsync_dir(d)  # durable: this rank's files and everything it wrote before
    return digests


def load_all(ckpt: str, step: int, model, opt, world: int) -> None:
    """Load every rank's shard of `step` into model/opt; check each tensor's digest."""
    sdir = os.path.join(ckpt, f"step_{step}")
    with open(os.path.join(sdir, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest["world"] != world:
        raise SystemExit(f"checkpoint was written by {manifest['world']} ranks, not {world}")
    named = list(model.named_parameters())
    for r in range(world):
        for _, name, p in shard(named, r, world):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                rel = f"rank_{r}/{kind}.{name}.pt"
                if rel not in manifest["tensors"]:
                    continue
                t = torch.load(os.path.join(sdir, rel), weights_only=True)
                if digest(t) != manifest["tensors"][rel]:
                    raise SystemExit(f"{sdir}/{rel}: content differs from the manifest")
                if kind == "param":
                    p.data.copy_(t)
                else:
                    opt.state.setdefault(p, {})[kind] = t
                    opt.state[p].setdefault("step", torch.tensor(float(step)))


def latest_step(ckpt: str) -> int | None:
    steps = []
    for e in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
        if e.startswith("step_") and os.path.exists(os.path.join(ckpt, e, "manifest.json")):
            steps.append(int(e[5:]))
    return max(steps) if steps else None


def train_step(model, opt, gen: torch.Generator, batch: int, width: int) -> float:
    x = torch.randn(batch, width, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def run(rank: int, world: int, a) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)  # same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(make_model(a.width, a.depth))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    say = (lambda *m: print(*m, flush=True)) if rank == 0 else (lambda *m: None)
    nparams = sum(p.numel() for p in model.parameters())
    start = 0
    if a.restore:
        step = latest_step(a.ckpt_dir)
        if step is None:
            raise SystemExit(f"no complete checkpoint in {a.ckpt_dir}")
        t0 = time.perf_counter()
        load_all(a.ckpt_dir, step, model.module, opt, world)
        dist.barrier()
        say(f"restored step {step} from {a.ckpt_dir}: {nparams} parameters, every tensor "
            f"matches its manifest digest ({time.perf_counter() - t0:.2f} s)")
        loss = train_step(model, opt, gen, a.batch, a.width)
        say(f"step {step + 1}: loss {loss:.4f} (training continues from the checkpoint)")
        _shutdown(model)
        return
    for step in range(start + 1, a.steps + 1):
        loss = train_step(model, opt, gen, a.batch, a.width)
        if step % a.save_every == 0 or step == a.steps:
            t0 = time.perf_counter()
            digests = save(a.ckpt_dir, step, model.module, opt, rank, world)
            gathered: list[dict] = [{} for _ in range(world)]
            dist.all_gather_object(gathered, digests)  # also a barrier: every rank durable
            if rank == 0:
                sdir = os.path.join(a.ckpt_dir, f"step_{step}")
                tensors = {k: v for g in gathered for k, v in g.items()}
                tmp = os.path.join(sdir, "manifest.json.tmp")
                with open(tmp, "w") as f:
                    json.dump({"step": step, "world": world, "tensors": tensors}, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(sdir, "manifest.json"))
                fsync_dir(sdir)
            dist.barrier()
            say(f"step {step}: loss {loss:.4f}; saved {len(digests)} tensors per rank "
                f"x {world} ranks to {a.ckpt_dir}/step_{step} "
                f"({time.perf_counter() - t0:.2f} s)")
    _shutdown(model)


def _shutdown(model) -> None:
    # All ranks leave together and the DDP reducer goes before the process group: gloo
    # otherwise aborts now and then at exit ("terminate called without an active exception").
    dist.barrier()
    del model
    dist.destroy_process_group()


def _leave() -> None:
    # Everything is durable (fsynced manifests) and the process group is gone, yet gloo
    # (torch 2.13) still aborts now and then in a static destructor at interpreter exit
    # ("terminate called without an active exception", SIGABRT, after a clean run). Leave
    # without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned(rank: int, world: int, a, leave: bool = True) -> None:
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    run(rank, world, a)
    if leave:
        _leave()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt-dir", default="/ckpt")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--restore", action="store_true",
                    help="load the latest complete checkpoint, verify, train one step")
    ap.add_argument("--nproc", type=int, default=1,
                    help="without torchrun: start this many processes (torch.multiprocessing)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)
        _leave()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if a.nproc == 1:
        _spawned(0, 1, a, leave=False)
    else:
        import torch.multiprocessing as mp
        mp.spawn(_spawned, args=(a.nproc, a), nprocs=a.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
