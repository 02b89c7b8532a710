"""Train a small MoE transformer block with ``omniep.layers.torch.MoE`` on gloo ranks (CPU is fine).

The task: sequences of random tokens; the target at position t is ``(3 · token[t-1] + 1) mod V`` — the
model has to attend to the previous position and map it, which one block learns in a few hundred steps.
Model: token + position embedding → causal self-attention → MoE (expert parallel over the ranks) → head, each
sub-block pre-normed and residual. Every rank trains on its own batches (data parallel); the replicated
weights' gradients are averaged over the ranks, the experts' are their own (already summed over every
rank's tokens by the dispatch's backward: scaled by 1/R for the mean loss). Nothing here names a
backend; the losses are bitwise the same on every backend, because dispatch and combine are.

    python -m omniep.examples.train_moe [--ranks 2] [--steps 300] [--backends collective] [--plot loss.png]
"""

from __future__ import annotations

import argparse
import sys
import time

VOCAB, SEQ, BATCH = 16, 12, 8


def _model(torch, layers_torch, config, seed: int, backend):
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)  # the replicated weights: the same on every rank
            H = config.hidden
            self.embed, self.position = nn.Embedding(VOCAB, H), nn.Embedding(SEQ, H)
            self.norm1, self.norm2, self.norm3 = nn.RMSNorm(H), nn.RMSNorm(H), nn.RMSNorm(H)
            self.qkv, self.proj = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H, bias=False)
            self.head = nn.Linear(H, VOCAB, bias=False)
            self.moe = layers_torch.MoE(config, seed=seed, backend=backend)

        def forward(self, tokens):
            B, S = tokens.shape
            h = self.embed(tokens) + self.position.weight[:S]
            q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
            h = h + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            moe_out, aux = self.moe(self.norm2(h).reshape(B * S, -1))
            h = h + moe_out.view(B, S, -1)
            return self.head(self.norm3(h)), aux

    return Block()


def _batch(torch, gen):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = (3 * torch.roll(tokens, 1, dims=1) + 1) % VOCAB
    return tokens, target[:, 1:]  # position 0 has no previous token


def train_rank(rank: int, world: int, port: int, backend, steps: int, seed: int = 0) -> list:
    """One rank's training run; returns the mean loss over the ranks at every step (the same on every rank)."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..layers import MoEConfig
    from ..layers import torch as layers_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        config = MoEConfig(hidden=32, ffn=32, num_experts=8, top_k=2, aux_loss_coef=0.01, z_loss_coef=1e-4,
                           capacity_factor=1.5, shared_ffn=16)
        model = _model(torch, layers_torch, config, seed, backend)
        experts = {id(model.moe.w_gate_up), id(model.moe.w_down)}
        replicated = [p for p in model.parameters() if id(p) not in experts]
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1000 * seed + rank)  # each rank its own data
        losses = []
        for _ in range(steps):
            tokens, target = _batch(torch, gen)
            logits, aux = model(tokens)
            loss = F.cross_entropy(logits[:, 1:].reshape(-1, VOCAB), target.reshape(-1))
            opt.zero_grad(set_to_none=False)
            (loss + aux).backward()
            # One all-reduce for every replicated gradient and the loss; experts: mean over ranks' losses.
            flat = torch.cat([p.grad.flatten() for p in replicated] + [loss.detach().view(1)])
            dist.all_reduce(flat)
            flat /= world
            at = 0
            for p in replicated:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()
            for p in (model.moe.w_gate_up, model.moe.w_down):
                p.grad /= world
            opt.step()
            losses.append(float(flat[-1]))
        return losses
    finally:
        dist.destroy_process_group()


def train(ranks: int = 2, steps: int = 300, backend=None, seed: int = 0, report_every: int = 0) -> list:
    """Mean loss per step of a run on ``ranks`` local gloo processes (printed every ``report_every``)."""
    from ..testing.procs import run_ranks

    results = run_ranks(train_rank, ranks, args=(backend, steps, seed), timeout=600)
    losses = results[0]
    if any(r != losses for r in results[1:]):
        raise AssertionError("the ranks disagree on the mean loss")
    if report_every:
        for i in range(0, steps, report_every):
            print(f"  step {i:4d}  loss {losses[i]:.4f}", flush=True)
        print(f"  step {steps - 1:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def plot(curves: dict, path: str) -> bool:
    """Loss curves (label -> losses) into a PNG; False when matplotlib (the ``bench`` extra) is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, losses in curves.items():
        ax.plot(losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (mean over ranks)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_cli(train_fn, where: str, argv=None, doc: str = __doc__) -> int:
    """The examples' command line: ``train_fn(n, steps, backend, report_every=...)`` once per backend of
    ``--backends``, the curves compared bit for bit and plotted; exit 0 if they agree and the loss fell.
    ``where`` names what ``--ranks`` counts (gloo ranks, XLA devices)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help=f"how many {where}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--backends", default="", help="comma-separated; default: OMNIEP_BACKEND or auto-selection")
    p.add_argument("--plot", default="", help="write the loss curves to this PNG")
    a = p.parse_args(argv)
    curves = {}
    for backend in a.backends.split(",") if a.backends else [None]:
        start = time.perf_counter()
        print(f"training on {a.ranks} {where}, backend {backend or 'auto'}:", flush=True)
        curves[backend or "auto"] = train_fn(a.ranks, a.steps, backend, report_every=max(1, a.steps // 6))
        print(f"  {time.perf_counter() - start:.1f} s", flush=True)
    first = next(iter(curves.values()))
    same = all(c == first for c in curves.values())
    if len(curves) > 1:
        print("losses bitwise identical across backends" if same else "LOSSES DIFFER ACROSS BACKENDS")
    if a.plot and plot(curves, a.plot):
        print(f"plot: {a.plot}")
    return 0 if same and first[-1] < first[0] else 1


def main(argv=None) -> int:
    return run_cli(train, "gloo ranks", argv)


if __name__ == "__main__":
    sys.exit(main())
