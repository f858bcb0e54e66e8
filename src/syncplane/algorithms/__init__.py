"""Synchronization algorithms: each one's policy, maths and engine in a package of its own."""
