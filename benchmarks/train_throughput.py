"""Training throughput of taskgeom's transformer against a Hugging Face GPT-2 of the same size.

Both models (random init, no download) train on the same E1 batches with the same AdamW settings
in one process; rounds alternate between them and the median tokens/s of each is reported with
the ratio ours / GPT-2. Each round also times torch's float32 matrix multiply (n = 1024) at the
same thread count, and the step's FLOP rate (its matrix multiplies, counted analytically) is
reported as a share of that rate, the median over rounds. Also: the samplers' tokens/s against the
trainer's consumption.

    python benchmarks/train_throughput.py [--steps 40] [--rounds 5] [--threads 1 2]

Needs the optional extra: pip install -e ".[hf]".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe


def hf_gpt2(cfg, vocab_size: int) -> torch.nn.Module:
    """A stock GPT2LMHeadModel of ``cfg``'s sizes (the config taskgeom's ``model.arch: gpt2`` uses)."""
    from transformers import GPT2LMHeadModel

    from taskgeom.models.hf import hf_config

    return GPT2LMHeadModel(hf_config(cfg.model_copy(update={"arch": "gpt2"}), vocab_size))


def hf_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    tokens = batch.tokens
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def step_flops(cfg, n_out: int) -> float:
    """Matrix-multiply FLOPs of one training step of ``cfg``'s token model on [batch_size, seq_len]
    tokens: the forward pass's (2 per multiply-add) times 3, as the backward pass multiplies by each
    factor of every product once. Attention counts its causal half (position t scores and mixes
    t + 1 keys); the embedding lookup, norms and elementwise work count nothing."""
    m, batch, seq = cfg.model, cfg.train.batch_size, cfg.task.seq_len
    weights = (
        2 * m.d_model * (3 * m.d_model + m.d_model + 2 * m.d_mlp)
    )  # per token and layer: qkv, proj, MLP in and out
    attention = 2 * 2 * m.d_model * (seq + 1) / 2  # per token and layer: scores and mix, averaged over positions
    return 3 * batch * seq * (m.n_layers * (weights + attention) + 2 * m.d_model * n_out)


def matmul_rate(n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of torch's float32 [n, n] @ [n, n] at the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return repeats * 2 * n**3 / (time.perf_counter() - start)


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
    return (
        steps * cfg.train.batch_size * cfg.task.seq_len / (time.perf_counter() - start),
        cfg.train.batch_size,
        cfg.task.seq_len,
    )


def compare(run: Run, batches: list, threads: int, rounds: int) -> float:
    """Print ours against GPT-2 at ``threads`` threads, with the FLOP shares; returns our median tokens/s."""
    torch.set_num_threads(threads)
    cfg = run.config
    ours, theirs = run.new_model(), hf_gpt2(cfg.model, run.family.vocab_size)
    (
        tokens_per_second(ours, run.family.training_loss, batches[:3]),
        tokens_per_second(theirs, hf_loss, batches[:3]),
    )  # warm-up
    rates = {"ours": [], "gpt2": [], "matmul": []}
    for _ in range(rounds):
        rates["matmul"].append(matmul_rate())
        rates["ours"].append(tokens_per_second(ours, run.family.training_loss, batches))
        rates["gpt2"].append(tokens_per_second(theirs, hf_loss, batches))
    flops_per_token = step_flops(cfg, run.family.vocab_size) / (cfg.train.batch_size * cfg.task.seq_len)
    share = {
        name: statistics.median(r * flops_per_token / m for r, m in zip(rates[name], rates["matmul"]))
        for name in ("ours", "gpt2")
    }
    ours_rate, gpt2_rate = statistics.median(rates["ours"]), statistics.median(rates["gpt2"])
    print(
        f"{threads} thread(s), median of {rounds} rounds: matmul (n=1024) {statistics.median(rates['matmul']) / 1e9:.0f} GFLOP/s; "
        f"training tokens/s ours {ours_rate:,.0f} ({ours_rate * flops_per_token / 1e9:.0f} GFLOP/s, {share['ours']:.0%} of matmul)   "
        f"HF GPT-2 {gpt2_rate:,.0f} ({share['gpt2']:.0%})   ratio ours/GPT-2 {ours_rate / gpt2_rate:.2f}"
    )
    return ours_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="e1")
    parser.add_argument("--steps", type=int, default=40, help="training steps per round and model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to compare at, in turn")
    args = parser.parse_args()

    run = Run("unused", load_recipe(args.recipe))
    cfg = run.config
    batches = [run.family.sample(run.pool, cfg.train.batch_size, cfg.task.seq_len, 0, s) for s in range(args.steps)]
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(
        f"model: {cfg.model.n_layers} layers, width {cfg.model.d_model}, batch {cfg.train.batch_size} x {cfg.task.seq_len} tokens; "
        f"parameters ours {count(run.new_model()):,}, GPT-2 {count(hf_gpt2(cfg.model, run.family.vocab_size)):,}; "
        f"{step_flops(cfg, run.family.vocab_size) / 1e9:.2f} GFLOP of matrix multiplies per step"
    )
    ours_rate = min(compare(run, batches, threads, args.rounds) for threads in args.threads)
    for recipe in ("e1", "e3"):
        rate, batch, seq = sampler_rate(recipe, 200)
        print(
            f"sampler {recipe}: {rate:,.0f} tokens/s for batches of {batch} x {seq} (at {torch.get_num_threads()} thread(s)); "
            f"ratio to the trainer's slowest consumption ({ours_rate:,.0f} tokens/s): {rate / ours_rate:.1f}"
        )


if __name__ == "__main__":
    main()
