"""Building blocks shared by the models: linear layers, norms, rotary embeddings, gated MLPs and
mixtures of experts, sampling."""
