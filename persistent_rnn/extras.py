"""How to install an optional extra, in the one wording every message uses.

The package is not published on any index (a ``pip install persistent-rnn`` would find nothing,
or one day someone else's package): extras are installed from a clone, or with the wheel built
from one (README.md, "Install").
"""


def install_hint(extra: str) -> str:
    """The command that adds ``extra`` (e.g. ``"cuda13"``), from a clone of the repository."""
    return f'pip install ".[{extra}]" in a clone of persistent_rnn (it is not on PyPI)'
