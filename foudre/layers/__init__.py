"""Neural-network layers shared by the models: linear layers (plain, quantized through
``quant``, parallel), norms, rotary embeddings, gated MLPs, mixtures of experts, and their fused
CPU kernels."""
