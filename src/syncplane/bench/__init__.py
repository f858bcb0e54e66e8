"""syncplane.bench: each strategy's real per-step sync, timed side by side on an emulated cluster."""
