"""Errors of the comm layer."""


class TopologyError(ValueError, RuntimeError):
    """Senders and receivers of a neighbour operation disagree (the message names the ranks),
    or a neighbour operation did not complete in time.

    A ``ValueError`` because that is what BlueFog raises for a plan mismatch (so a BlueFog
    program's ``except ValueError`` keeps working); still a ``RuntimeError`` for callers
    written against syncplane's earlier releases.
    """
