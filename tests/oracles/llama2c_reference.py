"""A direct NumPy port of llama2.c's ``run.c`` forward pass, reading the ``.bin`` file itself.

It shares no code with foudre (its own file parsing, interleaved RoPE as run.c does it, its own
KV cache), so agreement with it checks our loader's weight permutation and the whole engine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Llama2cReference:
    def __init__(self, path: Path) -> None:
        raw = path.read_bytes()
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = np.frombuffer(raw[:28], np.int32)
        self.shared = vocab > 0
        vocab = abs(int(vocab))
        self.dim, self.n_layers, self.n_heads, self.n_kv = (
            int(dim),
            int(n_layers),
            int(n_heads),
            int(n_kv),
        )
        self.head = self.dim // self.n_heads
        self.seq_len = int(seq_len)
        w = np.frombuffer(raw[28:], np.float32)
        off = 0

        def take(*shape: int) -> np.ndarray:
            nonlocal off
            size = int(np.prod(shape))
            out = w[off : off + size].reshape(shape)
            off += size
            return out

        L, D, H = self.n_layers, self.dim, int(hidden)
        kvd = self.n_kv * self.head
        self.emb = take(vocab, D)
        self.att_norm = take(L, D)
        self.wq, self.wk, self.wv = take(L, D, D), take(L, kvd, D), take(L, kvd, D)
        self.wo = take(L, D, D)
        self.ffn_norm = take(L, D)
        self.w1, self.w2, self.w3 = take(L, H, D), take(L, D, H), take(L, H, D)
        self.final_norm = take(D)
        take(self.seq_len * self.head // 2)
        take(self.seq_len * self.head // 2)
        self.wcls = self.emb if self.shared else take(vocab, D)

    @staticmethod
    def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * (x / np.sqrt(np.mean(x * x) + 1e-5))

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        x = x.copy()
        for i in range(0, x.shape[0], 2):
            head_dim = i % self.head
            freq = 1.0 / (10000.0 ** (head_dim / self.head))
            c, s = np.cos(pos * freq), np.sin(pos * freq)
            x0, x1 = x[i], x[i + 1]
            x[i], x[i + 1] = x0 * c - x1 * s, x0 * s + x1 * c
        return x

    def greedy(self, token: int, steps: int) -> list[int]:
        kvd = self.n_kv * self.head
        kc = np.zeros((self.n_layers, self.seq_len, kvd), np.float32)
        vc = np.zeros_like(kc)
        out = []
        for pos in range(steps):
            x = self.emb[token].astype(np.float32)
            for layer in range(self.n_layers):
                h = self._rms(x, self.att_norm[layer])
                q = self._rope(self.wq[layer] @ h, pos)
                kc[layer, pos] = self._rope(self.wk[layer] @ h, pos)
                vc[layer, pos] = self.wv[layer] @ h
                att = np.zeros(self.dim, np.float32)
                rep = self.n_heads // self.n_kv
                for hd in range(self.n_heads):
                    kv = hd // rep
                    qh = q[hd * self.head : (hd + 1) * self.head]
                    keys = kc[layer, : pos + 1, kv * self.head : (kv + 1) * self.head]
                    scores = keys @ qh / np.sqrt(self.head)
                    scores = np.exp(scores - scores.max())
                    scores /= scores.sum()
                    att[hd * self.head : (hd + 1) * self.head] = (
                        scores @ vc[layer, : pos + 1, kv * self.head : (kv + 1) * self.head]
                    )
                x = x + self.wo[layer] @ att
                h = self._rms(x, self.ffn_norm[layer])
                a = self.w1[layer] @ h
                x = x + self.w2[layer] @ ((a / (1.0 + np.exp(-a))) * (self.w3[layer] @ h))
            logits = self.wcls @ self._rms(x, self.final_norm)
            token = int(np.argmax(logits))
            out.append(token)
        return out
