"""Model compression: training from scratch, distillation, structured pruning, perplexity.

Everything here trains and evaluates foudre's own ``LlamaForCausalLM`` through a dense causal
attention backend (``foudre/attention/causal.py``), so the model that is trained is the
model that is served, and the checkpoints written are standard Hugging Face directories.
"""
