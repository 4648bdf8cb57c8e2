"""taskgeom's version (``taskgeom.__version__``), in a module of its own: the modules the package's
``__init__`` imports read it from here, not from the package above them."""

__version__ = "0.1.0"
