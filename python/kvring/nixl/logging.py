"""NIXL's ``nixl.logging``: ``get_logger(name)``, a standard logger."""

import logging


def get_logger(name=None):
    """The standard library's logger for ``name``."""
    return logging.getLogger(name)
