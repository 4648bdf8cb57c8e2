"""Training throughput of taskgeom's transformer against a Hugging Face GPT-2 of the same size.

Both models (random init, no download) train on the same E1 batches with the same AdamW settings
in one process; rounds alternate between them and the median tokens/s of each is reported with
the ratio ours / GPT-2. Also: the samplers' tokens/s against the trainer's consumption.

    python benchmarks/train_throughput.py [--steps 40] [--rounds 5] [--threads 2]

Needs the optional extra: pip install -e ".[hf]".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from taskgeom import tasks
from taskgeom.recipes import load_recipe
from taskgeom.runs import Run


def hf_gpt2(cfg, vocab_size: int) -> torch.nn.Module:
    """A stock GPT2LMHeadModel of ``cfg``'s sizes (the config taskgeom's ``model.arch: gpt2`` uses)."""
    from transformers import GPT2LMHeadModel

    from taskgeom.hf import hf_config

    return GPT2LMHeadModel(hf_config(cfg.model_copy(update={"arch": "gpt2"}), vocab_size))


def hf_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    tokens = batch.tokens
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tokens_per_second(model, loss_fn, batches: list) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=4e-4)
    start = time.perf_counter()
    for tokens in batches:
        loss = loss_fn(model, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return sum(b.tokens.numel() for b in batches) / (time.perf_counter() - start)


def sampler_rate(recipe: str, steps: int) -> tuple[float, int, int]:
    run = Run("unused", load_recipe(recipe))
    cfg = run.config
    start = time.perf_counter()
    for step in range(steps):
        run.family.sample(run.pool, cfg.train.batch_size, cfg.task.seq_len, 0, step)
    return steps * cfg.train.batch_size * cfg.task.seq_len / (time.perf_counter() - start), cfg.train.batch_size, cfg.task.seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="e1")
    parser.add_argument("--steps", type=int, default=40, help="training steps per round and model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    run = Run("unused", load_recipe(args.recipe))
    cfg = run.config
    batches = [run.family.sample(run.pool, cfg.train.batch_size, cfg.task.seq_len, 0, s) for s in range(args.steps)]
    ours_loss = run.family.training_loss
    ours, theirs = run.new_model(), hf_gpt2(cfg.model, run.family.vocab_size)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(f"model: {cfg.model.n_layers} layers, width {cfg.model.d_model}, batch {cfg.train.batch_size} x {cfg.task.seq_len} tokens, "
          f"{args.threads} threads; parameters ours {count(ours):,}, GPT-2 {count(theirs):,}")
    tokens_per_second(ours, ours_loss, batches[:3]), tokens_per_second(theirs, hf_loss, batches[:3])  # warm-up
    rates = {"ours": [], "gpt2": []}
    for _ in range(args.rounds):
        rates["ours"].append(tokens_per_second(ours, ours_loss, batches))
        rates["gpt2"].append(tokens_per_second(theirs, hf_loss, batches))
    ours_rate, gpt2_rate = statistics.median(rates["ours"]), statistics.median(rates["gpt2"])
    print(f"training tokens/s (median of {args.rounds} rounds): ours {ours_rate:,.0f}   HF GPT-2 {gpt2_rate:,.0f}   ratio ours/GPT-2 {ours_rate / gpt2_rate:.2f}")
    for recipe in ("e1", "e3"):
        rate, batch, seq = sampler_rate(recipe, 200)
        print(f"sampler {recipe}: {rate:,.0f} tokens/s for batches of {batch} x {seq}; "
              f"ratio to the trainer's consumption ({ours_rate:,.0f} tokens/s): {rate / ours_rate:.1f}")


if __name__ == "__main__":
    main()
