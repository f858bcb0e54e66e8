"""Shared pytest setup: the repository root is importable (``tests.helpers``)."""
