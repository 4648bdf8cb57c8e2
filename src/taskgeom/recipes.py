"""The shipped YAML recipes (``e1`` ... ``e4``), found by name or by path."""

from __future__ import annotations

from pathlib import Path

from taskgeom.config import ConfigError, RunConfig, load_config

RECIPE_DIR = Path(__file__).parent / "configs"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str | Path) -> Path:
    """A path as given if it exists, else the shipped recipe of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = RECIPE_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(f"no config file {str(name_or_path)!r} and no shipped recipe of that name; recipes: {recipe_names()}")


def load_recipe(name_or_path: str | Path, profile: str = "quick", overrides: list[str] = ()) -> RunConfig:
    return load_config(recipe_path(name_or_path), profile, list(overrides))
