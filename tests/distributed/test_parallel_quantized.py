"""Oracle: a GPTQ / AWQ checkpoint loaded sharded holds, on each rank, exactly the codes of its
slice of the one-device model (dequantized weights compared), and generates like it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from foudre import LLM, SamplingParams
from foudre.quant.hf_import import AWQ_ORDER
from foudre.quant.qlinear import QuantLinear
from tests.conftest import make_hf_model
from tests.quant.test_import import _fit, _pack_cols, _pack_gptq_rows

GROUP = 32


def _write_int4(src: Path, out: Path, method: str) -> Path:
    """``src``'s projections as a 4-bit ``method`` checkpoint in groups of ``GROUP``."""
    state = load_file(str(src / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.dim() == 2 and "proj" in name:
            prefix = name.removesuffix(".weight")
            q, s, z = _fit(t, GROUP, torch.arange(t.shape[1]) // GROUP)
            if method == "gptq":
                tensors[prefix + ".qweight"] = _pack_gptq_rows(q)
                tensors[prefix + ".qzeros"] = _pack_cols((z - 1).int())
            else:
                tensors[prefix + ".qweight"] = _pack_cols(q, AWQ_ORDER)
                tensors[prefix + ".qzeros"] = _pack_cols(z.int(), AWQ_ORDER)
            tensors[prefix + ".scales"] = s.half()
        else:
            tensors[name] = t
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    qc = {"quant_method": method, "bits": 4, "group_size": GROUP, "version": "gemm"}
    raw = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    return out


def _weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    mod = model.get_submodule(name)
    assert isinstance(mod, QuantLinear), name
    return mod.effective_weight().float()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_checkpoint_shards_hold_their_codes(tmp_path: Path, method: str) -> None:
    src = make_hf_model(tmp_path / "src", "llama", num_key_value_heads=4)
    path = _write_int4(src, tmp_path / method, method)
    engine = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32)
    one = LLM(str(path), **engine)
    sharded = LLM(str(path), tensor_parallel_size=2, **engine)
    try:
        full, mine = one.engine.model, sharded.engine.model  # rank 0: tensor rank 0's slices
        q, kv = 64, 64  # 4 heads and 4 KV heads of 16, halved
        qkv = _weight(full, "model.layers.0.self_attn.qkv_proj")
        want = torch.cat([qkv[: q // 2], qkv[q : q + kv // 2], qkv[q + kv : q + kv + kv // 2]])
        assert torch.equal(_weight(mine, "model.layers.0.self_attn.qkv_proj"), want)
        o = _weight(full, "model.layers.1.self_attn.o_proj")
        assert torch.equal(_weight(mine, "model.layers.1.self_attn.o_proj"), o[:, : q // 2])
        down = _weight(full, "model.layers.1.mlp.down_proj")
        assert torch.equal(_weight(mine, "model.layers.1.mlp.down_proj"), down[:, :64])
        gate_up = _weight(full, "model.layers.0.mlp.gate_up_proj")
        got = _weight(mine, "model.layers.0.mlp.gate_up_proj")
        assert torch.equal(got, torch.cat([gate_up[:64], gate_up[128:192]]))
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        prompts = [[1, 5, 9, 33, 7], list(range(1, 30))]
        for a, b in zip(
            one.generate(prompts, params), sharded.generate(prompts, params), strict=True
        ):
            lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
            assert lp_a is not None and lp_b is not None
            # the quantized kernels round each rank's activations and partial sums on their own
            assert max(abs(lp_a[0][t] - lp_b[0][t]) for t in set(lp_a[0]) & set(lp_b[0])) < 0.1
    finally:
        sharded.shutdown()
