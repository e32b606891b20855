"""Sampling: the batched sampler over a step's logits rows (``sampler``: penalties, temperature,
top-k / top-p / min-p, grammar masks, log-probabilities) and the rejection sampler that keeps a
speculative target's distribution exact (``rejection``)."""
