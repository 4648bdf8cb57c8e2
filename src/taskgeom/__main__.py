from taskgeom.cli import app

app()
