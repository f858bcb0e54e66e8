"""FlexReduce (Lee et al.): an all-reduce with uneven portions planned on the network tree.

``tree`` builds the tree, ``plan`` is the paper's planner (pure), ``executor`` runs a plan
on torch.distributed, ``cost`` is its α-β pattern, ``bench`` its bench step and peer.
"""
