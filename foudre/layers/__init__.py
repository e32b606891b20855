"""Building blocks shared by the models: norms, rotary embeddings, sampling."""
