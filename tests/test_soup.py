"""search.merge.soup: the averaged tensors, eta toward and past the base, the layout kept, bad ingredients refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from search.merge import soup
from trainer.run_folder import MERGED_DIR, RoundState, read_status

NAMES = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight")


def model_folder(folder: Path, seed: int, *, dtype=torch.bfloat16, sharded: bool = False, names=NAMES) -> Path:
    """A save_pretrained-like folder: config.json, a processor file, random weights (one file or two shards)."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(6, 4, generator=generator).to(dtype) for name in names}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "seed": seed}))
    (folder / "preprocessor_config.json").write_text("{}")
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    first, second = dict(list(tensors.items())[:1]), dict(list(tensors.items())[1:])
    save_file(first, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in first},
                  **{n: "model-00002-of-00002.safetensors" for n in second}}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: load_file(str(path))[name] for name, path in soup.weight_files(folder).items()}


@pytest.fixture
def models(tmp_path):
    base = model_folder(tmp_path / "base", 0, sharded=True)  # a hub-like base; rounds save one file
    rounds = [model_folder(tmp_path / f"round-{i}", i) for i in (1, 2, 3)]
    return base, rounds


def test_a_uniform_soup_is_the_float32_mean_of_its_ingredients_in_their_dtype(models, tmp_path):
    base, rounds = models
    out = soup.build(soup.MergeSpec(tuple(map(str, rounds)), str(base)), tmp_path / "soup")
    merged, ingredients = weights(out), [weights(r) for r in rounds]
    assert set(merged) == set(NAMES)
    for name in NAMES:
        mean = sum(w[name].float() for w in ingredients) / 3
        assert merged[name].dtype == torch.bfloat16
        assert torch.equal(merged[name], mean.to(torch.bfloat16))
        assert not torch.equal(merged[name], ingredients[0][name])  # an average, not a copy of the first


def test_eta_zero_gives_the_base_and_eta_one_the_soup(models, tmp_path):
    base, rounds = models
    ingredients = tuple(map(str, rounds[:2]))
    at_zero = weights(soup.build(soup.MergeSpec(ingredients, str(base), eta=0.0), tmp_path / "zero"))
    at_one = weights(soup.build(soup.MergeSpec(ingredients, str(base), eta=1.0), tmp_path / "one"))
    past = weights(soup.build(soup.MergeSpec(ingredients, str(base), eta=1.5), tmp_path / "past"))
    for name, tensor in weights(base).items():
        assert torch.equal(at_zero[name], tensor)
        mean = (weights(rounds[0])[name].float() + weights(rounds[1])[name].float()) / 2
        assert torch.equal(at_one[name], mean.to(torch.bfloat16))
        expected = tensor.float() + 1.5 * (mean - tensor.float())
        assert torch.allclose(past[name].float(), expected, atol=0.02, rtol=0.01)


def test_one_ingredient_at_an_eta_interpolates_that_model_toward_the_base(models, tmp_path):
    base, rounds = models
    half = weights(soup.build(soup.MergeSpec((str(rounds[0]),), str(base), eta=0.5), tmp_path / "half"))
    b, r = weights(base), weights(rounds[0])
    for name in NAMES:
        assert torch.allclose(half[name].float(), (b[name].float() + r[name].float()) / 2, atol=0.02)


def test_the_first_ingredients_files_layout_and_metadata_are_kept(tmp_path):
    base = model_folder(tmp_path / "base", 0)
    sharded = [model_folder(tmp_path / f"r{i}", i, sharded=True, dtype=torch.float32) for i in (1, 2)]
    out = soup.build(soup.MergeSpec(tuple(map(str, sharded)), str(base)), tmp_path / "soup")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in sharded[0].iterdir())
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    with safe_open(str(out / "model-00001-of-00002.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and list(f.keys()) == [NAMES[0]]
    assert weights(out)[NAMES[1]].dtype == torch.float32
    assert not (tmp_path / ".soup.tmp").exists()


def test_ingredients_with_other_tensors_are_refused_and_nothing_is_left(tmp_path):
    base = model_folder(tmp_path / "base", 0)
    a = model_folder(tmp_path / "a", 1)
    b = model_folder(tmp_path / "b", 2, names=NAMES[:2])
    with pytest.raises(ValueError, match="does not hold the same tensors"):
        soup.build(soup.MergeSpec((str(a), str(b)), str(base)), tmp_path / "soup")
    with pytest.raises(ValueError, match="the base .* lacks the tensor"):
        soup.build(soup.MergeSpec((str(a),), str(b), eta=0.5), tmp_path / "soup")
    assert not (tmp_path / "soup").exists() and not (tmp_path / ".soup.tmp").exists()


def test_a_spec_round_trips_and_refuses_what_is_no_merge(tmp_path):
    spec = soup.MergeSpec(("a", "b"), "base", eta=0.75)
    spec.to_json(tmp_path / "merge.json")
    assert soup.MergeSpec.from_json(tmp_path / "merge.json") == spec
    assert spec.models_read == 3 and soup.MergeSpec(("a",), "base").models_read == 1
    with pytest.raises(ValueError, match="at least one ingredient"):
        soup.MergeSpec((), "base")
    with pytest.raises(ValueError, match="eta must be >= 0"):
        soup.MergeSpec(("a",), "base", eta=-0.5)


def test_the_command_writes_the_merged_model_and_a_round_status(models, tmp_path):
    base, rounds = models
    run_dir = tmp_path / "round-0009"
    run_dir.mkdir()
    soup.MergeSpec(tuple(map(str, rounds)), str(base), eta=1.25).to_json(run_dir / soup.SPEC_FILE)
    assert soup.main(["--spec", str(run_dir / soup.SPEC_FILE)]) == 0
    status = read_status(run_dir)
    assert status.state == RoundState.COMPLETED and status.steps_done == 0
    assert set(status.timings) == {"build"} and status.timings["build"] > 0
    assert set(weights(run_dir / MERGED_DIR)) == set(NAMES)


def test_the_command_reports_a_failed_merge_in_the_status(tmp_path):
    run_dir = tmp_path / "round-0010"
    run_dir.mkdir()
    soup.MergeSpec((str(tmp_path / "missing"),), str(tmp_path / "base")).to_json(run_dir / soup.SPEC_FILE)
    assert soup.main(["--spec", str(run_dir / soup.SPEC_FILE)]) == 1
    status = read_status(run_dir)
    assert status.state == RoundState.FAILED and "the merge failed: FileNotFoundError" in status.reason
    assert not (run_dir / MERGED_DIR).exists()
