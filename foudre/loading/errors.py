"""The one error every loader raises."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(Exception):
    """A model, its weights, its config or its tokenizer could not be loaded.

    The message is always a single line that names the file (or model id) and the problem, so
    it can be shown to a user as is. ``path`` is the file at fault, when there is one.
    """

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        super().__init__(" ".join(message.split()))
