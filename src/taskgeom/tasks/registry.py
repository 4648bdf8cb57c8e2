"""The registry of task families: the ``family:`` value of a recipe names a class here. The shipped
families join it on import like any other; a family from another package joins through the
entry-point group ``taskgeom.families`` (name = its ``family:`` value, object = the class), loaded
the first time a family is looked up, in whichever process looks it up (sweep workers and Ray tasks
included)."""

from __future__ import annotations

from functools import lru_cache
from importlib import metadata
from typing import Literal

from pydantic import create_model

from taskgeom.errors import TaskgeomError
from taskgeom.settings.fields import TaskSettings
from taskgeom.tasks.base import TaskFamily

ENTRY_POINT_GROUP = "taskgeom.families"


class FamilyError(TaskgeomError, ValueError):
    """A family that cannot be registered or found; the message names the family and its package."""


FAMILIES: dict[str, type[TaskFamily]] = {}
_SOURCES: dict[str, str] = {}  # family name -> where it came from ("taskgeom", or "package X (entry point ...)")
_plugins_loaded = False


def register(family: type[TaskFamily], source: str = "taskgeom") -> type[TaskFamily]:
    """Add ``family`` (a TaskFamily subclass with ``name`` and a ``Settings`` model) under its name;
    FamilyError if the name is taken. Returns the class, so it can decorate one."""
    name = getattr(family, "name", None)
    if not (isinstance(family, type) and issubclass(family, TaskFamily)):
        raise FamilyError(f"{source}: {family!r} is not a taskgeom.tasks.TaskFamily subclass")
    if not isinstance(name, str) or not name.isidentifier():
        raise FamilyError(
            f"{source}: family {family.__name__} needs a class attribute name, an identifier (got {name!r})"
        )
    settings = getattr(family, "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, TaskSettings)):
        raise FamilyError(
            f"{source}: family {name!r} needs a class attribute Settings, a subclass of taskgeom.settings.fields.TaskSettings"
        )
    if name in FAMILIES and FAMILIES[name] is not family:
        raise FamilyError(
            f"family {name!r} is registered twice: by {_SOURCES[name]} and by {source}; uninstall one of them"
        )
    FAMILIES[name], _SOURCES[name] = family, source
    return family


def load_plugins() -> None:
    """Register every family of the entry-point group (once per process); FamilyError naming the
    package when one fails to import, is no family, or takes a name already registered."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        source = f"package {entry.dist.name if entry.dist else '?'} (entry point {entry.name} = {entry.value})"
        try:
            family = entry.load()
        except Exception as err:  # any import failure of a plugin is reported as the plugin's
            raise FamilyError(f"{source} failed to import: {type(err).__name__}: {err}") from None
        if getattr(family, "name", None) != entry.name:
            raise FamilyError(
                f"{source}: the entry point's name must be the family's name ({getattr(family, 'name', None)!r})"
            )
        register(family, source)


def families() -> dict[str, type[TaskFamily]]:
    """Every registered family by name, the plugins' included."""
    load_plugins()
    return dict(FAMILIES)


def family_class(name: str) -> type[TaskFamily]:
    """The family registered as ``name``; FamilyError listing the registered ones otherwise."""
    known = families()
    if name not in known:
        raise FamilyError(
            f"unknown task family {name!r}; registered: {', '.join(sorted(known))} (a family from another package "
            f"joins through the entry-point group {ENTRY_POINT_GROUP})"
        )
    return known[name]


@lru_cache(maxsize=None)
def _settings_model(family: type[TaskFamily]) -> type[TaskSettings]:
    model = create_model(
        family.Settings.__name__,
        __base__=family.Settings,
        __module__=__name__,
        family=(Literal[family.name], family.name),
    )
    model.__qualname__ = f"settings.{family.name}"  # how pickle finds it again, in any process: ``settings`` below
    return model


class _SettingsByName:
    """``registry.settings.NAME``: the settings model of family NAME (so that a config pickled for a
    worker process is read back there)."""

    def __getattr__(self, name: str) -> type[TaskSettings]:
        return settings_model(name)


settings = _SettingsByName()


def settings_model(name: str) -> type[TaskSettings]:
    """The ``task`` section's model for family ``name``: its Settings plus ``family: Literal[name]``."""
    return _settings_model(family_class(name))


def build_family(settings: TaskSettings) -> TaskFamily:
    """The family a validated ``task`` section describes."""
    return family_class(settings.family).from_settings(settings)
