"""Safetensors weights (single, sharded, globbed), their failures, and model path resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from foudre.loading import ModelLoadError, iter_safetensors_weights, resolve_model_path


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(4, dtype=torch.float16),
    }


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def _sharded(tmp_path: Path) -> dict[str, torch.Tensor]:
    tensors = _tensors()
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_single_file(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _assert_same(dict(iter_safetensors_weights(tmp_path)), tensors)
    _assert_same(dict(iter_safetensors_weights(tmp_path / "model.safetensors")), tensors)


def test_sharded(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path)
    _assert_same(dict(iter_safetensors_weights(tmp_path)), tensors)


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[-1] if len(rest) == 5 else ""
    return ""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc maps")
def test_mapped_tensors_are_views_of_the_file_with_its_values(tmp_path: Path) -> None:
    """``mapped=True`` (what ``load_model`` reads): each tensor a view of the file's map, no
    copy, whose values (read as the next is asked for: its pages dropped by then, read again)
    are the stored ones; a tensor whose first byte its element size does not divide is read
    into a copy of its own."""
    tensors = _sharded(tmp_path)
    got = {}
    for name, tensor in iter_safetensors_weights(tmp_path, mapped=True):
        assert _mapped_file(tensor.data_ptr()).startswith(str(tmp_path / "model-0000"))
        got[name] = tensor
    _assert_same(got, tensors)
    odd = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.arange(5, dtype=torch.float32)}
    save_file(odd, str(tmp_path / "odd.safetensors"))
    _assert_same(dict(iter_safetensors_weights(tmp_path / "odd.safetensors", mapped=True)), odd)


def test_glob_of_unindexed_files(tmp_path: Path) -> None:
    tensors = _tensors()
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:1]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[1:]}, str(tmp_path / "b.safetensors"))
    _assert_same(dict(iter_safetensors_weights(tmp_path)), tensors)
    save_file({names[0]: tensors[names[0]]}, str(tmp_path / "c.safetensors"))
    with pytest.raises(ModelLoadError, match=r"c.safetensors.*appears twice"):
        dict(iter_safetensors_weights(tmp_path))


def test_missing_shard(tmp_path: Path) -> None:
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors.*does not exist"):
        list(iter_safetensors_weights(tmp_path))


def test_shard_lacking_an_indexed_tensor(tmp_path: Path) -> None:
    _sharded(tmp_path)
    save_file({"other": torch.zeros(1)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors.*lacks"):
        list(iter_safetensors_weights(tmp_path))


@pytest.mark.parametrize("cut", [5, 40, -8])
def test_truncated_or_corrupt_file(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match=r"model.safetensors"):
        list(iter_safetensors_weights(tmp_path))


def test_garbage_header(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
    )
    with pytest.raises(ModelLoadError, match=r"model.safetensors"):
        list(iter_safetensors_weights(tmp_path))


def test_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02not really a pickle")
    with pytest.raises(ModelLoadError, match=r"pytorch_model.bin.*pickle.*safetensors"):
        list(iter_safetensors_weights(tmp_path))
    with pytest.raises(ModelLoadError, match=r"pickle"):
        list(iter_safetensors_weights(tmp_path / "pytorch_model.bin"))


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        list(iter_safetensors_weights(tmp_path))


def test_resolve_local_paths(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path
    (tmp_path / "m.bin").write_bytes(b"")
    assert resolve_model_path(str(tmp_path / "m.bin")) == tmp_path / "m.bin"
    with pytest.raises(ModelLoadError, match=r"no such file or directory"):
        resolve_model_path(str(tmp_path / "nope" / "deeper"))
    with pytest.raises(ModelLoadError, match=r"no such file or directory"):
        resolve_model_path("./not-here")


def test_resolve_hub_id_offline(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"'some-org/some-model' is not a local path.*offline"):
        resolve_model_path("some-org/some-model", cache_dir=tmp_path, local_files_only=True)


def test_resolve_hub_id_from_cache(tmp_path: Path) -> None:
    repo = tmp_path / "models--some-org--some-model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    path = resolve_model_path("some-org/some-model", cache_dir=tmp_path, local_files_only=True)
    assert path == snapshot and (path / "config.json").is_file()
