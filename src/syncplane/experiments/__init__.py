"""Experiment tooling built on the product and never imported by it: fault injection
(``chaos``), strategy comparisons (``comparison``) and the peers from other projects run
beside ours (Horovod, torchft DiLoCo: ``peers``, ``peer_loop``)."""
