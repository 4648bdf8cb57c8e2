"""E4's prefix probe as the study's ``run_prefix_probe`` computes it (``_data.py``, ``_model.py``,
``_train.py``), held to a plain implementation of its steps on a tiny trained E4 run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from taskgeom.analysis.protocol import STUDY
from taskgeom.settings.recipes import build_config
from taskgeom.studies.e4.prefix import PrefixProbe, ProbeSettings, collect_pool, prefix_classes, train_probe
from taskgeom.studies.e4.variance import bracket_masks

N_MASKS, PER_MASK = 3, 8
# Small enough to run in seconds, with a curriculum threshold that promotes lengths on the way
SMALL = ProbeSettings(
    epochs=120, lr=3e-2, mini_batch=16, samples_per_class=12, curriculum_threshold=1.3, loss_threshold=1e-4
)


@pytest.fixture(scope="module")
def dyck_run(tmp_path_factory):
    """A finished 2-block, 16-wide E4 model (3 pairs, 3 noise tokens, 3 majors and 4 minors) trained 30 steps."""
    from taskgeom.runs.folders import Run
    from taskgeom.training.train import train

    config = build_config(
        {
            "name": "tiny-dyck-k2",
            "task": {"family": "dyck", "seq_len": 24, "n_pairs": 3, "n_noise": 3, "p_bracket": 0.4, "diversity": 2},
            "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 24},
            "train": {
                "steps": 30,
                "batch_size": 16,
                "eval_every": 30,
                "checkpoint_every": 30,
                "eval_batch": 16,
                "lr": 3e-3,
                "threads": 1,
            },
        }
    )
    run = Run.create(config, tmp_path_factory.mktemp("dyck"))
    train(run)
    return Run.open(run.path)


def _pool_by_hand(run, layer: int, gen: torch.Generator) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The study's data steps one by one: masks from the generator (a coin per position, the first 2n
    successes kept); per mask, the noise of every (task, sequence); each sequence built token by
    token; the block's resid_mid read by a forward hook; at every position but the last where
    exactly l brackets have been placed, the state labelled by the task's first l brackets, the
    classes numbered in order of first appearance over the tasks; lengths with one class, or never
    reached, left out."""
    family, model, T = run.family, run.load_model(), run.config.task.seq_len
    coin = torch.rand(N_MASKS, T, generator=gen, dtype=torch.float64) < family.p_bracket
    words = run.pool.params.tolist()
    classes = {}
    for length in range(1, 8):
        seen = {}
        for word in words:
            if tuple(word[:length]) not in seen:
                seen[tuple(word[:length])] = len(seen)
        if len(seen) >= 2:
            classes[length] = seen
    cache = {}
    handle = model.site(layer, "resid_mid").register_forward_hook(
        lambda module, inputs, out: cache.__setitem__("h", out)
    )
    states = {length: [] for length in classes}
    labels = {length: [] for length in classes}
    for m in range(N_MASKS):
        places = [t for t in range(T) if coin[m, t]][: family.length]
        noise = torch.randint(0, family.n_noise, (len(words), PER_MASK, T), generator=gen)
        for k, word in enumerate(words):
            tokens = noise[k].clone()
            for b in range(PER_MASK):
                for i, t in enumerate(places):
                    tokens[b, t] = family.n_noise + word[i]
            with torch.no_grad():
                model(tokens)
            for b in range(PER_MASK):
                for t in range(T - 1):
                    placed = sum(1 for p in places if p <= t)
                    if placed in classes:
                        states[placed].append(cache["h"][b, t])
                        labels[placed].append(classes[placed][tuple(word[:placed])])
    handle.remove()
    return {length: (torch.stack(states[length]), torch.tensor(labels[length])) for length in classes if states[length]}


def _collected(run, into):
    """``collect_pool`` on run's block 1 with the tests' masks and draws, its states in folder into."""
    from taskgeom.rng import generator

    gen = generator(0, 0, "test")
    masks = bracket_masks(run.family, N_MASKS, run.config.task.seq_len, gen)
    return collect_pool(run.family, run.load_model(), run.pool.params, masks, PER_MASK, 1, gen, into)


def test_the_probe_s_data_are_the_study_s_by_hand(dyck_run, tmp_path):
    """``collect_pool``'s states and labels equal the plain implementation's (the same draws)."""
    from taskgeom.rng import generator

    expected = _pool_by_hand(dyck_run, 1, generator(0, 0, "test"))
    pool = _collected(dyck_run, tmp_path)
    assert sorted(pool) == sorted(expected) and len(expected) >= 2
    for length, (h, y) in expected.items():
        states, labels = pool[length]
        assert torch.equal(labels, y) and states.shape == h.shape
        torch.testing.assert_close(states[torch.arange(len(y))], h, rtol=1e-5, atol=1e-6)
    assert len(prefix_classes(dyck_run.pool.params)[2]) == int(expected[2][1].max()) + 1


def _train_by_hand(pool, n_classes, d_model, gen, s: ProbeSettings) -> tuple[dict[int, float], dict[int, float]]:
    """The study's ``run_prefix_probe`` after collection and ``train_prefix_probe``, written out: per
    length a validation set of min(per_class x classes, N // 3) from a permutation of the pool, the
    training set drawn from the rest (per_class x classes, a uniform ordered choice without
    repeats, as the study's ``randperm(N)[:k]``), again every ``refresh_every`` epochs for
    the lengths in training; one optimiser step an epoch on the gradient summed over minibatches;
    evaluation at epoch 1 and every 10th; the curriculum from the two shortest lengths; the best
    mean validation loss kept, forgotten when the last length comes in; accuracy and cross-entropy per length."""
    lengths = sorted(pool)
    rest, val = {}, {}
    for length in lengths:
        h, y = pool[length]
        perm = torch.randperm(len(y), generator=gen)
        n_val = min(s.samples_per_class * (int(y.max()) + 1), len(y) // 3)
        val[length] = (h[perm[:n_val]], y[perm[:n_val]])
        rest[length] = (h[perm[n_val:]], y[perm[n_val:]])

    def draw(which):
        out = {}
        for length in which:
            h, y = rest[length]
            k = min(s.samples_per_class * (int(y.max()) + 1), len(y))
            if 4 * k > len(y):
                idx = torch.randperm(len(y), generator=gen)[:k].tolist()
            else:  # one draw with replacement after another, a repeat skipped
                idx = []
                while len(idx) < k:
                    for v in torch.randint(len(y), (k - len(idx) + 64,), generator=gen).tolist():
                        if v not in idx and len(idx) < k:
                            idx.append(v)
            out[length] = (h[idx], y[idx])
        return out

    train = draw(lengths)
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        probe = PrefixProbe(d_model, s.proj_dim, {length: n_classes[length] for length in lengths}, s.mlp_hidden)
    opt = torch.optim.AdamW(
        [
            {"params": probe.proj.parameters(), "lr": s.lr * s.proj_lr_scale},
            {"params": probe.heads.parameters(), "lr": s.lr},
        ],
        weight_decay=s.weight_decay,
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=s.epochs, eta_min=s.lr * 0.01)
    n_active, best, best_state = 2, float("inf"), None
    for epoch in range(s.epochs):
        now = lengths[:n_active]
        if epoch > 0 and epoch % s.refresh_every == 0:
            for length, data in draw(now).items():
                train[length] = data
        probe.train()
        opt.zero_grad()
        for length in now:
            h, y = train[length]
            perm = torch.randperm(len(y), generator=gen)
            for start in range(0, len(y), s.mini_batch):
                idx = perm[start : start + s.mini_batch]
                nn.CrossEntropyLoss()(probe(h[idx], length), y[idx]).backward()
        nn.utils.clip_grad_norm_(probe.parameters(), s.max_grad_norm)
        opt.step()
        sched.step()
        if (epoch + 1) % 10 == 0 or epoch == 0:
            probe.eval()
            with torch.no_grad():
                losses = [nn.CrossEntropyLoss()(probe(val[length][0], length), val[length][1]).item() for length in now]
            if sum(losses) / len(losses) < best:
                best, best_state = sum(losses) / len(losses), copy.deepcopy(probe.state_dict())
            if n_active < len(lengths) and max(losses) <= s.curriculum_threshold:
                n_active += 1
                if n_active == len(lengths):
                    best, best_state = float("inf"), None
            if n_active == len(lengths) and sum(losses) / len(losses) <= s.loss_threshold:
                break
    if best_state is not None:
        probe.load_state_dict(best_state)
    probe.eval()
    with torch.no_grad():
        logits = {length: probe(val[length][0], length) for length in lengths}
        return (
            {length: (logits[length].argmax(-1) == val[length][1]).float().mean().item() for length in lengths},
            {length: nn.CrossEntropyLoss()(logits[length], val[length][1]).item() for length in lengths},
        )


def test_the_probe_is_trained_as_the_study_s_by_hand(dyck_run, tmp_path):
    """``train_probe``'s validation accuracies and losses equal the plain loop's on the same pool and
    draws."""
    from taskgeom.rng import generator

    pool = _collected(dyck_run, tmp_path)
    n_classes = {length: len(c) for length, c in prefix_classes(dyck_run.pool.params).items()}
    accuracy, loss = _train_by_hand(pool, n_classes, 16, generator(0, 0, "train"), SMALL)
    result = train_probe(pool, n_classes, 16, generator(0, 0, "train"), SMALL)
    assert result.accuracy == accuracy and result.loss == loss
    assert len(loss) >= 2 and result.best_epoch > 1 and result.accuracy[2] > 0.9  # it learns the first brackets
    assert result.best_epoch <= result.epochs == SMALL.epochs and result.reached == max(
        pool
    )  # the curriculum brought every length in
    assert STUDY.dyck_probe_site == "resid_mid"


def test_a_pool_read_from_its_files_trains_the_probe_held_in_memory(dyck_run, tmp_path):
    """The collected pool's states, read from their files, are the floats a pool held in memory
    holds: the probe trained on either has the same kept epoch, accuracies and losses, exactly."""
    from taskgeom.rng import generator

    on_disk = _collected(dyck_run, tmp_path)
    in_memory = {length: (states[torch.arange(states.shape[0])], y) for length, (states, y) in on_disk.items()}
    n_classes = {length: len(c) for length, c in prefix_classes(dyck_run.pool.params).items()}
    from_files, from_memory = (
        train_probe(pool, n_classes, 16, generator(0, 0, "train"), SMALL) for pool in (on_disk, in_memory)
    )
    assert from_files == from_memory and from_files.best_epoch > 1


def test_a_distinct_sample_is_a_uniform_choice_without_repeats():
    """Each of the 380 ordered pairs of distinct values of range(20) comes up about equally often
    (k = 2, 19,000 draws: 50 expected, a standard deviation of about 7), no draw repeats a value."""
    from taskgeom.studies.e4.prefix import distinct_sample

    gen = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(19_000):
        a, b = distinct_sample(20, 2, gen).tolist()
        counts[(a, b)] = counts.get((a, b), 0) + 1
    assert len(counts) == 380 and all(a != b for a, b in counts)
    assert 20 < min(counts.values()) and max(counts.values()) < 85  # expected 50 each; 5 standard deviations ~ 35
    big = distinct_sample(10_000, 2_000, gen)
    assert big.unique().numel() == 2_000 and int(big.min()) >= 0 and int(big.max()) < 10_000
