"""E4's prefix probe as the study measures it (``run_prefix_probe`` of its ``dyck/prefix_probe``:
``_data.py``, ``_model.py``, ``_train.py``; called by ``fig_dyck_combined.py``; docs/protocol.md, "E4").

Ten bracket masks are drawn (``dyck_variance.bracket_masks``, the study's ``sample_binary_mask``);
for each (mask, task of the pool, majors and minors) 32 sequences plant the task's string at the
mask's places. The state read is the ``resid_mid`` of the study's block 5 of 6 (its hook on
``attn_block``) at every position where exactly l brackets have been placed, l = 1..7, the last
position left out; its label is the task's first l brackets, one class per distinct prefix of the
pool (a length with fewer than two classes is left out). The probe is a shared linear projection
to two dimensions and an MLP head per length (hidden 64, SiLU), trained with the study's loop:
2,000 epochs, one AdamW step an epoch on the gradient summed over minibatches of 512, heads at
lr 3e-3 and the projection at a tenth, cosine decay, clipping at 1; 512 samples per class, drawn
again from the pool every 2 epochs, a fixed validation set; a curriculum that starts on the two
shortest lengths and adds the next when every active length's validation loss is at most 0.1;
early stop when the mean is at most 6e-3; the best mean validation loss kept. The study reports
each length's validation accuracy.

The control [ours]: the same probe, data and draws with the labels shuffled within each length's
pool; the claim reads the smallest over lengths of accuracy minus the control's (``studies.e4.claims``).
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from taskgeom.analysis.protocol import PrefixProbeSettings as ProbeSettings
from taskgeom.analysis.protocol import active as active_protocol
from taskgeom.analysis.reading.states import collect
from taskgeom.hooks import Place
from taskgeom.rng import generator
from taskgeom.runs.folders import Run
from taskgeom.studies.e4.row_file import RowFile
from taskgeom.studies.e4.variance import bracket_masks
from taskgeom.tasks.dyck import Dyck

# The protocol's (``active_protocol()``): dyck_probe_masks, fig_dyck_combined.py's --probe-masks;
# dyck_probe_per_mask, its --probe-batch (sequences per (task, mask)); dyck_probe_max_prefix, its
# --target-length; dyck_probe_block, its --layer 5 of the study's 6 blocks, placed by relative depth
# (Place.at_depth); dyck_probe_site, where _data.py hooks model.layers[layer].attn_block; and
# dyck_prefix_probe, the probe's training settings
TASK_CHUNK = 128  # tasks per forward pass (memory only)
# {length l: (states [N, D], labels [N] long)}: states a tensor or, for a collected pool, a RowFile (read by index)
Data = dict[int, tuple[torch.Tensor | RowFile, torch.Tensor]]


def prefix_classes(words: torch.Tensor, max_prefix: int | None = None) -> dict[int, dict[tuple[int, ...], int]]:
    """{l: {prefix: class}} for l = 1..max_prefix (the protocol's ``dyck_probe_max_prefix`` when None):
    the distinct first-l brackets of words: [K, 2n], numbered in order of first appearance
    (``build_prefix_datasets``)."""
    max_prefix = active_protocol().dyck_probe_max_prefix if max_prefix is None else max_prefix
    classes: dict[int, dict[tuple[int, ...], int]] = {}
    for length in range(1, max_prefix + 1):
        seen: dict[tuple[int, ...], int] = {}
        for word in words.tolist():
            seen.setdefault(tuple(word[:length]), len(seen))
        classes[length] = seen
    return classes


def collect_pool(
    family: Dyck,
    model: nn.Module,
    words: torch.Tensor,
    masks: torch.Tensor,
    per_mask: int,
    layer: int,
    gen: torch.Generator,
    into: Path,
    max_prefix: int | None = None,
) -> Data:
    """The pool: {l: (states [N, D] at (layer, the protocol's ``dyck_probe_site``), labels [N])} over
    every (mask, task) and its ``per_mask`` sequences, at the positions where l brackets are placed
    (the last position left out), for the lengths l <= max_prefix (the protocol's when None) with at
    least two classes that some mask reaches; each length's states in a ``RowFile`` in the folder
    ``into`` (the pool is the analysis's largest object), its labels in memory."""
    max_prefix = active_protocol().dyck_probe_max_prefix if max_prefix is None else max_prefix
    site = active_protocol().dyck_probe_site
    classes = prefix_classes(words, max_prefix)
    lengths = [length for length in range(1, max_prefix + 1) if len(classes[length]) >= 2]
    labels = {length: torch.tensor([classes[length][tuple(w[:length])] for w in words.tolist()]) for length in lengths}
    K, T = words.shape[0], masks.shape[1]
    counts = masks.long().cumsum(1)
    counts[:, -1] = -1  # the last position is never read
    positions = [{length: (count == length).nonzero().squeeze(1) for length in lengths} for count in counts]
    states = {length: RowFile(Path(into) / f"length-{length}.f32", model.cfg.d_model) for length in lengths}
    read_labels: dict[int, list[torch.Tensor]] = {length: [] for length in lengths}
    for mask, at_mask in zip(masks, positions):
        noise = torch.randint(0, family.n_noise, (K, per_mask, T), generator=gen)
        read = 1 + max(
            (int(p.max()) for p in at_mask.values() if p.numel()), default=0
        )  # the model is causal: the prefix suffices
        for tasks in torch.arange(K).split(TASK_CHUNK):
            n = len(tasks) * per_mask
            tokens = family.plant(
                words[tasks].repeat_interleave(per_mask, 0), mask.expand(n, -1), noise[tasks].reshape(n, T)
            )
            h = collect(model, tokens[:, :read], [(layer, site)], batch_size=1024)[(layer, site)]  # [n, read, D]
            for length in lengths:  # in the order mask, task, sequence, position
                at = h[:, at_mask[length]]  # [n, P, D]: task-major, then sequence, then position
                states[length].append(at.reshape(-1, at.shape[-1]))
                read_labels[length].append(labels[length][tasks].repeat_interleave(per_mask * at.shape[1]))
    return {  # a length no mask reaches is left out
        length: (states[length], torch.cat(read_labels[length])) for length in lengths if states[length].count
    }


class PrefixProbe(nn.Module):
    """A linear projection [D -> proj_dim] shared by the lengths and an MLP head per length
    (proj_dim -> hidden -> classes, SiLU), the study's ``PrefixProbe``."""

    def __init__(self, d_model: int, proj_dim: int, n_classes: dict[int, int], hidden: int):
        super().__init__()
        self.proj = nn.Linear(d_model, proj_dim)
        self.heads = nn.ModuleDict(
            {
                str(length): nn.Sequential(nn.Linear(proj_dim, hidden), nn.SiLU(), nn.Linear(hidden, n))
                for length, n in n_classes.items()
            }
        )

    def forward(self, h: torch.Tensor, length: int) -> torch.Tensor:
        """[N, classes of length] logits for states h: [N, D]."""
        return self.heads[str(length)](self.proj(h))


def distinct_sample(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[k] distinct indices of range(n) in random order, every ordered choice equally likely (as
    ``randperm(n)[:k]``, the study's draw): draws with replacement, repeats skipped, in O(k) where
    k is small beside n (the study's pools hold about 2,000 samples a class, a draw 512)."""
    if 4 * k > n:
        return torch.randperm(n, generator=gen)[:k]
    picked = torch.empty(0, dtype=torch.long)
    while picked.numel() < k:
        drawn = torch.cat([picked, torch.randint(n, (k - picked.numel() + 64,), generator=gen)])
        values, inverse = drawn.unique(return_inverse=True)
        first = torch.full_like(values, drawn.numel()).scatter_reduce(0, inverse, torch.arange(drawn.numel()), "amin")
        picked = drawn[first.sort().values][:k]
    return picked


def draw_sizes(pool: Data, rows: dict[int, torch.Tensor], per_class: int) -> dict[int, int]:
    """{l: per_class x (largest label + 1), at most the rows' count}: what ``_resample_from_pool``
    draws from each length's training ``rows`` of pool."""
    return {length: min(per_class * (int(pool[length][1][r].max()) + 1), r.shape[0]) for length, r in rows.items()}


def _draw(
    pool: Data, rows: dict[int, torch.Tensor], lengths: list[int], sizes: dict[int, int], gen: torch.Generator
) -> Data:
    """A fresh subsample of ``sizes`` (``draw_sizes``) of each length's training ``rows`` of pool
    (``_resample_from_pool``)."""
    out = {}
    for length in lengths:
        h, y = pool[length]
        picked = rows[length][distinct_sample(rows[length].shape[0], sizes[length], gen)]
        out[length] = (h[picked], y[picked])
    return out


def _split(pool: Data, per_class: int, gen: torch.Generator) -> tuple[dict[int, torch.Tensor], Data]:
    """(the training rows of each length [n] long, the validation set): per length, a random
    min(per_class x classes, N // 3) held out; the training pool stays pool's rows, not a copy."""
    rows, validation = {}, {}
    for length, (h, y) in pool.items():
        order = torch.randperm(h.shape[0], generator=gen)
        n_val = min(per_class * (int(y.max()) + 1), h.shape[0] // 3)
        validation[length] = (h[order[:n_val]], y[order[:n_val]])
        rows[length] = order[n_val:]
    return rows, validation


@torch.no_grad()
def _evaluate(probe: PrefixProbe, validation: Data, lengths: list[int]) -> tuple[dict[int, float], dict[int, float]]:
    """({l: accuracy}, {l: cross-entropy}) on the validation set."""
    probe.eval()
    accuracy, loss = {}, {}
    for length in lengths:
        h, y = validation[length]
        logits = probe(h, length)
        accuracy[length] = float((logits.argmax(-1) == y).float().mean())
        loss[length] = float(nn.functional.cross_entropy(logits, y))
    return accuracy, loss


@dataclass(frozen=True)
class ProbeResult:
    """Validation accuracy and cross-entropy per length of the kept probe, the epoch it was kept at,
    the epochs run, the longest length the curriculum reached (a longer one's head is untrained),
    the lengths in training at the kept snapshot's epoch (``kept_lengths``: the heads the kept probe
    had trained) and each length's chance level (the largest class share of its validation labels:
    what a label-blind predictor reaches)."""

    accuracy: dict[int, float]
    loss: dict[int, float]
    best_epoch: int
    epochs: int
    reached: int
    kept_lengths: tuple[int, ...]
    chance: dict[int, float]


def train_probe(
    pool: Data, n_classes: dict[int, int], d_model: int, gen: torch.Generator, settings: ProbeSettings | None = None
) -> ProbeResult:
    """The study's ``train_prefix_probe`` on pool (``collect_pool``), after its validation split, with
    ``settings`` (the protocol's ``dyck_prefix_probe`` when None); the probe's initial weights and every
    draw from ``gen``."""
    s = active_protocol().dyck_prefix_probe if settings is None else settings
    lengths = sorted(pool)
    rows, validation = _split(pool, s.samples_per_class, gen)
    sizes = draw_sizes(pool, rows, s.samples_per_class)  # the pool does not change between redraws
    train = _draw(pool, rows, lengths, sizes, gen)
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        probe = PrefixProbe(d_model, s.proj_dim, {length: n_classes[length] for length in lengths}, s.mlp_hidden)
    optimizer = torch.optim.AdamW(
        [
            {"params": probe.proj.parameters(), "lr": s.lr * s.proj_lr_scale},
            {"params": probe.heads.parameters(), "lr": s.lr},
        ],
        weight_decay=s.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=s.epochs, eta_min=s.lr * 0.01)
    active = min(2, len(lengths))
    best_loss, best_epoch, best_state, best_active = float("inf"), 0, None, active
    epoch = 0
    for epoch in range(s.epochs):
        current = lengths[:active]
        if epoch > 0 and epoch % s.refresh_every == 0:
            train.update(_draw(pool, rows, current, sizes, gen))
        probe.train()
        optimizer.zero_grad(set_to_none=True)
        for length in current:
            h, y = train[length]
            order = torch.randperm(h.shape[0], generator=gen)
            for start in range(0, h.shape[0], s.mini_batch):
                index = order[start : start + s.mini_batch]
                nn.functional.cross_entropy(probe(h[index], length), y[index]).backward()
        nn.utils.clip_grad_norm_(probe.parameters(), s.max_grad_norm)
        optimizer.step()
        scheduler.step()
        if (epoch + 1) % s.eval_every and epoch:
            continue
        _, loss = _evaluate(probe, validation, current)
        mean_loss = sum(loss.values()) / len(loss)
        if mean_loss < best_loss:
            best_loss, best_epoch, best_state = mean_loss, epoch + 1, copy.deepcopy(probe.state_dict())
            best_active = active
        if active < len(lengths) and max(loss.values()) <= s.curriculum_threshold:
            active += 1
            if active == len(lengths):  # every length in: the kept probe is chosen again from here
                best_loss, best_state = float("inf"), None
        if active == len(lengths) and mean_loss <= s.loss_threshold:
            break
    if best_state is not None:
        probe.load_state_dict(best_state)
    else:  # nothing kept since the reset: the probe as it ends, its heads trained up to the last epoch's lengths
        best_active = len(current)
    chance = {length: float(torch.bincount(y).max()) / len(y) for length, (_, y) in validation.items()}
    return ProbeResult(
        *_evaluate(probe, validation, lengths),
        best_epoch,
        epoch + 1,
        lengths[active - 1],
        tuple(lengths[:best_active]),
        chance,
    )


def shuffled(pool: Data, gen: torch.Generator) -> Data:
    """pool with each length's labels permuted [ours: the control]."""
    return {length: (h, y[torch.randperm(y.shape[0], generator=gen)]) for length, (h, y) in pool.items()}


def probe_layer(run: Run) -> int:
    """The block the study's probe reads at this model's depth (its block 5 of 6: ``dyck_probe_block``)."""
    return Place.at_depth(*active_protocol().dyck_probe_block, run.config.model.n_layers).layer


def study_prefix_probe(
    run: Run, n_masks: int | None = None, per_mask: int | None = None, settings: ProbeSettings | None = None
) -> dict[str, ProbeResult]:
    """{"probe": the study's prefix probe on ``run`` (its whole pool), "control": the same on shuffled
    labels}, on ``n_masks`` masks x ``per_mask`` sequences with ``settings`` (the protocol's when None);
    masks, sequences, splits, draws and initial weights from the run's seed (two streams)."""
    protocol = active_protocol()
    n_masks = protocol.dyck_probe_masks if n_masks is None else n_masks
    per_mask = protocol.dyck_probe_per_mask if per_mask is None else per_mask
    cfg = run.config
    gen = generator(cfg.train.seed, 0, "prefix-probe")
    words = run.pool.params
    n_classes = {length: len(classes) for length, classes in prefix_classes(words).items()}
    results = {}
    with tempfile.TemporaryDirectory(prefix="taskgeom-e4-pool-") as scratch:  # the pool's states, removed after
        pool = collect_pool(
            run.family,
            run.load_model(),
            words,
            bracket_masks(run.family, n_masks, cfg.task.seq_len, gen),
            per_mask,
            probe_layer(run),
            gen,
            Path(scratch),
        )
        for name, data in (
            ("probe", pool),
            ("control", shuffled(pool, generator(cfg.train.seed, 0, "prefix-probe-control"))),
        ):
            results[name] = train_probe(
                data, n_classes, cfg.model.d_model, generator(cfg.train.seed, 0, f"prefix-probe-{name}-train"), settings
            )
    return results
