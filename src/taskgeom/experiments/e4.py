"""E4, planted Dyck (PAPER.md section 6): P0 fails where E1 and E3 satisfy it, and linear probes
recover the earlier bracket prefix from the hidden states.

P0 is measured by one function for every family, ``within_shares``: the within-cell share of
variance of the states at each layer (``resid_post``, and ``resid_mid`` kept in the JSON) over (task, current token) cells on late positions of
major-task sequences of a majors-only model. For E4 the cells are also (task, last three planted
brackets), and the positions are those of the bracket phase: late positions at which brackets are
still due [ours]. Once all brackets are placed E4 emits iid noise, a one-task E1 where P0 holds
trivially; both E4 numbers over all late positions are kept in ``analysis/e4.json`` too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from taskgeom.analysis.anova import two_way
from taskgeom.analysis.probes import linear_probe
from taskgeom.analysis.states import collect
from taskgeom.analysis.task_vectors import late_window
from taskgeom.claims import check
from taskgeom.experiments.base import Context
from taskgeom.report.dyck import plot_p0_comparison, plot_prefix_probes
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json

# The claim of the issue: E4's smallest within-cell share over layers is at least this many times
# the larger of E1's and E3's smallest.
P0_FACTOR = 3.0
# A probe recovers its target when it beats its shuffled-label control by at least this much
# (held-out accuracy points for the brackets j back, R^2 for the depth).
PROBE_MARGIN = 0.10
PROBE_DIVERSITY = 8  # k of the high-diversity model the probes read (2**k minor tasks)
MAX_BACK = 7  # probes for the planted bracket j back, j = 1..MAX_BACK
N_SEQUENCES = 256  # sequences per analysis
# The families whose P0 E4 is set beside: E2 joins here once its recipe exists, with its token
# factor binned, since x_t is continuous there.
REFERENCES = ("e1", "e3")
# Sites measured for P0 at every layer; the claim and the figure read resid_post.
P0_SITES = ("resid_mid", "resid_post")


def within_shares(
    states: Sequence[torch.Tensor], a: torch.Tensor, b: torch.Tensor, n_a: int, n_b: int, mask: torch.Tensor
) -> list[float]:
    """P0 for each state tensor (one per layer): SS_within / SS_total over cells (a, b) on the
    positions where mask is true. states: each [N, T, D]; a, b: [N, T] long (a in 0..n_a-1, b in
    0..n_b-1); mask: [N, T] bool."""
    return [two_way(h[mask], a[mask], b[mask], n_a, n_b).within_share for h in states]


def _layer_states(run: Run, tokens: torch.Tensor, model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """{site name: [[N, T, D] per layer]} for each name in P0_SITES."""
    sites = [(layer, name) for name in P0_SITES for layer in range(run.config.model.n_layers)]
    states = collect(model, tokens, sites)
    return {name: [states[site] for site in sites if site[1] == name] for name in P0_SITES}


def _major_batch(run: Run):
    return run.family.sample(run.pool, N_SEQUENCES, run.config.task.seq_len, run.config.train.seed, 0, "p0", "major")


def _late(tokens: torch.Tensor) -> torch.Tensor:
    """[N, T] bool, true on the late window."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, late_window(tokens.shape[1])] = True
    return mask


def reference_p0(run: Run) -> dict[str, list[float]]:
    """{site name: within-cell share per layer} over (task, current token) cells, late window,
    major-task sequences."""
    batch = _major_batch(run)
    tokens = batch.tokens
    task = batch.task[:, None].expand_as(tokens)
    K, V, late = run.pool.n_major, run.family.vocab_size, _late(tokens)
    return {name: within_shares(states, task, tokens, K, V, late) for name, states in _layer_states(run, tokens, run.load_model()).items()}


def dyck_p0(run: Run) -> dict[str, dict[str, list[float]]]:
    """{site name: {grouping_positions: share per layer}}: E4's within-cell share by (task, current
    token) and by (task, last three planted brackets), on the bracket phase of the late window
    (``_due``) and on the whole late window (``_late``)."""
    family, batch = run.family, _major_batch(run)
    tokens = batch.tokens
    late = _late(tokens)
    due = late & (family.bracket_count(tokens) < family.length)
    task = batch.task[:, None].expand_as(tokens)
    last3 = sum((family.planted(tokens, j) + 1) * 3 ** (j - 1) for j in (1, 2, 3))  # [N, T] in 0..26
    K, V = run.pool.n_major, family.vocab_size
    return {
        name: {
            "token_due": within_shares(states, task, tokens, K, V, due),
            "last3_due": within_shares(states, task, last3, K, 27, due),
            "token_late": within_shares(states, task, tokens, K, V, late),
            "last3_late": within_shares(states, task, last3, K, 27, late),
        }
        for name, states in _layer_states(run, tokens, run.load_model()).items()
    }


def prefix_probes(run: Run, model: torch.nn.Module) -> list[dict]:
    """Probes on OOD sequences (a fresh string each, so no memorised string can stand in for the
    prefix), at positions with at least MAX_BACK brackets placed and more still due: the bracket
    j back (accuracy) and the depth (R^2), from the embedding and from each layer's output."""
    family, cfg = run.family, run.config
    tokens = family.sample_ood(N_SEQUENCES, cfg.task.seq_len, cfg.train.seed, 0, "probe").tokens
    count = family.bracket_count(tokens)
    mask = (count >= MAX_BACK) & (count < family.length)
    groups = torch.arange(tokens.shape[0])[:, None].expand_as(tokens)[mask]
    sites = [(0, "resid_pre"), *((layer, "resid_post") for layer in range(cfg.model.n_layers))]
    states = collect(model, tokens, sites)
    targets = {f"back_{j}": ("classification", family.planted(tokens, j)) for j in range(1, MAX_BACK + 1)}
    targets["depth"] = ("regression", family.depth(tokens).double())
    rows = []
    for site in sites:
        name = "embedding" if site == (0, "resid_pre") else f"layer {site[0]}"
        for target, (kind, labels) in targets.items():
            result = linear_probe(states[site][mask], labels[mask], kind, groups, seed=cfg.train.seed)
            rows.append({"site": name, "target": target, "metric": result.metric, "score": result.score, "control": result.control})
    return rows


def e4(ctx: Context) -> None:
    majors = ctx.trained("e4", ("task.diversity=-1",))
    diverse = ctx.trained("e4", (f"task.diversity={PROBE_DIVERSITY}",))
    references = {name: reference_p0(ctx.trained(name, ("task.diversity=-1",))) for name in REFERENCES}
    dyck = dyck_p0(majors)
    probes = prefix_probes(diverse, diverse.load_model())
    untrained = prefix_probes(diverse, diverse.new_model())  # a second control: random features of the same network
    p0 = {name: {**{ref: references[ref][name] for ref in REFERENCES}, **{f"e4_{k}": v for k, v in dyck[name].items()}} for name in P0_SITES}
    atomic_write_json(ctx.out / "analysis" / "e4.json", {"p0": p0, "probes": probes, "probes_untrained": untrained})

    post = p0["resid_post"]
    e4_smallest = min(min(post["e4_token_due"]), min(post["e4_last3_due"]))
    reference_smallest = max(min(post[ref]) for ref in REFERENCES)
    ctx.claims.append(check(
        "e4.P0_failure", "e4",
        "E4's smallest within-cell share over layers (either grouping, bracket phase of the late window) "
        "divided by the larger of E1's and E3's smallest (task, token) share; k = -1",
        e4_smallest / reference_smallest, ">=", P0_FACTOR, ctx.profile))
    model_rows = [r for r in probes if r["site"] != "embedding"]
    gains = {t: max(r["score"] - r["control"] for r in model_rows if r["target"] == t) for t in dict.fromkeys(r["target"] for r in model_rows)}
    ctx.claims.append(check(
        "e4.prefix_probe", "e4",
        f"smallest over targets (bracket j back, j = 1..{MAX_BACK}, and depth) of the best layer's probe score minus its "
        f"shuffled-label control, OOD sequences, k = {PROBE_DIVERSITY}",
        min(gains.values()), ">=", PROBE_MARGIN, ctx.profile))

    series = {f"{ref.upper()} (task, token)": post[ref] for ref in REFERENCES}
    series |= {"E4 (task, token), bracket phase": post["e4_token_due"], "E4 (task, last 3 brackets), bracket phase": post["e4_last3_due"]}
    plot_p0_comparison(series, ctx.figure("p0_across_families.png",
                       "P0 across families: within-cell share of state variance per layer; E1 and E3 by (task, current token), "
                       "E4 by (task, current token) and by (task, last three planted brackets), k = -1"))
    last = f"layer {diverse.config.model.n_layers - 1}"
    plot_prefix_probes(probes, [r for r in untrained if r["site"] == last], ctx.figure("e4_prefix_probes.png",
                       f"E4: held-out linear probes for the planted bracket j back and for the depth, k = {PROBE_DIVERSITY}, OOD sequences; "
                       "dotted: shuffled labels; grey: the last layer of the untrained network"))
