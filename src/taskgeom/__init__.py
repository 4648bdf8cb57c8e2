"""taskgeom: task-vector geometry of in-context task inference in small transformers."""

__version__ = "0.1.0"

from taskgeom import tasks  # noqa: E402  (public API: taskgeom.tasks.make)

__all__ = ["tasks", "__version__"]
