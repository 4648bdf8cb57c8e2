"""How good the OOD predictor's bank is at the recipe's sizes: the effective sample size of the
bank's posterior weights along the context, and how far the predictive and its log-loss move when
the bank grows from 2,048 to 8,192 draws. Prints the machine it ran on.

    python examples/hmm_family/bank_quality.py [--sequences 512] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch
from hmm_family.family import HMM, forward

from taskgeom.report.manifest import cpu_model
from taskgeom.settings.recipes import load_config

RECIPE = __file__.replace("bank_quality.py", "hmm.yaml")


def effective_sizes(tokens: torch.Tensor, bank: torch.Tensor, n_hidden: int) -> torch.Tensor:
    """[B, T] 1 / sum_k w_k(t)^2 of the bank's posterior weights after tokens[:, :t+1]."""
    log_weight, sizes = torch.zeros(tokens.shape[0], bank.shape[0], dtype=torch.float64), []
    for log_step, _ in forward(tokens, bank, n_hidden):
        log_weight += log_step
        sizes.append(1.0 / torch.softmax(log_weight, -1).square().sum(-1))
    return torch.stack(sizes, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = load_config(RECIPE, "quick").task
    small = HMM(**task.family_arguments())
    large = HMM(**{**task.family_arguments(), "ood_bank": 4 * task.ood_bank})
    tokens = small.sample_ood(args.sequences, task.seq_len, seed=args.seed, stream="bank-quality").tokens
    sizes = effective_sizes(tokens, small.bank, small.n_hidden).median(0).values
    p_small, p_large = small.predict_ood(tokens), large.predict_ood(tokens)
    loss = {
        name: -p[:, :-1].gather(-1, tokens[:, 1:, None]).log().mean().item()
        for name, p in (("small", p_small), ("large", p_large))
    }
    shift = (p_small - p_large).abs().sum(-1).div(2).mean(0)  # mean total variation per position
    print(
        f"machine: {cpu_model()}, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {args.sequences} prior sequences of {task.seq_len} tokens, seed {args.seed}"
    )
    print(
        "median effective bank size (M = %d) at t = 0, 15, 31, %d: %s"
        % (task.ood_bank, task.seq_len - 1, ", ".join(f"{sizes[t]:.0f}" for t in (0, 15, 31, task.seq_len - 1)))
    )
    print(
        f"M = {task.ood_bank} -> {4 * task.ood_bank}: mean total variation of the predictive at t = 8: {shift[8]:.4f}, "
        f"at t = {task.seq_len - 1}: {shift[-1]:.4f}; log-loss {loss['small']:.4f} -> {loss['large']:.4f} nats "
        f"(uniform {torch.tensor(float(task.vocab_size)).log():.4f})"
    )


if __name__ == "__main__":
    main()
