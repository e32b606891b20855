"""A model, not a measurement: decode step time of Llama 3 8B and 70B (bfloat16) under tensor
(T) and pipeline (P) parallelism on H100 nodes, from published hardware figures, to show where
tensor parallelism stops paying and pipeline parallelism takes over. docs/parallelism.md
explains the assumptions; every constant below is one of them.

    .venv/bin/python benchmarks/parallel_model.py

A decode step is bound by reading weights and KV (batch 64 at 2 flop/byte is still far below
the H100's flop/byte ratio), so each GPU's compute time is (its weight bytes + its KV bytes) /
attained HBM bandwidth. Tensor parallelism splits both by T (KV by at most the number of KV
heads: beyond that heads are replicated) and adds 2 all-reduces per layer of batch x hidden
values, each costing alpha(T) + 2(T-1)/T x bytes / busbw (ring; NVLink SHARP and trees do
better at large sizes, none of which matters at decode sizes, where alpha dominates), one more
for the vocabulary-parallel embedding and an all-gather of the logits' vocabulary slices
(alpha(T) + (T-1)/T x batch x vocab x 2 bytes / busbw), as foudre's layers do. Pipeline
parallelism splits the layers into P stages that run one after the other for a batch: it cuts
neither the bytes a token needs nor the latency; it adds one point-to-point send of the
activations per stage boundary. With P micro-batches in flight every stage is busy, but each
micro-batch reads its stage's weights again, so the step time of the whole batch is the same
as without pipelining: pipeline parallelism buys memory (a model or a batch that does not fit),
not speed, in memory-bound decode.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
HBM_BW = 3350 * GB * 0.8  # H100 SXM HBM3 3.35 TB/s, 80% attained by a decode step
GPU_MEMORY = 80 * GB
NVLINK_BUSBW = 370 * GB  # NCCL ring all-reduce bus bandwidth on NVLink 4 (NVLS: ~480)
IB_BUSBW = 45 * GB  # NDR 400 Gb/s = 50 GB/s per GPU, ~90% attained
NVLINK_HOP_US = 0.5  # per ring step (LL protocol), plus a fixed launch/sync cost
NVLINK_FIXED_US = 2.0
IB_FIXED_US = 20.0  # a small all-reduce that crosses nodes (IB ~2-3 us a hop, NCCL proxy)
P2P_IB_US = 10.0  # one send/recv between pipeline stages on different nodes
CONTEXT = 1024  # average tokens per sequence whose KV a decode step reads


@dataclass(frozen=True)
class Llama:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    vocab: int = 128256
    head_dim: int = 128

    @property
    def weight_bytes(self) -> float:
        return self.params * 2

    def kv_bytes(self, batch: int) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2 * CONTEXT * batch


MODELS = (
    Llama("Llama-3-8B", 8.03e9, 32, 4096, 8),
    Llama("Llama-3-70B", 70.6e9, 80, 8192, 8),
)
# (T, P, nodes): one node of 8 GPUs on NVLink, or two nodes joined by InfiniBand NDR
LAYOUTS = ((1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (16, 1, 2), (8, 2, 2))


def collective_us(nbytes: float, t: int, nodes: int, gather: bool = False) -> float:
    """One ring all-reduce (or, ``gather``, all-gather: half the traffic) of ``nbytes`` over
    ``t`` ranks, in microseconds."""
    if t == 1:
        return 0.0
    alpha = NVLINK_FIXED_US + 2 * (t - 1) * NVLINK_HOP_US
    busbw = NVLINK_BUSBW
    if nodes > 1:
        alpha += IB_FIXED_US
        busbw = IB_BUSBW
    factor = (t - 1) / t if gather else 2 * (t - 1) / t
    return alpha + factor * nbytes / busbw * 1e6


def step(m: Llama, batch: int, t: int, p: int, nodes: int) -> dict[str, float]:
    """Modelled decode step of ``batch`` sequences: per-GPU memory, compute, communication."""
    kv_split = min(t, m.kv_heads)
    weights = m.weight_bytes / (t * p)
    kv = m.kv_bytes(batch) / (kv_split * p)
    stage_compute_ms = (weights + kv) / HBM_BW * 1e3
    act = batch * m.hidden * 2  # bfloat16 activations of one all-reduce
    tp_nodes = nodes if p == 1 else 1  # PP keeps each TP group inside a node
    per_ar_us = collective_us(act, t, tp_nodes)
    count = 2 * m.layers + 1
    logits_us = collective_us(batch * m.vocab * 2, t, tp_nodes, gather=True)
    comm_ms = (count * per_ar_us + logits_us) / 1e3
    p2p_ms = (p - 1) * (P2P_IB_US + act / IB_BUSBW * 1e6) / 1e3
    compute_ms = p * stage_compute_ms  # stages run one after the other for a batch
    total = compute_ms + comm_ms + p2p_ms
    return dict(
        memory_gb=(weights + kv) / GB,
        compute_ms=compute_ms,
        count=count,
        ar_bytes=act,
        per_ar_us=per_ar_us,
        comm_ms=comm_ms + p2p_ms,
        share=(comm_ms + p2p_ms) / total,
        step_ms=total,
        tok_s=batch / total * 1e3,
    )


def main() -> None:
    for m in MODELS:
        for batch in (1, 64):
            print(f"\n{m.name}, batch {batch}, {CONTEXT}-token contexts")
            print(
                "| T x P (nodes) | GB per GPU | compute ms | all-reduces x bytes | us each "
                "| comm ms (+ logits) | comm share | step ms | tok/s | vs T=1 |"
            )
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            base = step(m, batch, 1, 1, 1)["step_ms"]
            for t, p, nodes in LAYOUTS:
                r = step(m, batch, t, p, nodes)
                fits = "" if r["memory_gb"] * GB < GPU_MEMORY else " (does not fit 80 GB)"
                print(
                    f"| {t} x {p} ({nodes}) | {r['memory_gb']:.1f}{fits} | {r['compute_ms']:.2f} "
                    f"| {r['count']} x {r['ar_bytes'] / 1024:.0f} KiB | {r['per_ar_us']:.1f} "
                    f"| {r['comm_ms']:.2f} | {r['share']:.0%} | {r['step_ms']:.2f} "
                    f"| {r['tok_s']:.0f} | {base / r['step_ms']:.2f}x |"
                )


if __name__ == "__main__":
    main()
