"""Checkpoint contents generated from real model architectures' shapes (no downloads).

`tensor_specs(arch, target_bytes)` lists (name, shape, dtype) of a training checkpoint: model
weights (bf16) plus Adam state (fp32 master weights, exp_avg, exp_avg_sq), with the number of
layers scaled so the total is close to `target_bytes` (the layer shapes stay those of the real
architecture). `state_dict(...)` materialises it with torch; `sizes(...)` gives byte sizes only
(for the I/O microbenchmarks, which need no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "uint8": 1}


@dataclass(frozen=True)
class Arch:
    name: str
    d_model: int
    n_layer: int
    ffn: int
    vocab: int
    n_head: int
    n_kv_head: int
    gated: bool  # SwiGLU (three FFN matrices) vs GELU MLP (two)
    tied: bool


ARCHS = {
    "gpt2": Arch("gpt2", 768, 12, 3072, 50257, 12, 12, gated=False, tied=True),
    "llama-1b": Arch("llama-1b", 2048, 16, 8192, 128256, 32, 8, gated=True, tied=True),
    "llama-7b": Arch("llama-7b", 4096, 32, 11008, 32000, 32, 32, gated=True, tied=False),
}


def _layer(a: Arch, i: int) -> list[tuple[str, tuple[int, ...]]]:
    d, hd = a.d_model, a.d_model // a.n_head
    kv = a.n_kv_head * hd
    p = f"layers.{i}."
    if a.gated:
        return [(p + "attn_norm.weight", (d,)), (p + "attn.q.weight", (d, d)),
                (p + "attn.k.weight", (kv, d)), (p + "attn.v.weight", (kv, d)),
                (p + "attn.o.weight", (d, d)), (p + "ffn_norm.weight", (d,)),
                (p + "ffn.gate.weight", (a.ffn, d)), (p + "ffn.up.weight", (a.ffn, d)),
                (p + "ffn.down.weight", (d, a.ffn))]
    return [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (d, a.ffn)), (p + "mlp.c_fc.bias", (a.ffn,)),
            (p + "mlp.c_proj.weight", (a.ffn, d)), (p + "mlp.c_proj.bias", (d,))]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_shapes(a: Arch, n_layer: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("embed.weight", (vocab, a.d_model))]
    for i in range(n_layer):
        out += _layer(a, i)
    out.append(("norm.weight", (a.d_model,)))
    if not a.tied:
        out.append(("lm_head.weight", (vocab, a.d_model)))
    return out


def tensor_specs(arch: str = "gpt2", target_bytes: int = 2 << 30, optimizer: bool = True,
                 max_tensor_bytes: int | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) for a checkpoint of about `target_bytes`. Layers are dropped or
    repeated to reach the size; the vocabulary is cut when the embedding alone would not fit."""
    a = ARCHS[arch]
    per_param = 2 + (12 if optimizer else 0)  # bf16 weight + fp32 master, exp_avg, exp_avg_sq
    layer_params = sum(_numel(s) for _, s in _layer(a, 0))
    vocab = a.vocab
    embed = vocab * a.d_model * (1 if a.tied else 2)
    while vocab > 1024 and (embed + layer_params) * per_param > target_bytes:
        vocab //= 2
        embed = vocab * a.d_model * (1 if a.tied else 2)
    n_layer = max(1, int((target_bytes / per_param - embed) // layer_params))
    specs = []
    for name, shape in param_shapes(a, n_layer, vocab):
        specs.append((f"model.{name}", shape, "bfloat16"))
        if optimizer:
            specs.append((f"optim.master.{name}", shape, "float32"))
            specs.append((f"optim.exp_avg.{name}", shape, "float32"))
            specs.append((f"optim.exp_avg_sq.{name}", shape, "float32"))
    specs.append(("optim.step", (), "int64"))
    return specs


def small_tensor_specs(count: int = 10_000,
                       seed: int = 0) -> list[tuple[str, tuple[int, ...], str]]:
    """Many small tensors (biases, norms, scalars: 8 B .. 64 KiB): the pattern that hurts most
    on a parallel file system."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = int(2 ** rng.uniform(1, 14))
        out.append((f"small.{i // 100}.t{i}", (n,), rng.choice(["float32", "bfloat16"])))
    return out


def sizes(specs) -> list[int]:
    return [_numel(shape) * DTYPE_BYTES[dt] for _, shape, dt in specs]


def state_dict(specs, seed: int = 0):
    """Materialise specs as torch tensors with random contents (deterministic per seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dt in specs:
        dtype = getattr(torch, dt)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
        else:
            t = torch.randint(0, 1 << 30, shape, generator=g, dtype=dtype)
        out[name] = t
    return out


def file_name(name: str) -> str:
    """One file per tensor: dotted names become a directory tree (model/layers/3/attn.q.pt)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] in ("layers", "master", "exp_avg", "exp_avg_sq"):
        head = parts[:3] if parts[1] == "layers" else parts[:2]
        return "/".join(head) + "/" + ".".join(parts[len(head):]) + ".pt"
    return name + ".pt"
