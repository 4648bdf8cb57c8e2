"""Several seeds of one recipe trained as one batched model, against the same seeds trained one
after another (today's training), in one process at one thread count.

The batched model stacks each parameter of S independently initialised copies along a new
leading axis (``torch.func.stack_module_state``) and runs them with ``torch.func.vmap`` over
``functional_call``, so every matrix product becomes a batched one over the seeds; AdamW updates
the stacked parameters elementwise, as it would each copy's. Gradient clipping is left out of
both sides (it needs a norm per seed), so the comparison is of the step's arithmetic alone. The
batched model runs its attention two ways: torch's fused kernel, which has no batching rule, so
vmap loops over the seeds there (``fused``); and attention written as batched matrix products (the
scores ``q k^T / sqrt(d)``, the causal mask, softmax, times ``v``), which vmap batches (``products``).
The report: median seconds per step of S sequential steps and of one batched step over rounds,
their ratio (sequential / batched: above 1 means batching pays), and how far the batched seeds'
losses and weights after the steps are from the same seeds trained alone.

    python benchmarks/batched_seeds.py [--recipe e1] [--seeds 3] [--steps 20] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import time

import torch
from torch.func import functional_call, stack_module_state, vmap

from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe


def setup(recipe: str, seeds: int):
    runs = [Run("unused", load_recipe(recipe, "quick", [f"train.seed={s}"])) for s in range(seeds)]
    models = []
    for s, run in enumerate(runs):
        torch.manual_seed(s)
        models.append(run.new_model().train())
    return runs, models


def batches(runs, steps: int) -> list[list]:
    """[step][seed] batches, each seed's own stream."""
    cfg = runs[0].config
    return [
        [
            run.family.sample(
                run.pool, cfg.train.batch_size, cfg.task.seq_len, run.config.train.seed, step, "train"
            ).tokens
            for run in runs
        ]
        for step in range(steps)
    ]


def token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def sequential(models, data, lr: float) -> tuple[float, list[float]]:
    """Seconds per (all seeds) step and each seed's last loss, one model after another."""
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0) for m in models]
    losses = [0.0] * len(models)
    start = time.perf_counter()
    for step in data:
        for i, (model, opt, tokens) in enumerate(zip(models, opts, step)):
            loss = token_loss(model(tokens), tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses[i] = loss.item()
    return (time.perf_counter() - start) / len(data), losses


def attention_by_products(q, k, v, is_causal: bool = True):
    """[B, H, T, d] causal attention as matrix products, a softmax and a mask (what
    ``F.scaled_dot_product_attention`` computes), so that vmap batches it over the seeds."""
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


@contextlib.contextmanager
def attention(kind: str):
    """The batched model's attention: torch's fused kernel (``fused``) or ``attention_by_products``."""
    if kind == "fused":
        yield
        return
    fused = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = attention_by_products
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = fused


def batched(models, data, lr: float) -> tuple[float, list[float], dict]:
    """Seconds per step of all seeds as one vmapped model, each seed's last loss, and the stacked parameters."""
    params, buffers = stack_module_state(models)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    base = copy.deepcopy(models[0]).to("meta")
    opt = torch.optim.AdamW(list(params.values()), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def one(p, b, tokens):
        return token_loss(functional_call(base, (p, b), (tokens,)), tokens)

    losses = None
    start = time.perf_counter()
    for step in data:
        per_seed = vmap(one)(params, buffers, torch.stack(step))
        opt.zero_grad(set_to_none=True)
        per_seed.sum().backward()  # the seeds share no parameter: each gets its own gradient
        opt.step()
        losses = per_seed.tolist()
    return (time.perf_counter() - start) / len(data), losses, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="e1")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs, _ = setup(args.recipe, args.seeds)
    data = batches(runs, args.steps)
    lr = runs[0].config.train.lr
    kinds = ("fused", "products")
    seq_times, bat_times = [], {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        _, alone = setup(args.recipe, args.seeds)
        seq_s, seq_losses = sequential(alone, data, lr)
        seq_times.append(seq_s)
        outcome = {}
        for kind in kinds:
            _, together = setup(args.recipe, args.seeds)
            with attention(kind):
                bat_s, bat_losses, params = batched(together, data, lr)
            bat_times[kind].append(bat_s)
            weight_gap = max(
                (params[name][i] - dict(m.named_parameters())[name]).abs().max().item()
                for i, m in enumerate(alone)
                for name in params
            )
            outcome[kind] = (max(abs(a - b) for a, b in zip(seq_losses, bat_losses)), weight_gap)
    seq = statistics.median(seq_times)
    print(
        f"{args.recipe} quick, {args.seeds} seeds, {args.steps} steps x {args.rounds} rounds, {args.threads} thread(s)"
    )
    print(f"  sequential (today):           {seq * 1e3:.1f} ms per step of all seeds")
    for kind in kinds:
        bat = statistics.median(bat_times[kind])
        loss_gap, weight_gap = outcome[kind]
        print(
            f"  batched, attention {kind + ':':9s} {bat * 1e3:.1f} ms per step of all seeds; ratio sequential / batched "
            f"{seq / bat:.2f}x; after {args.steps} steps, largest |loss difference| {loss_gap:.3g}, "
            f"largest |weight difference| {weight_gap:.3g}"
        )


if __name__ == "__main__":
    main()
