"""Speculative decoding: proposers guess tokens, the target verifies them in its normal step.

- ``proposers.py``: the ``Proposer`` interface, n-gram prompt lookup and a draft model with its
  own paged KV cache.
- ``registry.py``: ``PROPOSERS``, the proposer for each ``speculative_method``, built from the
  engine's configuration.
- The rejection sampler that keeps the target's output distribution exactly, and ``verify``,
  are samplers: ``foudre.sample.rejection``.
"""
