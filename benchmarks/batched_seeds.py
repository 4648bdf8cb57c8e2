"""Several seeds of one recipe trained as one batched model, against the same seeds trained one
after another (today's training), in one process at one thread count.

The batched model stacks each parameter of S independently initialised copies along a new
leading axis (``torch.func.stack_module_state``) and runs them with ``torch.func.vmap`` over
``functional_call``, so every matrix product becomes a batched one over the seeds; AdamW updates
the stacked parameters elementwise, as it would each copy's. Gradient clipping is left out of
both sides (it needs a norm per seed), so the comparison is of the step's arithmetic alone. The
report: median seconds per step of S sequential steps and of one batched step over rounds, their
ratio (sequential / batched: above 1 means batching pays), and how far the batched seeds' losses
and weights after the steps are from the same seeds trained alone.

    python benchmarks/batched_seeds.py [--recipe e1] [--seeds 3] [--steps 20] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
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
    seq_times, bat_times = [], []
    for _ in range(args.rounds):
        _, alone = setup(args.recipe, args.seeds)
        seq_s, seq_losses = sequential(alone, data, lr)
        _, together = setup(args.recipe, args.seeds)
        bat_s, bat_losses, params = batched(together, data, lr)
        seq_times.append(seq_s)
        bat_times.append(bat_s)
    weight_gap = max(
        (params[name][i] - dict(m.named_parameters())[name]).abs().max().item()
        for i, m in enumerate(alone)
        for name in params
    )
    seq, bat = statistics.median(seq_times), statistics.median(bat_times)
    print(
        f"{args.recipe} quick, {args.seeds} seeds, {args.steps} steps x {args.rounds} rounds, {args.threads} thread(s)"
    )
    print(f"  sequential (today): {seq * 1e3:.1f} ms per step of all seeds")
    print(f"  batched (vmap):     {bat * 1e3:.1f} ms per step of all seeds")
    print(f"  ratio sequential / batched: {seq / bat:.2f}x")
    print(
        f"  after {args.steps} steps: largest |loss difference| {max(abs(a - b) for a, b in zip(seq_losses, bat_losses)):.3g}, "
        f"largest |weight difference| {weight_gap:.3g}"
    )


if __name__ == "__main__":
    main()
