"""Running training jobs: config parsing, the Hydra entry, the per-rank worker, reports."""
