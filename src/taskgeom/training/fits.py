"""Whether a run fits where it will train: ``config``'s memory estimate of training it against the
memory ``devices`` finds free there (exit 3, before anything is made). The device is read through
``devices`` (``devices.resolve_device``, ...), as the CLI's own checks read it."""

from __future__ import annotations

import torch

from taskgeom.settings import devices
from taskgeom.settings.config import check_training_memory


def check_training_fits(config, device: str) -> None:
    """Refuse ``config`` (a RunConfig) when training it on ``device`` (resolved here, as the run will
    be) cannot fit in the memory available there (EnvironmentRefused, exit 3); call it before the
    run directory is made."""
    where = devices.resolve_device(device)
    cpu = torch.device("cpu")
    host = (devices.available_memory(cpu), devices.describe(cpu)) if where.type == "cuda" else None
    check_training_memory(config, devices.available_memory(where), devices.describe(where), host)
