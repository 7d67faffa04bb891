"""Weight soups: the average of several merged models of one base, moved toward or past the base.

    theta = base + eta * (mean(ingredients) - base)

eta 1 is the plain soup (the base is not read), eta < 1 interpolates toward the base (WiSE-FT), eta > 1 goes past
the soup along its change from the base. One ingredient and an eta is the interpolation of that model alone.

Written by hand: mergekit (the library for this) does not read transformers-5 Qwen2-VL configs, and a soup of
same-architecture checkpoints needs no more than safetensors. Tensors are averaged in float32 one at a time from
memory-mapped files and written shard by shard in the first ingredient's layout, dtype and file metadata, so host
memory stays near one shard, not k models. The other files (config, processor, generation config) are the first
ingredient's.

`python -m search.merge --spec RUN_DIR/merge.json` builds the spec's model into RUN_DIR/merged and writes the round
folder's status.json as a trainer would (state, 0 steps, timings {"build": seconds}), so that a backend runs a merge
like a round: build, then the same evaluation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SPEC_FILE = "merge.json"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class MergeSpec:
    """One merge candidate: its ingredients (merged model folders of one base), the base, and eta."""

    ingredients: tuple[str, ...]
    base: str
    eta: float = 1.0

    def __post_init__(self) -> None:
        if not self.ingredients:
            raise ValueError("a merge needs at least one ingredient")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")

    @property
    def models_read(self) -> int:
        """Models the build reads: the ingredients, and the base unless eta is 1."""
        return len(self.ingredients) + (self.eta != 1.0)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({**asdict(self), "ingredients": list(self.ingredients)}, indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "MergeSpec":
        data = json.loads(Path(path).read_text())
        return cls(tuple(data["ingredients"]), data["base"], float(data["eta"]))


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a `save_pretrained` folder (one file or an index)."""
    folder = Path(folder)
    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / _SINGLE
    if not single.is_file():
        raise FileNotFoundError(f"{folder} holds neither {_SINGLE} nor {_INDEX}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def build(spec: MergeSpec, output: str | Path) -> Path:
    """Write the merge of `spec` into `output` (through a temporary sibling and a rename); returns `output`."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    output = Path(output)
    maps = [weight_files(folder) for folder in spec.ingredients]
    base_map = weight_files(spec.base) if spec.eta != 1.0 else None
    names = set(maps[0])
    for folder, other in zip(spec.ingredients[1:], maps[1:]):
        if set(other) != names:
            raise ValueError(f"{folder} does not hold the same tensors as {spec.ingredients[0]}")
    if base_map is not None and not names <= set(base_map):
        missing = sorted(names - set(base_map))[0]
        raise ValueError(f"the base {spec.base} lacks the tensor {missing}")

    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(spec.ingredients[0], tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    handles: dict[Path, object] = {}

    def tensor(path: Path, name: str) -> torch.Tensor:
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(name)

    try:
        shards: dict[Path, list[str]] = {}
        for name, path in maps[0].items():
            shards.setdefault(path, []).append(name)
        for shard, shard_names in shards.items():
            with safe_open(str(shard), framework="pt") as f:
                metadata = f.metadata()
            out: dict[str, torch.Tensor] = {}
            for name in shard_names:
                first = tensor(shard, name)
                total = first.to(torch.float32, copy=True)
                for other in maps[1:]:
                    total += tensor(other[name], name).to(torch.float32)
                theta = total / len(maps)
                if base_map is not None:
                    base = tensor(base_map[name], name).to(torch.float32)
                    theta = base + spec.eta * (theta - base)
                out[name] = theta.to(first.dtype).contiguous()
            save_file(out, str(tmp / shard.name), metadata=metadata)
            del out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what the half-written copy took
        raise
    finally:
        handles.clear()
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    return output


def main(argv: list[str] | None = None) -> int:
    from trainer.run_folder import MERGED_DIR, RoundState, Status, write_status

    parser = argparse.ArgumentParser(prog="python -m search.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help=f"RUN_DIR/{SPEC_FILE}")
    args = parser.parse_args(argv)
    run_dir = args.spec.parent
    began = time.monotonic()
    try:
        spec = MergeSpec.from_json(args.spec)
        build(spec, run_dir / MERGED_DIR)
    except Exception as error:  # noqa: BLE001 - the round's status says why; the search goes on
        write_status(run_dir, Status(RoundState.FAILED, f"the merge failed: {type(error).__name__}: {error}", 0))
        print(f"merge failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    seconds = time.monotonic() - began
    write_status(run_dir, Status(RoundState.COMPLETED, None, 0, {"build": seconds}))
    print(f"merged {len(spec.ingredients)} model(s) at eta {spec.eta:g} in {seconds:.1f} s")
    return 0

