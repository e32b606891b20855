"""Speculative decoding: proposers guess tokens, the target verifies them in its normal step.

- ``proposers.py``: the ``Proposer`` interface, n-gram prompt lookup and a draft model with its
  own paged KV cache.
- ``rejection.py``: the rejection sampler that keeps the target's output distribution exactly,
  and ``verify``, which turns the target's logits at every draft position into accepted tokens.
"""
