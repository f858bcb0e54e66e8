"""What an external launcher hands each rank, for tests that start the ranks themselves."""

from __future__ import annotations


def slurm_rank(rank: int, world: int, port: int, job: str = "4242") -> dict[str, str]:
    """What srun sets for one task of a one-node job (the subset Lightning reads)."""
    return {"SLURM_NTASKS": str(world), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "syncplane-test", "SLURM_NODELIST": "localhost",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
