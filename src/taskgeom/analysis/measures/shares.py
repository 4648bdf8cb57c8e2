"""The share of in-context gain an edit removes (docs/concepts.md and docs/protocol.md), with the parts it is
made of, so that it cannot mislead: ``100 (L_ablated - L) / (L_0 - L)`` where L and L_ablated
average the per-prediction losses over the family's loss window (``loss_window``: every prediction
after the first, as the study's latent-Markov code, or every one, as its coin code) and L_0 is the
clean loss of the first prediction. The study's random control averages the change over every
prediction while its gain keeps the window (``change_window``).

The share is ``None`` with a ``reason`` when the gain ``L_0 - L`` is not positive (removing part of
a gain that does not exist has no meaning: ablating then *lowers* or keeps the loss, and the ratio
flips sign), and ``unreliable`` when the gain is below ``MIN_RELIABLE_GAIN``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgeom.analysis.protocol import STUDY as PROTOCOL

# Below this many nats (squared error for E2) of in-context gain, a share of it is unreliable and counts
# neither way in a claim's verdict (docs/protocol.md, "Shares of in-context gain")
MIN_RELIABLE_GAIN = PROTOCOL.min_reliable_gain


def unreliable_gain(gain: float, min_gain: float = MIN_RELIABLE_GAIN) -> bool:
    """True when an in-context gain (nats) is below ``min_gain`` or is NaN: too small to divide by."""
    return not gain >= min_gain


@dataclass(frozen=True)
class Share:
    """value: percent of the in-context gain removed (None when the gain is not positive, see
    ``reason``); gain: L_0 - L; clean, ablated: the clean and ablated losses averaged where the change
    is (L and L_ablated unless a ``change_window`` was given); first: L_0; unreliable: gain below
    MIN_RELIABLE_GAIN (or not a number)."""

    value: float | None
    gain: float
    clean: float
    ablated: float
    first: float
    unreliable: bool
    reason: str | None = None

    def __repr__(self) -> str:
        value = "null" if self.value is None else f"{self.value:.4g}%"
        flags = (" unreliable" if self.unreliable else "") + (f" ({self.reason})" if self.reason else "")
        return f"Share({value} of a gain of {self.gain:.4g} nats: loss {self.clean:.4g} -> {self.ablated:.4g}, L_0 {self.first:.4g}{flags})"

    def fields(self) -> dict:
        """What a stored row carries of a share beside its value: gain, unreliable, reason."""
        return {"gain": self.gain, "unreliable": self.unreliable, "reason": self.reason}


def loss_window(family) -> slice:
    """The predictions a family's L averages: from its ``loss_from`` on (the study's coin code: every
    prediction; its latent-Markov code: every one after the first)."""
    return slice(family.loss_from, None)


def share_of_gain(
    ablated: torch.Tensor,
    clean: torch.Tensor,
    window: slice = slice(1, None),
    min_gain: float = MIN_RELIABLE_GAIN,
    change_window: slice | None = None,
) -> Share:
    """The share of in-context gain removed, for per-prediction losses ablated, clean: [P] (clean
    and edited runs of one batch); L and L_ablated average the predictions in ``window`` (every one
    after the first by default), the change L_ablated - L those in ``change_window`` (``window``
    when None)."""
    change_window = window if change_window is None else change_window
    gain = float(clean[0]) - float(clean[window].mean())
    before, after = float(clean[change_window].mean()), float(ablated[change_window].mean())
    unreliable = unreliable_gain(gain, min_gain)
    if not gain > 0:
        return Share(
            None,
            gain,
            before,
            after,
            float(clean[0]),
            unreliable,
            f"the in-context gain L_0 - L = {gain:.3g} is not positive: no share of it can be removed",
        )
    return Share(100 * (after - before) / gain, gain, before, after, float(clean[0]), unreliable)
