"""``python -m gpulock_broker``: the same as ``gpulock broker``."""

import typer

from .app import register_broker

app = typer.Typer(add_completion=False)
register_broker(app)

if __name__ == "__main__":
    app()
