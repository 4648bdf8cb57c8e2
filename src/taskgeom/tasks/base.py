"""The shared protocol of latent-task sequence families.

A family has a prior over tasks, a sampler of sequences given a task, and exact Bayesian
quantities over any finite task pool. ``TaskFamily`` holds what every family shares (pools,
seeded sampling, the model's input/output sizes, the training loss and evaluation losses);
``TokenFamily`` is the next-token case. Shapes: ``B`` sequences, ``T`` positions, ``K`` pool tasks,
``V`` tokens. For token families everything at position ``t`` conditions on ``tokens[:, :t+1]``; a
predictive at ``t`` is the distribution of ``tokens[:, t+1]``. Bayes computations run in float64.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from taskgeom.errors import AnalysisError
from taskgeom.rng import generator
from taskgeom.settings.devices import to_device
from taskgeom.settings.fields import TaskSettings

Subset = Literal["all", "major", "minor"]


@dataclass(frozen=True)
class TaskPool:
    """A finite pool of training tasks: ``n_major`` majors first, then the minors.

    params: [K, ...] task parameters; weights: [K] prior over the pool (sums to one).
    """

    params: torch.Tensor
    weights: torch.Tensor
    n_major: int

    @property
    def size(self) -> int:
        return self.params.shape[0]

    @property
    def n_minor(self) -> int:
        return self.size - self.n_major

    def subset(self, which: Subset) -> "TaskPool":
        """The majors or minors alone, with their prior renormalised."""
        if which == "all":
            return self
        index = slice(0, self.n_major) if which == "major" else slice(self.n_major, None)
        weights = self.weights[index]
        return TaskPool(self.params[index], weights / weights.sum(), self.n_major if which == "major" else 0)


@dataclass(frozen=True)
class Batch:
    """tokens: the model's input, [B, T] long for token families, [B, T, d_in] float for vector
    families; task: [B] long index into the pool (-1 for OOD); params: [B, ...]. Vector families
    also carry their examples: x: [B, n, d] and y: [B, n] float64."""

    tokens: torch.Tensor
    task: torch.Tensor
    params: torch.Tensor
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> "Batch":
        """The sequences ``index``: [n] of this batch, as a batch."""
        return replace(
            self, **{f.name: getattr(self, f.name)[index] for f in fields(self) if getattr(self, f.name) is not None}
        )

    def to(self, device: torch.device) -> "Batch":
        """The same batch with every tensor on ``device`` (through pinned memory for CUDA)."""
        return replace(
            self,
            **{
                f.name: to_device(getattr(self, f.name), device)
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )


def pool_weights(n_major: int, n_minor: int, p_minor: float) -> torch.Tensor:
    """[n_major + n_minor] prior: (1 - p_minor)/K per major and p_minor/N per minor."""
    if n_major < 1:
        raise ValueError(f"n_major must be >= 1, got {n_major}")
    if n_minor < 0:
        raise ValueError(f"n_minor must be >= 0, got {n_minor}")
    if not 0.0 <= p_minor < 1.0:
        raise ValueError(f"p_minor must lie in [0, 1), got {p_minor}")
    if n_minor == 0:
        return torch.full((n_major,), 1.0 / n_major, dtype=torch.float64)
    major = torch.full((n_major,), (1.0 - p_minor) / n_major, dtype=torch.float64)
    minor = torch.full((n_minor,), p_minor / n_minor, dtype=torch.float64)
    return torch.cat([major, minor])


def n_minor_for_diversity(k: int) -> int:
    """The study's diversity index: N_minor = 2**k, and k = -1 means majors only."""
    if k < -1:
        raise ValueError(f"diversity k must be >= -1, got {k}")
    return 0 if k == -1 else 2**k


@dataclass(frozen=True)
class TaskProbe:
    """What a family's probe regresses on (``TaskFamily.task_probe``; the fit is ``analysis.measures.task_probe``):
    ``window``: the fit positions as fractions [start, stop) of the analysed positions; ``logits``:
    the model's own logits as a nuisance block; ``positions``: the position one-hot; ``pool_posterior``:
    ``pi`` is the posterior over the whole training pool restricted to the majors (else over the
    majors alone); ``sequence_posterior``: ``pi`` after the whole sequence at every position
    (the study's dice probe), else after position t; ``centred``: the rows of ``W_task`` are
    centred over the tasks before the SVD; ``every_pool_task``: ``pi`` keeps a column for every
    task of the pool, minors too (the study's E1 search probe), not the majors' alone."""

    window: tuple[float, float]
    logits: bool
    positions: bool
    pool_posterior: bool = True
    sequence_posterior: bool = False
    centred: bool = False
    every_pool_task: bool = False


class TaskFamily(ABC):
    """What every latent-task family shares: pools, seeded sampling, and the dispatch points the
    trainer and evaluator use (model sizes, training loss, evaluation losses).

    A family is registered (``tasks.registry``) under ``name``, the ``family:`` value of a recipe;
    ``Settings`` is the model of its ``task`` section (a ``TaskSettings`` subclass whose own fields
    are the constructor's keyword arguments, with their defaults)."""

    name: ClassVar[str]
    Settings: ClassVar[type[TaskSettings]]
    reads_tokens: ClassVar[bool] = True  # False: the model reads vectors (``Batch.tokens`` is float)
    # True: the orthogonal search also keeps V out of the token directions (docs/protocol.md: E3)
    v_avoids_tokens: ClassVar[bool] = False
    # how figures name the evaluation metrics: (ID-Bayes, OOD-optimal, loss unit, position axis)
    plot_labels = (
        "ID-Bayes (pool posterior)",
        "OOD-optimal (continuous prior)",
        "loss (nats / token)",
        "context position t",
    )
    # docs/protocol.md, the M1 protocol: the late window of the task vectors as fractions [start, stop)
    # of the analysed positions (the study's own window for its families; else the last quarter), and the
    # study block (block, of blocks) where the M1 claims read the states, and P3
    vector_window: ClassVar[tuple[float, float]] = (0.75, 1.0)
    # docs/protocol.md, "P2": the positions whose r2_additive the P2 claims average (the study's last ten
    # evaluation positions, as fractions), and whether the states pass the next block's LayerNorm first
    p2_window: ClassVar[tuple[float, float]] = (0.875, 1.0)
    p2_post_layernorm: ClassVar[bool] = False
    m1_block: ClassVar[tuple[int, int]] = (3, 6)
    p3_block: ClassVar[tuple[int, int]] = (3, 6)
    # docs/protocol.md, "S ablation": what the study's probe of this family regresses on (None: the
    # family declares none, and the ablations' task subspace cannot be fitted for it)
    task_probe: ClassVar[TaskProbe | None] = None
    # docs/protocol.md, "The V search": the probe whose span the study's orthogonal search avoids where it
    # fits one of its own (protocol ``v_span="search-probe"``); None: the ablations' probe above
    search_probe: ClassVar[TaskProbe | None] = None
    # docs/protocol.md, "Shares of in-context gain": the first prediction the losses L of the ablations
    # average (the study's latent-Markov code: 1, every prediction after the first; E2's linear code
    # unread, kept there; E1's coin code: 0)
    loss_from: ClassVar[int] = 1
    # docs/protocol.md, "Steering": the study's edit, "task" (swap per-position task vectors, E1) or
    # "subspace" (replace the component in the task subspace, E2 and E3); None: steering needs one
    steering_form: ClassVar[Literal["task", "subspace"] | None] = None
    # docs/protocol.md, "Projection R^2": the block of analysed positions Fig. 4 averages over, as (its
    # start as a fraction of the analysed positions, positions left out at the end); None: declare one
    projection_window: ClassVar[tuple[float, int] | None] = None
    # ... and the study block (block, of blocks) where its claims read it
    projection_block: ClassVar[tuple[int, int]] = (4, 6)
    # the analysis batches give every major task the same inputs (a paired design: ``sample_paired``, E2)
    paired_batches: ClassVar[bool] = False
    # the token subspace the orthogonal search avoids is centred over tokens (False: E2's linear map of x_t)
    centred_token_effects: ClassVar[bool] = True

    @classmethod
    def declared(cls, name: str):
        """The family's declaration ``name`` (a class attribute above); AnalysisError naming it and the
        family when the family declares none."""
        value = getattr(cls, name)
        if value is None:
            raise AnalysisError(
                f"the {cls.name!r} family declares no {name} (TaskFamily.{name}, docs/adding-a-family.md): "
                "set it on the family class"
            )
        return value

    def analysed_positions(self, seq_len: int) -> slice | torch.Tensor:
        """The model positions the analyses read and edit, of a sequence of ``seq_len`` positions: all of
        them (E2: its x tokens, ``Regression.prediction_positions``)."""
        return slice(None)

    # ---- family-specific pieces -------------------------------------------------------------
    @abstractmethod
    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, ...] tasks drawn from the continuous prior."""

    @abstractmethod
    def make_batch(self, params: torch.Tensor, task: torch.Tensor, seq_len: int, gen: torch.Generator) -> Batch:
        """A Batch of ``seq_len`` model positions per sequence, one sequence per task in params: [B, ...]."""

    @abstractmethod
    def model_io(self) -> dict[str, int]:
        """Keyword sizes for ``Transformer`` (``vocab_size`` for tokens; ``d_in`` and ``n_out`` for vectors)."""

    @abstractmethod
    def reference_predictions(self, batch: Batch, pool: TaskPool) -> tuple[torch.Tensor, torch.Tensor]:
        """(ID-Bayes, OOD-optimal) predictions for the batch, float64."""

    @abstractmethod
    def training_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar loss the trainer minimises."""

    @abstractmethod
    def position_losses(
        self, model: torch.nn.Module, batch: Batch, bayes_id: torch.Tensor, bayes_ood: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-sequence, per-prediction losses {metric: [B, P]}: ``loss`` (model), ``bayes_id_loss``,
        ``bayes_ood_loss``, ``excess`` (model minus ID-Bayes) and one family-specific gap."""

    @abstractmethod
    def context_statistic(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [P] long, target [B, P, m]): the statistic the OOD-optimal learner computes
        from the context at those model positions (what probes of the OOD subspace read)."""

    def ood_estimate(self, batch: Batch) -> torch.Tensor:
        """[B, P, m] the OOD-optimal learner's own estimate of the task at the P analysed positions
        (E1: the posterior-mean face probabilities; E3: the posterior-mean transition matrix,
        flattened; E2: the ridge weights): what the linear-code reference of projection R^2 reads
        (docs/protocol.md). A family without one raises NotImplementedError; the reference is
        then not available and says so."""
        raise NotImplementedError(
            f"the {self.name!r} family does not define ood_estimate (the OOD-optimal learner's estimate of the task)"
        )

    def major_params(self, n_major: int, gen: torch.Generator) -> torch.Tensor:
        """[n_major, ...] major tasks; by default draws from the prior."""
        return self.sample_params(n_major, gen)

    @classmethod
    def from_settings(cls, settings: TaskSettings) -> "TaskFamily":
        """The family a validated ``task`` section describes: its own settings as keyword arguments."""
        return cls(**settings.family_arguments())

    def io_widths(self) -> tuple[int, int]:
        """(input width, output width) of the model: the vocabulary twice for tokens, else
        ``model_io``'s ``d_in`` and ``n_out``."""
        io = self.model_io()
        return (io["vocab_size"], io["vocab_size"]) if "vocab_size" in io else (io["d_in"], io["n_out"])

    def bayes_memory(self, seq_len: int, pool_size: int) -> int:
        """Bytes the exact Bayes quantities over a pool of ``pool_size`` tasks keep for one sequence of
        ``seq_len`` positions (float64): by default log-likelihoods, their cumulative sum and the
        posterior, one number each per task and position. A family with more state per task (hidden
        states, a bank of prior draws) counts it here; the memory checks read it."""
        return 3 * 8 * seq_len * pool_size

    # ---- shared machinery -------------------------------------------------------------------
    def sample_pool(self, n_major: int, n_minor: int, p_minor: float = 0.1, seed: int = 0) -> TaskPool:
        """K majors then N minors (minors from the prior), with the study's mixture weights."""
        weights = pool_weights(n_major, n_minor, p_minor)
        gen = generator(seed, 0, "pool")
        majors = self.major_params(n_major, gen)
        params = torch.cat([majors, self.sample_params(n_minor, gen)]) if n_minor else majors
        return TaskPool(params, weights, n_major)

    def sample(
        self,
        pool: TaskPool,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        step: int = 0,
        stream: str = "train",
        subset: Subset = "all",
    ) -> Batch:
        """Sequences whose tasks are drawn from the pool prior (or uniformly within a subset)."""
        _check_sizes(batch_size, seq_len)
        gen = generator(seed, step, f"{stream}/{subset}")
        if subset == "all":
            task = torch.multinomial(pool.weights, batch_size, replacement=True, generator=gen)
        else:
            low, high = (0, pool.n_major) if subset == "major" else (pool.n_major, pool.size)
            if high <= low:
                raise ValueError(f"the pool has no {subset} tasks")
            task = torch.randint(low, high, (batch_size,), generator=gen)
        return self.make_batch(pool.params[task], task, seq_len, gen)

    def sample_ood(
        self,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        step: int = 0,
        stream: str = "ood",
        n_tasks: int | None = None,
    ) -> Batch:
        """Sequences of fresh tasks drawn from the prior (task = -1): one per sequence, or with
        ``n_tasks`` that many drawn once, each sequence's task uniform among them (the study's OOD
        evaluation sets, ``n_ood`` tasks)."""
        _check_sizes(batch_size, seq_len)
        if n_tasks is not None and n_tasks < 1:
            raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
        gen = generator(seed, step, stream)
        if n_tasks is None:
            params = self.sample_params(batch_size, gen)
        else:
            params = self.sample_params(n_tasks, gen)[torch.randint(0, n_tasks, (batch_size,), generator=gen)]
        return self.make_batch(params, torch.full((batch_size,), -1, dtype=torch.long), seq_len, gen)

    def ood_task_params(self, n_tasks: int, seed: int = 0, step: int = 0, stream: str = "ood") -> torch.Tensor:
        """[n_tasks, ...] the fresh tasks ``sample_ood(..., seed, step, stream, n_tasks)`` draws (its first draw)."""
        return self.sample_params(n_tasks, generator(seed, step, stream))

    def sample_among(
        self, params: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0, step: int = 0, stream: str = "ood"
    ) -> Batch:
        """Sequences whose task is uniform among the given tasks params: [J, ...] (task = -1: not in the pool)."""
        _check_sizes(batch_size, seq_len)
        gen = generator(seed, step, stream)
        chosen = params[torch.randint(0, params.shape[0], (batch_size,), generator=gen)]
        return self.make_batch(chosen, torch.full((batch_size,), -1, dtype=torch.long), seq_len, gen)

    def sample_ood_tasks(
        self, n_tasks: int, per_task: int, seq_len: int, seed: int = 0, step: int = 0, stream: str = "ood-tasks"
    ) -> Batch:
        """``n_tasks`` fresh tasks from the prior with ``per_task`` sequences each (task = -1): rows
        ``j * per_task .. (j + 1) * per_task - 1`` share task j's params."""
        _check_sizes(n_tasks * per_task, seq_len)
        gen = generator(seed, step, stream)
        params = self.sample_params(n_tasks, gen).repeat_interleave(per_task, dim=0)
        return self.make_batch(params, torch.full((n_tasks * per_task,), -1, dtype=torch.long), seq_len, gen)


class TokenFamily(TaskFamily):
    """A latent-task family over a token vocabulary of size ``vocab_size``, trained on next tokens."""

    vocab_size: int

    # ---- family-specific pieces -------------------------------------------------------------
    @abstractmethod
    def sample_tokens(self, params: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """[B, T] long sequences, one per task in params: [B, ...]."""

    @abstractmethod
    def step_log_likelihood(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """[B, T, K] log p_k(tokens[:, t] | tokens[:, :t]) for each pool task k."""

    @abstractmethod
    def mix_predictive(self, tokens: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[B, T, V] sum_k weights[b, t, k] p_k(next | tokens[:, :t+1]); weights: [B, T, K]."""

    @abstractmethod
    def predict_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, V] posterior predictive under the continuous prior (the OOD-optimal learner)."""

    def initial_log_prob(self) -> float:
        """log p(tokens[:, 0]) under the prior, the same for every first token."""
        return -math.log(self.vocab_size)

    # ---- the shared protocol ----------------------------------------------------------------
    def make_batch(self, params: torch.Tensor, task: torch.Tensor, seq_len: int, gen: torch.Generator) -> Batch:
        return Batch(self.sample_tokens(params, seq_len, gen), task, params)

    def model_io(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size}

    def reference_predictions(self, batch: Batch, pool: TaskPool) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, V], [B, T, V]) ID-Bayes and OOD-optimal next-token distributions."""
        return self.predict_id(batch.tokens, pool), self.predict_ood(batch.tokens)

    def context_statistic(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position, with the centred log of the OOD-optimal predictive: the CLR of the
        add-alpha unigram (E1) or current-state bigram row (E3) frequencies."""
        logp = self.predict_ood(batch.tokens).clamp_min(1e-300).log()
        return torch.arange(batch.tokens.shape[1]), logp - logp.mean(-1, keepdim=True)

    def training_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-token cross-entropy over tokens: [B, T]."""
        logits = model(batch.tokens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))

    def position_losses(
        self, model: torch.nn.Module, batch: Batch, bayes_id: torch.Tensor, bayes_ood: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each [B, T-1] (nats): position t scores the prediction of tokens[:, t+1]; the gap is
        KL(ID-Bayes || model)."""
        tokens = batch.tokens
        logp_model = torch.log_softmax(model(tokens).double(), dim=-1)
        loss = -logp_model[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        bayes = bayes_id[:, :-1]
        kl = (bayes * (bayes.clamp_min(1e-300).log() - logp_model[:, :-1])).sum(-1)
        rows = {
            "loss": loss,
            "bayes_id_loss": _nll(bayes_id, tokens),
            "bayes_ood_loss": _nll(bayes_ood, tokens),
            "kl_bayes_model": kl,
        }
        rows["excess"] = rows["loss"] - rows["bayes_id_loss"]
        return rows

    # ---- exact Bayes ------------------------------------------------------------------------
    def log_posterior(self, tokens: torch.Tensor, pool: TaskPool) -> torch.Tensor:
        """[B, T, K] log posterior over the pool after tokens[:, :t+1]."""
        loglik = self.step_log_likelihood(tokens, pool.params.double()).cumsum(dim=1)
        return torch.log_softmax(loglik + pool.weights.double().log(), dim=-1)

    def predict_id(self, tokens: torch.Tensor, pool: TaskPool) -> torch.Tensor:
        """[B, T, V] Bayes next-token distribution: the posterior mixture over the pool."""
        return self.mix_predictive(tokens, pool.params.double(), self.log_posterior(tokens, pool).exp())

    def predict_task(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """[B, T, V] next-token distribution of each sequence's own task; params: [B, ...]."""
        batch = tokens.shape[0]
        onehot = torch.eye(batch, dtype=torch.float64).unsqueeze(1).expand(batch, tokens.shape[1], batch)
        return self.mix_predictive(tokens, params.double(), onehot)

    def log_marginal_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log p(tokens[:, :t+1]) under the continuous prior (sequential evidence)."""
        logp = self.predict_ood(tokens).log()
        step = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        first = torch.full_like(step[:, :1], self.initial_log_prob())
        return torch.cat([first, step], dim=1).cumsum(dim=1)


def _check_sizes(batch_size: int, seq_len: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


def _nll(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T-1] -log probs[:, t, tokens[:, t+1]]."""
    return -probs[:, :-1].clamp_min(1e-300).log().gather(-1, tokens[:, 1:, None]).squeeze(-1)
