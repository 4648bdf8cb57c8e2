"""The shipped families' experiments of their own, which their recipes' ``study`` sections name
(``run: taskgeom.extras.dyck:e4``): E2's dMMSE and ridge references, E4's failure of P0 and its
prefix probes. Nothing imports them but ``taskgeom reproduce``, through the recipes."""
