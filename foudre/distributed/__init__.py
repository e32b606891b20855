"""Tensor and pipeline parallelism over ``torch.distributed`` (see ``executor`` for a step's
walk across the ranks, ``plan`` for who holds what, ``experts`` for mixtures of experts)."""
