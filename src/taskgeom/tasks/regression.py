"""E2, in-context linear regression: a task is w ~ N(0, I_d); examples x ~ N(0, I_d) and
y = w.x + eps with eps ~ N(0, noise^2).

The model reads vectors. Layout ``"pair"`` (the study's figures; the default) spends two positions
on example i, x_i and y_i, and the prediction of y_i is read at x_i; layout ``"separator"`` (also in
the study's code) spends three, x_i, a separator and y_i, and reads the prediction at the separator.
Every position is a vector of width ``d + 2``: ``[x, y, flag]``, i.e. x positions ``[x_i, 0, 0]``,
separators ``[0, 0, 1]`` and y positions ``[0, y_i, -1]`` **[ours]**. The flag tells a y position
from an x position even when y is near zero.

Bayes quantities are indexed by example: entry ``i`` of a posterior or prediction is the one in
force when y_i is predicted, i.e. given examples ``0..i-1`` (and x_i, which carries no evidence
about w). Shapes: ``B`` sequences, ``n`` examples, ``d`` input width, ``K`` pool tasks.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field

from taskgeom.rng import generator
from taskgeom.settings.fields import Int, PositiveFloat, PositiveInt, TaskSettings
from taskgeom.tasks.base import Batch, TaskFamily, TaskPool, TaskProbe

Layout = Literal["separator", "pair"]
_STRIDE = {"separator": 3, "pair": 2}


class RegressionSettings(TaskSettings):
    """E2's model sequence holds ``n_examples`` examples of 2 positions (``layout: pair``) or 3
    (``layout: separator``), and ``seq_len`` is that number of positions. ``major_seed``: the majors
    are prior draws from this seed, the same in every run (the study's fixed task seed); None: from
    the run's own pool seed (the same at every diversity of one seed)."""

    pool_fields: ClassVar[frozenset[str]] = TaskSettings.pool_fields | {"n_examples"}

    d: PositiveInt = 4
    n_examples: PositiveInt = 16
    noise: PositiveFloat = Field(0.5, description="noise standard deviation")
    layout: Layout = "pair"
    major_seed: Int | None = None

    @property
    def seq_len(self) -> int:
        return self.n_examples * _STRIDE[self.layout]

    def length_setting(self) -> str:
        return (
            f"task.n_examples ({self.n_examples}) needs {self.seq_len} positions in the {self.layout!r} layout, which"
        )


class Regression(TaskFamily):
    """E2. params: [K, d] task weights; ``noise`` is the noise standard deviation."""

    name = "regression"
    Settings = RegressionSettings
    reads_tokens = False
    vector_window = (54 / 64, 1.0)  # the study's last ten examples, 54-63 of 64
    p2_window = (54 / 64, 1.0)  # the last ten of the study's evaluation examples 0-63
    m1_block, p3_block = (10, 16), (9, 16)  # the study's E2 model has 16 blocks
    # the study's regression probe (linear/analysis/interventions/_helpers.py _fit_task_subspace): x_t, no
    # logits, no position one-hot, the posterior over the majors alone, W_task centred;
    # fitted on examples 10-63 of 64
    task_probe = TaskProbe(window=(10 / 64, 1.0), logits=False, positions=False, pool_posterior=False, centred=True)
    steering_form = "subspace"
    projection_window = (0.0, 1)  # every x token but the last
    projection_block = (10, 16)
    paired_batches = True  # the study's analysis batches share their x sequences across the tasks
    centred_token_effects = False  # the token effect is a linear map of x_t
    plot_labels = (
        "dMMSE (pool posterior)",
        "ridge, lambda = noise^2",
        "mean squared error",
        "example index i (predicting y_i)",
    )

    def __init__(self, d: int, noise: float, layout: Layout, major_seed: int | None = None):
        self.d, self.noise, self.layout, self.major_seed = d, float(noise), layout, major_seed

    # ---- layout -----------------------------------------------------------------------------
    @property
    def stride(self) -> int:
        """Model positions per example."""
        return _STRIDE[self.layout]

    def n_examples(self, seq_len: int) -> int:
        """Examples in a sequence of ``seq_len`` model positions (a whole number of examples)."""
        if seq_len % self.stride:
            raise ValueError(f"a {self.layout!r} layout needs a multiple of {self.stride} positions, got {seq_len}")
        return seq_len // self.stride

    def analysed_positions(self, seq_len: int) -> torch.Tensor:
        """[n_examples] long: the x tokens, the positions whose outputs predict the ys."""
        return self.prediction_positions(self.n_examples(seq_len))

    def prediction_positions(self, n: int) -> torch.Tensor:
        """[n] long: the model position whose output predicts y_i."""
        return torch.arange(n) * self.stride + (1 if self.layout == "separator" else 0)

    def encode(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x: [B, n, d], y: [B, n] -> model input [B, stride * n, d + 2] float32."""
        B, n, d = x.shape
        slots = torch.zeros(B, n, self.stride, d + 2, dtype=torch.float32)
        slots[:, :, 0, :d] = x
        slots[:, :, -1, d] = y
        slots[:, :, -1, d + 1] = -1.0
        if self.layout == "separator":
            slots[:, :, 1, d + 1] = 1.0
        return slots.view(B, n * self.stride, d + 2)

    # ---- sampling ---------------------------------------------------------------------------
    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(n, self.d, generator=gen, dtype=torch.float64)

    def major_params(self, n_major: int, gen: torch.Generator) -> torch.Tensor:
        """[n_major, d] prior draws: from ``major_seed`` when it is set, else from ``gen`` (the run's pool generator)."""
        return self.sample_params(n_major, gen if self.major_seed is None else generator(self.major_seed, 0, "majors"))

    def make_batch(self, params: torch.Tensor, task: torch.Tensor, seq_len: int, gen: torch.Generator) -> Batch:
        x = torch.randn(params.shape[0], self.n_examples(seq_len), self.d, generator=gen, dtype=torch.float64)
        return self._labelled(x, params, task, gen)

    def _labelled(self, x: torch.Tensor, params: torch.Tensor, task: torch.Tensor, gen: torch.Generator) -> Batch:
        """The batch of examples x: [B, n, d] labelled by the tasks params: [B, d] (fresh noise)."""
        y = torch.einsum("bnd,bd->bn", x, params.double()) + self.noise * torch.randn(
            *x.shape[:2], generator=gen, dtype=torch.float64
        )
        return Batch(self.encode(x, y), task, params, x, y)

    def sample_paired(
        self, pool: TaskPool, batch_size: int, seq_len: int, seed: int = 0, step: int = 0, stream: str = "paired"
    ) -> Batch:
        """A paired design: ``batch_size // K`` x sequences, each labelled once by every pool task
        (rows ``k * m .. (k + 1) * m - 1`` are task k), with independent noise; [K * m] sequences."""
        K = pool.size
        m = batch_size // K
        if m < 1:
            raise ValueError(
                f"a paired batch needs at least one sequence per task: batch_size {batch_size} < {K} tasks"
            )
        gen = generator(seed, step, f"{stream}/paired")
        x = torch.randn(m, self.n_examples(seq_len), self.d, generator=gen, dtype=torch.float64).repeat(K, 1, 1)
        task = torch.arange(K).repeat_interleave(m)
        return self._labelled(x, pool.params[task].double(), task, gen)

    # ---- the model's side -------------------------------------------------------------------
    def model_io(self) -> dict[str, int]:
        return {"d_in": self.d + 2, "n_out": 1}

    def model_predictions(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T, d + 2] -> [B, T / stride] the model's prediction of each y_i."""
        out = model(tokens)[..., 0]  # [B, T]
        return out[:, self.prediction_positions(self.n_examples(tokens.shape[1]))]

    def training_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Mean squared error of the predictions of y."""
        return torch.nn.functional.mse_loss(self.model_predictions(model, batch.tokens), batch.y.float())

    def position_losses(
        self, model: torch.nn.Module, batch: Batch, bayes_id: torch.Tensor, bayes_ood: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each [B, n], squared errors of the predictions of y_i (``loss``: model, ``bayes_id_loss``:
        dMMSE, ``bayes_ood_loss``: ridge), ``excess`` and ``sq_gap_bayes_model`` = (model - dMMSE)^2."""
        pred = self.model_predictions(model, batch.tokens).double()
        rows = {
            "loss": (pred - batch.y) ** 2,
            "bayes_id_loss": (bayes_id - batch.y) ** 2,
            "bayes_ood_loss": (bayes_ood - batch.y) ** 2,
            "sq_gap_bayes_model": (pred - bayes_id) ** 2,
        }
        rows["excess"] = rows["loss"] - rows["bayes_id_loss"]
        return rows

    # ---- exact Bayes ------------------------------------------------------------------------
    def log_likelihood(self, x: torch.Tensor, y: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """[B, n, K] log N(y_i; w_k . x_i, noise^2); x: [B, n, d], y: [B, n], params: [K, d]."""
        resid = y.double()[..., None] - x.double() @ params.double().T
        return -0.5 * (resid / self.noise) ** 2 - 0.5 * math.log(2 * math.pi * self.noise**2)

    def posterior_by_count(self, batch: Batch, pool: TaskPool) -> torch.Tensor:
        """[B, n + 1, K] log posterior over the pool after the first j examples, j = 0..n."""
        loglik = self.log_likelihood(batch.x, batch.y, pool.params).cumsum(dim=1)
        loglik = torch.cat([torch.zeros_like(loglik[:, :1]), loglik], dim=1)
        return torch.log_softmax(loglik + pool.weights.double().log(), dim=-1)

    def log_posterior(self, batch: Batch, pool: TaskPool) -> torch.Tensor:
        """[B, n, K] log posterior over the pool given examples 0..i-1 (entry 0 is the prior)."""
        return self.posterior_by_count(batch, pool)[:, :-1]

    def mix_prediction(self, x: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[B, n] prediction of y_i by the mixture of tasks: sum_k weights[b, i, k] w_k . x_i.

        x: [B, n, d]; params: [K, d]; weights: [B, n, K] (any real weights, e.g. a posterior or a
        steering target on the simplex)."""
        return ((weights.double() @ params.double()) * x.double()).sum(-1)

    def predict_id(self, batch: Batch, pool: TaskPool) -> torch.Tensor:
        """[B, n] dMMSE: the posterior-mean task over the pool applied to x_i."""
        return self.mix_prediction(batch.x, pool.params, self.log_posterior(batch, pool).exp())

    def ridge_weights(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[B, n, d] ridge solution with lambda = noise^2 on examples 0..i-1 (zero at i = 0): the
        posterior mean of w under the N(0, I) prior. One batched solve over [B, n, d, d]."""
        x, y = x.double(), y.double()
        outer = (x[..., :, None] * x[..., None, :]).cumsum(dim=1)  # [B, n, d, d], examples 0..i
        xty = (x * y[..., None]).cumsum(dim=1)  # [B, n, d]
        gram = torch.cat([torch.zeros_like(outer[:, :1]), outer[:, :-1]], dim=1)
        rhs = torch.cat([torch.zeros_like(xty[:, :1]), xty[:, :-1]], dim=1)
        eye = torch.eye(self.d, dtype=torch.float64)
        return torch.linalg.solve(gram + self.noise**2 * eye, rhs)

    def ood_estimate(self, batch: Batch) -> torch.Tensor:
        """[B, n, d] the ridge weights in force when y_i is predicted (``ridge_weights``)."""
        return self.ridge_weights(batch.x, batch.y)

    def context_statistic(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The prediction positions, with the ridge prediction x_i . w_ridge (examples < i)."""
        return self.prediction_positions(batch.x.shape[1]), self.predict_ood(batch)[..., None]

    def predict_ood(self, batch: Batch) -> torch.Tensor:
        """[B, n] ridge prediction w_ridge(examples < i) . x_i, the OOD-optimal predictor."""
        return (self.ridge_weights(batch.x, batch.y) * batch.x).sum(-1)

    def reference_predictions(self, batch: Batch, pool: TaskPool) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, n], [B, n]) dMMSE and ridge predictions of y."""
        return self.predict_id(batch, pool), self.predict_ood(batch)
