"""Errors of the comm layer."""


class TopologyError(RuntimeError):
    """Senders and receivers of a neighbour operation disagree (the message names the ranks),
    or a neighbour operation did not complete in time."""
