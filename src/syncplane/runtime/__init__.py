"""The job runtime: the launcher and rendezvous, the per-rank worker, liveness (heartbeat),
the elastic quorum service, reports and checkpoints. It is the only layer that reads the
launcher's environment: it builds one ``syncplane.job.JobContext`` per process and hands
it down to the strategy."""
