"""FlexReduce's tree all-reduce (Lee et al.): the network tree (``tree``), the paper's planner
(``plan``, pure), the pipelined executor on torch.distributed (``executor``) and its α-β
cost (``cost``). DiLoCo's ``tree`` exchange and the ``flexreduce`` strategy both run it."""
