"""``python -m workbench``: the same CLI as the ``workbench`` console script."""

from workbench.cli import app

app()
