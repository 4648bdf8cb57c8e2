"""Training throughput on a device and precision against this package on the CPU in fp32.

Runs the trainer's own step (``train.train_step``: batch made on the CPU, copied to the device,
forward under the chosen precision, AdamW) on the same batches for the CPU fp32 baseline and for
each precision on ``--device``, in one process, and reports tokens/s and the ratio to the
baseline. The default is the paper profile of E1 (6 layers, width 128, 64 x 128 tokens a step).

    python benchmarks/device_throughput.py [--device auto] [--recipe e1] [--profile paper] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from taskgeom.runs.folders import Run
from taskgeom.settings.devices import resolve_device
from taskgeom.settings.recipes import load_recipe
from taskgeom.training.train import make_optimizer, train_step


def tokens_per_second(run: Run, batches: list, where: torch.device, precision: str, warmup: int = 3) -> float:
    """Tokens/s of the trainer's step over ``batches`` after ``warmup`` untimed steps (CUDA synchronised)."""
    cfg = run.config.train
    model = run.new_model().to(where).train()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    for batch in batches[:warmup]:
        train_step(model, opt, run.family, batch, where, precision, cfg.grad_clip)
    if where.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches[warmup:]:
        train_step(model, opt, run.family, batch, where, precision, cfg.grad_clip)
    if where.type == "cuda":
        torch.cuda.synchronize()
    return sum(b.tokens.numel() for b in batches[warmup:]) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--recipe", default="e1")
    parser.add_argument("--profile", default="paper")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (after 3 warm-up steps)")
    parser.add_argument(
        "--cpu-steps", type=int, default=None, help="timed steps of the CPU baseline (default: --steps)"
    )
    args = parser.parse_args()

    where = resolve_device(args.device)
    run = Run("unused", load_recipe(args.recipe, args.profile))
    cfg = run.config
    steps = max(args.steps, args.cpu_steps or 0) + 3
    batches = [
        run.family.sample(run.pool, cfg.train.batch_size, cfg.task.seq_len, cfg.train.seed, s) for s in range(steps)
    ]
    print(
        f"{args.recipe} {args.profile}: {cfg.model.n_layers} layers, width {cfg.model.d_model}, batch {cfg.train.batch_size} x "
        f"{cfg.task.seq_len} tokens; device {where}"
        + (f" ({torch.cuda.get_device_name(where)})" if where.type == "cuda" else "")
    )
    baseline = tokens_per_second(run, batches[: (args.cpu_steps or args.steps) + 3], torch.device("cpu"), "fp32")
    print(f"  baseline cpu fp32: {baseline:,.0f} tokens/s ({torch.get_num_threads()} threads)")
    for precision in ("fp32", "bf16"):
        rate = tokens_per_second(run, batches[: args.steps + 3], where, precision)
        print(f"  {where} {precision}: {rate:,.0f} tokens/s, ratio to baseline {rate / baseline:.2f}")


if __name__ == "__main__":
    main()
